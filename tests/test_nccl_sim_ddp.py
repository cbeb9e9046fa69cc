"""DDP training on the NCCL engine over the simulated NCCL (hpct/testing/nccl_sim), in separate processes.

The trainer is the CPU tier's (``python -m hpct.demo.trainer``) started through
tests/nccl_sim_run.py, the test-only switch that routes every group's CPU tensors to the
NCCL engine: its gradient all_reduce, DDP's start-up broadcasts, recovery's state broadcast.
Each rank reports what went through the simulated library (SIM_NCCL_REPORT), so a run that
silently took Gloo instead fails.  The inputs and parameters are those of the Gloo run it is
compared with, and both all_reduce on hpct's Gloo (the simulation moves data over it), so
their sums are the same at any N; the GPU proof (tests/gpu) compares with stock NCCL on
integer-valued inputs, where the summation order of two libraries cannot matter.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from hpct.demo.agent import Job, free_port_block, trainer_argv
from util import REPO, forked_job

pytestmark = [pytest.mark.nccl_sim, pytest.mark.multiprocess]
STEPS, DEADLINE = 8, 150.0
SIM_RUN = REPO / "tests" / "nccl_sim_run.py"


def job(out: Path, n: int, *args: str, sim: bool = True) -> Job:
    out.mkdir(parents=True, exist_ok=True)
    argv = trainer_argv(out, "--steps", str(STEPS), *args)
    if sim:
        argv = [sys.executable, str(SIM_RUN), *argv[1:]]      # python nccl_sim_run.py -m hpct.demo.trainer ...
    env = {"HPCT_CONNECT_TIMEOUT": "30", "SIM_NCCL_REPORT": str(out)} if sim else {"HPCT_CONNECT_TIMEOUT": "30"}
    return forked_job(argv, n, free_port_block(16 * n), out, time.monotonic() + DEADLINE, env=env)


def params(out: Path, n: int) -> list[dict]:
    return [torch.load(out / f"params-{r}.pt") for r in range(n)]


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].contiguous().view(torch.uint8).equal(b[k].contiguous().view(torch.uint8))
                                        for k in a)


def reports(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("sim-*.json"))]


def run(out: Path, n: int, *, sim: bool) -> list[dict]:
    with job(out, n, sim=sim) as j:
        j.start_all()
        codes = j.wait_all()
        assert codes == {r: 0 for r in range(n)}, "\n".join(j.output(r) for r in range(n))
    return params(out, n)


@pytest.mark.parametrize("n", [2, 4])
def test_ddp_on_the_nccl_engine_trains_bit_identically_to_gloo(tmp_path, n):
    gloo = run(tmp_path / "gloo", n, sim=False)
    sim = run(tmp_path / "sim", n, sim=True)
    assert all(identical(p, gloo[0]) for p in gloo + sim), "DDP on the NCCL engine differs from Gloo"
    reps = reports(tmp_path / "sim")
    assert len(reps) == n and all(r["breaches"] == [] for r in reps)
    # DDP's gradient all_reduce (one bucket a step) and its start-up broadcast went through NCCL.
    assert all(r["groups"] >= STEPS and {"all_reduce", "broadcast"} <= set(r["calls"]) for r in reps), reps


def test_a_sigkilled_rank_fails_backward_and_the_survivors_recover_in_process(tmp_path):
    n, victim, k = 4, 3, 3
    reference = run(tmp_path / "fault-free", n, sim=True)
    out = tmp_path / "fault"
    with job(out, n, "--hang", f"{victim}:{k}:0") as j:
        j.start_all()
        survivors = {r: j.procs[r].pid for r in range(n) if r != victim}
        j.wait_file(out / f"hang-{victim}-0", 90)
        time.sleep(0.3)                      # the others are now in step k's gradient all_reduce
        j.kill(victim)
        j.start(victim, generation=1, extra=["--replacement"])
        codes = j.wait_all()
        assert codes == {r: 0 for r in range(n)}, "\n".join(j.output(r) for r in range(n))
    recs: dict[int, list] = {}
    for rec in sorted(j.records(), key=lambda r: r["events"][0]["t"]):
        recs.setdefault(rec["rank"], []).append(rec)
    for r, pid in survivors.items():
        assert [rec["pid"] for rec in recs[r]] == [pid], f"survivor {r} was restarted"
        events = recs[r][0]["events"]
        assert [e["what"] for e in events] == ["start", "connected", "failure", "recovered", "done"]
        failure = events[2]
        # backward raised (before optimizer.step) with the engine's error, naming the group
        # DDP's reducer rethrows the future's error from C++ (a RuntimeError naming ours)
        assert failure["step"] == k and failure["type"] == "RuntimeError", failure
        assert re.search(r"Nccl(Group|Aborted)Error: hpct NCCL .* failed on group 0 \(rank \d of 4, "
                         r"global rank \d, generation 0\)", failure["error"]), failure["error"]
        assert events[3]["generation"] == 1 and events[3]["step"] == k
    assert [e["what"] for e in recs[victim][1]["events"]] == ["start", "connected", "synced", "done"]
    got = params(out, n)
    assert all(identical(p, reference[0]) for p in got), "the recovered run differs from the fault-free run"
    reps = reports(out)
    assert all(r["breaches"] == [] for r in reps)
    assert sorted(g for r in reps for g in r["generations"]).count(1) == n   # every rank formed generation 1
