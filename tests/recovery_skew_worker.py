"""One rank of the recovery-skew tests (tests/test_recovery.py): ranks enter recovery seconds apart.

    python recovery_skew_worker.py OUT_DIR MODE

MODE "stagger": after one allreduce, rank r sleeps 3*r s, then recovers (retrying on
RendezvousError); HPCT_CONNECT_TIMEOUT is short, so the early ranks fail several attempts
before the last one arrives.  MODE "stopped": the test SIGSTOPs the last rank while the
others wait in an allreduce (op timeout 3 s); they time out and start recovering; the test
resumes the stopped rank seconds later, its op fails and it recovers too.  Every rank
records the generation of each attempt and where it ended in OUT_DIR/skew-<rank>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hpct.distributed as hd
from hpct.errors import RendezvousError

out, mode = Path(sys.argv[1]), sys.argv[2]
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
MAX_ATTEMPTS = 30
hd.init_process_group(timeout=3.0)
t = torch.ones(1)
dist.all_reduce(t)
log = {"attempts": [], "error": None}


def recover_until_formed():
    for _ in range(MAX_ATTEMPTS):
        try:
            hd.recover()
            return True
        except (RendezvousError, hd.HpctError, RuntimeError) as err:
            log["attempts"].append([hd.generation(), type(err).__name__])
    return False


if mode == "stagger":
    time.sleep(3 * rank)
else:                                  # "stopped"
    (out / f"ready-{rank}").write_text(str(os.getpid()))
    while not (out / "go").exists():
        time.sleep(0.01)
    try:
        dist.all_reduce(t)             # the stopped rank makes everyone else time out here
    except Exception as err:  # noqa: BLE001 -- the fault this test is about
        log["error"] = f"{type(err).__name__}: {str(err)[:300]}"

formed = recover_until_formed()
log["formed"] = formed
log["generation"] = hd.generation()
if formed:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    log["sum"] = t.item()
    dist.barrier()
(out / f"skew-{rank}.json").write_text(json.dumps(log))
hd.shutdown_all()
