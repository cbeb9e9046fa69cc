"""A worker forked by `hpct run`'s fork server (its default) runs its first CUDA op, here on the NCCL
engine over the simulated library and CUDA runtime (hpct/testing/nccl_sim).

The fork server must never ask CUDA anything: once a process has (torch.cuda.is_available(), or
device_count() without NVML), torch marks every child it forks as a bad fork, whose first CUDA op
raises "Cannot re-initialize CUDA in forked subprocess".  Registering hpct's backend asks, so the
server leaves it out (hpct/launch/forkserver.py).  What this proves here: every worker is forked,
inherits no hpct backend and no CUDA state, and its first engine op runs through the engine's own
code.  The bad-fork mark itself only a torch built with CUDA can show (the torch tier runs this on
PyPI's CUDA build, ci/torch_tier.sh); a real first CUDA op on a GPU is the GPU pack's
(tests/gpu/test_gpu_proof.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpct.ports import free_port_block
from hpct.testing.cluster import Agents

pytestmark = pytest.mark.nccl_sim
WORKER = str(Path(__file__).with_name("forked_engine_worker.py"))
LIMIT_S = 120


def test_a_worker_forked_by_hpct_run_runs_its_first_op_on_the_nccl_engine(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    args = ["--nproc-per-node", "2", "--port-base", str(free_port_block(2 * 8 * 2 + 2)), WORKER, str(out)]
    with Agents(tmp_path, args, env={"SIM_NCCL_REPORT": str(out), "HPCT_CONNECT_TIMEOUT": "30"}) as agents:
        agents.start()
        assert agents.wait(LIMIT_S) == [0], agents.output(0)
    starts = agents.events(0, "start")
    assert len(starts) == 2 and all(s["why"].startswith("forked: from the fork server") for s in starts), starts
    workers = sorted((json.loads(p.read_text()) for p in out.glob("worker-*.json")), key=lambda w: w["rank"])
    assert [w["rank"] for w in workers] == [0, 1], agents.output(0)
    for w in workers:
        assert (w["bad_fork"], w["cuda_initialized"], w["backend_imported"]) == (False, False, False), w
        assert w["sum"] == [3.0] * 4, w
    reports = [json.loads(p.read_text()) for p in out.glob("sim-*.json")]
    assert sorted(r["pid"] for r in reports) == sorted(w["pid"] for w in workers), reports
    assert all("all_reduce" in r["calls"] and not r["breaches"] for r in reports), reports
