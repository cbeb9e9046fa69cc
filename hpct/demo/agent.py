"""A minimal local cluster agent for the tests and benchmarks (`hpct demo` trains under `hpct run`:
hpct/demo/launched.py).

It starts the ranks of a job on this machine, kills ranks on cue and starts replacements
with the same rank and the survivors' next generation, as a real cluster agent would.  The
recovery tests (tests/test_recovery.py, the NCCL simulation's and the GPU proof's) need what
`hpct run` deliberately does not offer: ranks started in an order they choose (rank 0 last),
a replacement started late, at a generation they choose or never, and ranks forked by the
suite's own fork server (tests/zygote.py).  Every process is bounded by a deadline; on exit
everything still running is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..ports import free_port_block  # noqa: F401  (callers take it from here with Job)


@dataclass
class Job:
    """The ranks of one local job running ``argv`` (a list; RANK etc. come from the environment)."""

    argv: list[str]
    world_size: int
    port_base: int
    out: Path
    deadline: float                      # absolute time.monotonic() deadline for every process
    env: dict = field(default_factory=dict)
    procs: dict = field(default_factory=dict)      # rank -> Popen (current)
    history: list = field(default_factory=list)    # every Popen started, with its rank and generation
    # launcher(argv, env, log, cwd) -> a Popen-like process in a session of its own, output in
    # log; None: subprocess.Popen.  The test suite passes its fork server (tests/zygote.py).
    launcher: Callable | None = None

    def rank_env(self, rank: int, generation: int) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCT_", "TORCH_GLOO", "TORCH_NCCL"))}
        env.update({"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(self.world_size), "N_PROC_PER_NODE": str(self.world_size),
                    "HPCT_PORT_BASE": str(self.port_base), "HPCT_GENERATION": str(generation),
                    "OMP_NUM_THREADS": "1"})
        env.update(self.env)
        return env

    def start(self, rank: int, generation: int = 0, extra: list[str] | None = None) -> subprocess.Popen:
        log = self.out / f"stdout-{rank}-g{generation}.log"
        argv, env = self.argv + (extra or []), self.rank_env(rank, generation)
        if self.launcher is not None:
            p = self.launcher(argv, env, log, str(self.out))
        else:
            with open(log, "w") as out:
                p = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=str(self.out))
        self.procs[rank] = p
        self.history.append((rank, generation, p))
        return p

    def start_all(self, order=None, generation: int = 0, delay: float = 0.0, extra=None) -> None:
        for i, r in enumerate(order if order is not None else range(self.world_size)):
            if i and delay:
                time.sleep(delay)
            self.start(r, generation, extra)

    def wait_file(self, path: Path, timeout: float) -> None:
        end = min(time.monotonic() + timeout, self.deadline)
        while not path.exists():
            self.check_alive()
            if time.monotonic() > end:
                raise TimeoutError(f"{path} did not appear within {timeout:g} s")
            time.sleep(0.02)

    def check_alive(self) -> None:
        for r, p in self.procs.items():
            if p.poll() not in (None, 0) and p.returncode != -signal.SIGKILL:
                raise RuntimeError(f"rank {r} (pid {p.pid}) exited with {p.returncode}:\n{self.output(r)}")

    def output(self, rank: int) -> str:
        files = sorted(self.out.glob(f"stdout-{rank}-g*.log"))
        return "\n".join(f"--- {f.name}\n{f.read_text()[-4000:]}" for f in files)

    def kill(self, rank: int) -> None:
        p = self.procs[rank]
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)

    def wait_all(self) -> dict[int, int]:
        codes = {}
        for r, p in self.procs.items():
            left = max(self.deadline - time.monotonic(), 0.1)
            try:
                codes[r] = p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                self.stop()
                raise TimeoutError(f"rank {r} still running at the deadline:\n{self.output(r)}") from None
        return codes

    def stop(self) -> None:
        for _, _, p in self.history:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)

    def records(self) -> list[dict]:
        return [json.loads(f.read_text()) for f in sorted(self.out.glob("rank*.json"))]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


def rank_results(procs: list, deadline: float, what: str) -> list:
    """The last JSON line each subprocess rank prints, in order; a rank that fails or outlives
    ``deadline`` (monotonic) fails the run, and every rank left is killed."""
    try:
        results = []
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"{what}: rank failed:\n{err[-2000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def slowest_rank_seconds(procs: list, deadline: float, what: str) -> float:
    """The largest "seconds" that subprocess ranks print as their last JSON line (rank_results)."""
    return max(r["seconds"] for r in rank_results(procs, deadline, what))


def trainer_argv(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "hpct.demo.trainer", "train", str(out), *args]
