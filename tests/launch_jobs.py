"""Real training under `hpct run` for the launch tests (test_launch_recovery.py,
test_launch_forkserver.py, test_launch_slow_link.py): the example scripts, their step counts, the
fault-free digest a run must end with (stock torchrun on Gloo), and waiting for, killing and
checking the replaced worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpct.testing.cluster import Agents, progress, records

EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "ddp.py")
FSDP2 = str(Path(EXAMPLE).with_name("fsdp2.py"))
STEPS = ["--steps", "40", "--step-time", "0.03"]
# A node starts its standby once its workers' world formed, and the standby imports torch while
# they train: a job with one must outlast that import, or the kill lands after the last step (in
# CI 40 steps of 0.03 s ended 0.03 s before the standby was ready, and the kill hit the final barrier).
# Its 0.15 s sleep after the last step is also the window a test kills a worker in before it leaves.
LONG_STEPS = ["--steps", "50", "--step-time", "0.15"]
LIMIT_S = 180


_STOCK: dict[tuple[str, int, tuple[str, ...]], str] = {}


def stock_digest(tmp: Path, nproc: int, script: str = EXAMPLE, steps: list[str] = STEPS) -> str:
    """The fault-free run: torchrun and torch's own Gloo backend, the same script (once per size)."""
    key = (script, nproc, tuple(steps))
    if key in _STOCK:
        return _STOCK[key]
    out = tmp / "stock"
    out.mkdir()
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc-per-node={nproc}", script, *steps, "--backend", "gloo", "--out", str(out)],
                         capture_output=True, text=True, timeout=LIMIT_S, cwd=tmp,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    digests = {r["digest"] for r in records(out)}
    assert len(digests) == 1
    _STOCK[key] = digests.pop()
    return _STOCK[key]


def wait_progress(agents: Agents, out: Path, rank: int, step: int, timeout: float = 120, poll: float = 0.05) -> None:
    end = time.monotonic() + timeout
    while progress(out, rank) < step:
        assert time.monotonic() < end, agents.output(0)[-3000:]
        assert all(p.poll() is None for p in agents.procs), [agents.output(n) for n in range(agents.nodes)]
        time.sleep(poll)


def kill_once_warm(agents: Agents, out: Path, node: int, rank: int, sig: int = signal.SIGKILL,
                   warm: str = "standby") -> int:
    """Send ``sig`` to ``rank``'s worker once node ``node`` is warm (``warm``: its event, a standby
    ready or its fork server's) and the rank has stepped 10 times (a run of LONG_STEPS); fails,
    rather than kill at the job's end, when the standby came too late."""
    agents.wait_event(node, warm, 120)
    wait_progress(agents, out, rank, 10)
    at, total = progress(out, rank), int(LONG_STEPS[1])
    assert at <= total - 20, (f"the standby was ready only at step {at} of {total}: a kill now lands at the "
                              "job's end; give LONG_STEPS more steps")
    pid = agents.worker_pid(node, rank)
    os.kill(pid, sig)
    return pid


def check_replaced(agents: Agents, out: Path, victim: int, world: int, expect: str) -> list[dict]:
    recs = records(out)
    by_rank = {}
    for r in recs:
        by_rank.setdefault(r["rank"], []).append(r)
    assert sorted(by_rank) == list(range(world))
    starts = [e for n in range(agents.nodes) for e in agents.events(n, "start")]
    for rank, rs in by_rank.items():
        assert len(rs) == 1, f"rank {rank} finished in {len(rs)} processes"
        first = [e for e in starts if e["rank"] == rank and e["generation"] == 0]
        if rank == victim:
            assert rs[0]["generation"] >= 1 and rs[0]["pid"] != first[0]["pid"]
        else:                      # a survivor: the very process started at generation 0
            assert rs[0]["pid"] == first[0]["pid"] and rs[0]["generation"] == 0
            assert len(rs[0]["recoveries"]) >= 1
        assert rs[0]["digest"] == expect, f"rank {rank} differs from the fault-free run"
    assert len([e for e in starts if e["generation"] > 0]) == 1, "exactly one process restarted"
    return recs
