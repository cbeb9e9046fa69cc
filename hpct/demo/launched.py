"""The demo's training job, launched by ``hpct run`` as a user would launch theirs.

One node's agent (``hpct run --nproc-per-node N -m hpct.demo.trainer ...``, in a subprocess)
starts the ranks, forked from its fork server (the default); on a fault the demo SIGKILLs one
rank where it waits in a step, the agent replaces it at the next generation (forked, so warm)
and the survivors recover in-process.  What the user lives through is measured from the kill:
every rank's next completed step (``stepped`` in the trainer's records), the replacement's start
included.  The job is bounded by the demo's deadline; the agent and everything under it are
killed at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..ports import free_port_block

# The flags the demo gives hpct run besides its own bookkeeping (port base, logs, event log):
# what a user would type; every other option keeps hpct run's default (a fork server per node).
RUN_FLAGS = ("--nproc-per-node",)
AGENT = "import sys; del sys.path[0]; from hpct.cli import main; sys.exit(main())"
HANG_SETTLE_S = 0.3        # the survivors are inside the step's all_reduce when the victim dies
PORTS_PER_RANK = 2 * 8     # the Gloo and NCCL blocks of the plan, 8 slots each


@dataclass(frozen=True)
class Launched:
    """One finished job: the trainer's records, the agent's events, and the fault (if any)."""

    records: list
    events: list
    launcher: str                  # the hpct run command line a user would type
    victim: int | None
    t_kill: float | None           # time.time() right before the SIGKILL

    def first_pids(self) -> dict[int, int]:
        """rank -> the pid hpct run started it with at generation 0."""
        return {e["rank"]: e["pid"] for e in self.events if e["event"] == "start" and e["generation"] == 0}

    def starts(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "start"]

    def resumed_s(self) -> float:
        """Seconds from the kill to the moment every rank had completed a step after it."""
        latest = {}
        for r in self.records:
            after = [e["t"] for e in r.get("stepped", []) if e["t"] > self.t_kill]
            if after:
                latest[r["rank"]] = min(after + [latest.get(r["rank"], float("inf"))])
        missing = sorted(set(range(len(self.first_pids()))) - set(latest))
        if missing:
            raise RuntimeError(f"ranks {missing} completed no step after the kill")
        return max(latest.values()) - self.t_kill


def launcher_line(n: int) -> str:
    return f"hpct run {RUN_FLAGS[0]} {n}"


def run(out: Path, n: int, steps: int, fault: int | None, deadline: float, trainer_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None) -> Launched:
    """Train ``n`` ranks for ``steps`` steps under hpct run; with ``fault``, SIGKILL rank n // 2
    while it waits in that step (the trainer's --hang) and let hpct run replace it.  ``trainer_args``
    and ``env`` go to the trainer and to hpct run (the GPU proof trains on CUDA so)."""
    out.mkdir(parents=True)
    victim = n // 2 if fault is not None else None
    trainer = ["-m", "hpct.demo.trainer", "train", str(out), "--steps", str(steps), *trainer_args]
    if fault is not None:
        trainer += ["--hang", f"{victim}:{fault}:0"]
    events = out / "events.jsonl"
    argv = [sys.executable, "-c", AGENT, "run", RUN_FLAGS[0], str(n),
            "--port-base", str(free_port_block(PORTS_PER_RANK * n + 2)), "--rdzv-id", "hpct-demo",
            "--json", str(events), "--log-dir", str(out / "logs"), *trainer]
    env = {**os.environ, "HPCT_CONNECT_TIMEOUT": "30", "OMP_NUM_THREADS": "1", **(env or {})}
    with open(out / "agent.log", "w") as log:
        agent = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(out),
                                 start_new_session=True)
    t_kill = None
    try:
        if fault is not None:
            hang = out / f"hang-{victim}-0"
            _wait(lambda: hang.exists() and hang.read_text().strip(), agent, deadline, out,
                  f"rank {victim} at step {fault}")
            time.sleep(HANG_SETTLE_S)
            pid = int(hang.read_text())
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
        try:
            code = agent.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"hpct run did not finish before the demo's deadline:\n{_tail(out)}") from None
        if code != 0:
            raise RuntimeError(f"hpct run exited with {code}:\n{_tail(out)}")
    finally:
        _stop(agent, events)
    records = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    return Launched(records, _events(events), launcher_line(n), victim, t_kill)


def _wait(ready, agent: subprocess.Popen, deadline: float, out: Path, what: str) -> None:
    while not ready():
        if agent.poll() is not None:
            raise RuntimeError(f"hpct run exited with {agent.returncode} before {what}:\n{_tail(out)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached before the demo's deadline:\n{_tail(out)}")
        time.sleep(0.01)


def _events(path: Path) -> list[dict]:
    docs = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            docs.append(json.loads(line))
        except ValueError:
            break
    return docs


def _stop(agent: subprocess.Popen, events: Path) -> None:
    """The agent, then every worker it started (each in a session of its own)."""
    if agent.poll() is None:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)
    for e in _events(events):
        if "pid" in e and e["event"] in ("start", "fork-server"):
            try:
                os.killpg(e["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _tail(out: Path) -> str:
    logs = [out / "agent.log", *sorted((out / "logs").rglob("*.log"))]
    return "\n".join(f"--- {p.relative_to(out)}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
