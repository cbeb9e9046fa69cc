"""One rank of the deadline tests (tests/test_deadlines.py): waits on a peer that never answers.

    python deadline_worker.py OUT_DIR SCENARIO

Every scenario leaves the last rank (the test's victim) missing or SIGSTOPped, and every
other rank records how long each waiting call took to fail, measured around the call
alone, with the error's type and message, in OUT_DIR/deadline-<rank>.json.  The victim
writes OUT_DIR/ready-<rank> where the test stops it (at start-up it stops itself).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hpct.distributed as hd

out, scenario = Path(sys.argv[1]), sys.argv[2]
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
victim = n - 1
OP_TIMEOUT = float(os.environ["DEADLINE_OP_TIMEOUT"])
records: list[dict] = []


def timed(what: str, fn) -> bool:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as err:  # noqa: BLE001 -- the failure is what is measured
        records.append({"what": what, "s": time.monotonic() - t0, "error": type(err).__name__,
                        "message": str(err)})
        return False
    records.append({"what": what, "s": time.monotonic() - t0, "error": None, "message": ""})
    return True


def wait_go() -> None:
    (out / f"ready-{rank}").write_text(str(os.getpid()))
    end = time.monotonic() + 60
    while not (out / "go").exists() and time.monotonic() < end:
        time.sleep(0.01)


def all_reduce(group=None) -> None:
    t = torch.ones(1)
    dist.all_reduce(t, group=group)


if scenario == "startup":                     # the victim is missing, or stopped early in its start-up
    if rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, but stopped before it listens
    timed("init", lambda: hd.init_process_group(timeout=OP_TIMEOUT))
else:
    hd.init_process_group(timeout=OP_TIMEOUT)
    all_reduce()
    wait_go()                                 # the test stops the victim here, its listener open
    if scenario == "recover":
        timed("op", all_reduce)
        for _ in range(2):                    # each attempt meets the stopped victim's backlog
            timed("recover", hd.recover)
    elif scenario == "recover_stopped_inside":    # the victim was SIGKILLed at "go"
        timed("op", all_reduce)
        if rank == n - 2:                     # stops itself once inside recover(), connected at
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGSTOP)).start()   # the new generation
        timed("recover", hd.recover)
    elif scenario == "new_group":
        timed("new_group", lambda: all_reduce(dist.new_group(list(range(n)))))
    elif scenario == "recv":
        def recv():
            t = torch.zeros(1)
            dist.irecv(t, src=victim).wait(datetime.timedelta(seconds=OP_TIMEOUT))
        timed("recv", recv)
(out / f"deadline-{rank}.json").write_text(json.dumps(records))
os._exit(0)                                   # a stopped peer must not make teardown wait
