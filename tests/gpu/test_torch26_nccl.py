"""GPU tier (``-m gpu``, ``ci/gpu.sh --torch26``): the NCCL half of hpct's patched torch 2.6.0 wheel.

Runs only on a machine with a CUDA device, the patched wheel (``hpct-build wheel torch=2.6.0``) and
hpct's NCCL 2.21.5 wheel (``hpct-build wheel nccl``) installed: N ranks on one GPU, each its own NCCL
host (NCCL_HOSTID), sockets on lo, torch's own API (tests/patched_torch_worker.py, mode gpu):
a rootless world formed with device_id, a subgroup split from it, a send/recv ring; then the last
rank exits, the survivors' blocking wait fails at the op timeout, they abort the world and form it
again at the next generation on the same ports with a replacement.  Written for that machine and
not yet run anywhere: the lent H200 has torch 2.11 and cannot install torch 2.6.0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
              pytest.mark.skipif("+hpct." not in torch.__version__,
                                 reason=f"torch {torch.__version__} is not hpct's patched 2.6.0 wheel")]
WORKER = Path(__file__).resolve().parents[1] / "patched_torch_worker.py"
OP_TIMEOUT_S = 15
JOB_TIMEOUT_S = 180


def _job(n: int, kill: bool) -> dict:
    from hpct.ports import free_port_block
    base = free_port_block(16 * n)
    def start(rank: int, generation: int = 0):
        env = {**os.environ, "HPCT_USE_ROOTLESS": "1", "HPCT_PORT_BASE": str(base), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
               "HPCT_GENERATION": str(generation), "NCCL_HOSTID": f"hpct-t26-{rank}-{generation}",
               "NCCL_SOCKET_IFNAME": "lo", "TORCH_NCCL_BLOCKING_WAIT": "1"}
        return subprocess.Popen([sys.executable, "-P", str(WORKER), "gpu",
                                 json.dumps({"kill": kill, "timeout": OP_TIMEOUT_S})], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    running, done, deadline = {r: start(r) for r in range(n)}, {}, time.monotonic() + JOB_TIMEOUT_S
    try:
        while running:
            assert time.monotonic() < deadline, f"the job ran past {JOB_TIMEOUT_S} s"
            for rank, proc in list(running.items()):
                if proc.poll() is None:
                    continue
                text = proc.communicate()[0]
                del running[rank]
                if kill and proc.returncode == 17 and rank not in done:
                    running[rank] = start(rank, generation=1)
                    done[rank] = {"exited": True}
                    continue
                assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{text[-3000:]}"
                done[rank] = json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1])
            time.sleep(0.05)
    finally:
        for proc in running.values():
            proc.kill()
    return done


@pytest.mark.parametrize("n", [2, 4])
def test_a_rootless_nccl_world_forms_splits_and_sends_on_one_gpu(n):
    got = _job(n, kill=False)
    total = n * (n + 1) / 2
    for rank, r in got.items():
        assert r["first"] == {"sum": total, "sub": float(n), "recv": float((rank - 1) % n)}, r
    print(f"\nN={n}: formed in {[got[r]['formed_s'] for r in sorted(got)]} s")


def test_a_rank_gone_is_replaced_and_the_world_reformed_at_the_next_generation():
    n = 4
    got = _job(n, kill=True)
    total = n * (n + 1) / 2
    for rank, r in got.items():
        assert r["again"] == {"sum": total, "sub": float(n), "recv": float((rank - 1) % n)}, r
    survivors = [got[r] for r in range(n - 1)]
    for s in survivors:
        assert "fault" in s and "missed" not in s, s
    print("\nsurvivors: aborted in", [s["aborted_s"] for s in survivors], "s, re-formed in",
          [s["reformed_s"] for s in survivors], "s")
