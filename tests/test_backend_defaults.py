"""The hpct backend with no hpct variable at all, as PyTorch's own test harness and most notebooks
use a backend: ``init_process_group("hpct", init_method=..., rank=r, world_size=n)`` (issue 41)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]

CHILD = r"""
import os, sys, datetime
import torch, torch.distributed as dist
import hpct.distributed  # noqa: F401  (registers the backend)
rank, n, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("hpct", init_method=init, rank=rank, world_size=n, timeout=datetime.timedelta(seconds=60))
t = torch.full((3,), float(rank + 1))
dist.all_reduce(t)
print("SUM", t.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_init_process_group_with_rank_and_world_size_and_no_hpct_variable(tmp_path):
    """Three processes, no HPCT_* variable, no N_PROC_PER_NODE or LOCAL_WORLD_SIZE: the world fits
    on the default single host (before: "cannot place group 0 of 3 ranks: rank 1 with 1
    processes per node needs node 1, but the host list has 1 entries")."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HPCT_") and k not in ("N_PROC_PER_NODE", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "RANK",
                                                       "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [subprocess.Popen([sys.executable, "-P", "-c", CHILD, str(r), "3", init], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(3)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank did not finish within 120 s")
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert all("SUM [6.0, 6.0, 6.0]" in o for o in outs), outs
