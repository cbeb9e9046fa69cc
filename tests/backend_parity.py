"""The backend parity run that tests/test_backend.py and tests/test_no_numpy.py share: the same
collectives on the same inputs (tests/dist_worker.py) on ProcessGroupGloo and on hpct, rank 0
started well after the others."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from hpct.demo.agent import free_port_block
from util import forked_job

WORLD = 4
WORKER = Path(__file__).with_name("dist_worker.py")
SLOTS = 8
# Exported to the ranks to prove nothing uses it: a port that is free now, kept out of the plan
# blocks (run() avoids it: a block drawn over it once put rank 3's listener on it).
MASTER_PORT = free_port_block(1)
# Cases ProcessGroupGloo refuses and hpct supports.
SUPERSET = {f"all_reduce/torch.int16/RedOpType.{op}" for op in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")} | \
    {"all_gather/torch.int16", "all_to_all"}


def run(tmp: Path, backend: str, order) -> tuple[list[dict], int]:
    out = tmp / backend
    out.mkdir()
    base = free_port_block(SLOTS * WORLD, avoid=[MASTER_PORT])
    argv = [sys.executable, str(WORKER), backend, str(out), str(tmp / "filestore")]
    j = forked_job(argv, WORLD, base, out, time.monotonic() + 120,
                   env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(MASTER_PORT),
                        "HPCT_CONNECT_TIMEOUT": "60"})
    with j:
        j.start_all(order=order[:-1])
        time.sleep(1.5)                       # the last one (rank 0) starts well after the others
        j.start(order[-1])
        codes = j.wait_all()
        assert codes == {r: 0 for r in range(WORLD)}, [j.output(r) for r in range(WORLD)]
    return [torch.load(out / f"{backend}-{r}.pt", weights_only=False) for r in range(WORLD)], base
