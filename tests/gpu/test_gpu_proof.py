"""GPU tier (``-m gpu``, run by ci/gpu.sh): N ranks on one GPU, each its own NCCL "host"
(NCCL_HOSTID), sockets on lo.  Every process bounds itself with a timeout; nothing here runs
without a CUDA device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
WORKER = Path(__file__).with_name("worker.py")
RANKS = [int(n) for n in os.environ.get("GPU_PROOF_RANKS", "2 4").split()]


def run_ranks(n: int, mode: str, timeout: float = 120.0) -> list[str]:
    base = 21000 + 100 * n
    procs = []
    for r in range(n):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(n), "N_PROC_PER_NODE": str(n), "HPCT_PORT_BASE": str(base),
               "NCCL_HOSTID": f"hpct-gpu-proof-{r}", "NCCL_SOCKET_IFNAME": "lo",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(base + 90), "GPU_PROOF_MODE": mode}
        procs.append(subprocess.Popen([sys.executable, "-P", str(WORKER)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{mode} with {n} ranks did not finish within {timeout:g} s")
        outs.append(out)
        assert p.returncode == 0, out
    return outs


@pytest.mark.parametrize("n", RANKS)
def test_engine_collectives_exact_against_stock_nccl(n):
    outs = run_ranks(n, "exact")
    assert all("EXACT OK" in o for o in outs), outs


@pytest.mark.parametrize("n", RANKS)
def test_bus_bandwidth_table(n):
    outs = run_ranks(n, "bandwidth", timeout=300)
    table = next(o for o in outs if "BUSBW" in o)
    report = Path(os.environ.get("GPU_PROOF_REPORT", "build/gpu-proof"))
    report.mkdir(parents=True, exist_ok=True)
    (report / f"busbw-{n}.txt").write_text(table)


@pytest.mark.xfail(reason="needs the group facade wired to NcclEngine (DDP, SIGKILL + hd.recover(), "
                          "start-up/recovery table): see the lead's wiring list", strict=False, run=False)
def test_ddp_recovery_and_startup_table():
    raise AssertionError("not wired yet")
