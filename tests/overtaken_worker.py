"""A training loop for `hpct run` whose replacement the test loses during the survivors' recovery.

    overtaken_worker.py OUT STEPS STALL_GENERATION [HOLD_RANK]

Every step all-reduces ``step + 1`` and adds it to a running total.  A lost peer makes the
survivors ``recover()`` (the agent says the new world) and rank 0 hands the step and the total
to everyone.  A worker started at STALL_GENERATION writes OUT/stalled-<pid> and sleeps instead
of joining: the test kills it while the survivors connect the world that waits for it.  Before
calling recover() a survivor writes OUT/recovering-<rank>-<generation>; the survivor of rank
HOLD_RANK writes OUT/holding-<pid> instead and sleeps, holding up the world that waits for it.
Before its first connect a process writes OUT/connecting-<generation>-<pid>.  Each process that
finishes writes OUT/rank<rank>-pid<pid>.json: the generation it started in, the one its first
connect formed, the generations its recoveries met, its final total.
"""

import json
import os
import sys
import time
from pathlib import Path

out, steps, stall = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
hold = int(sys.argv[4]) if len(sys.argv) > 4 else -1
start_generation = int(os.environ.get("HPCT_GENERATION") or 0)
if start_generation == stall:      # before importing torch: the stalled worker costs no CPU
    (out / f"stalled-{os.getpid()}").write_text("")
    time.sleep(120)
    sys.exit(3)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import hpct.distributed as hd  # noqa: E402
(out / f"connecting-{start_generation}-{os.getpid()}").write_text("")
hd.init_process_group()
formed = hd.generation()
state = torch.zeros(2, dtype=torch.float64)      # [next step, total]
joined = start_generation == 0
met = []
while state[0] < steps:
    try:
        if not joined:
            dist.broadcast(state, src=0)       # rank 0 is a survivor in these tests
            joined = True
        x = torch.full((1,), float(state[0]) + 1, dtype=torch.float64)
        dist.all_reduce(x)
    except RuntimeError:
        if dist.get_rank() == hold and start_generation == 0:
            (out / f"holding-{os.getpid()}").write_text("")
            time.sleep(120)
            sys.exit(3)
        (out / f"recovering-{dist.get_rank()}-{hd.generation()}").write_text("")
        hd.abort_all()
        hd.recover()
        met.append(hd.generation())
        joined = False
        continue
    state += torch.tensor([1.0, float(x)], dtype=torch.float64)
    (out / f"progress-{dist.get_rank()}").write_text(str(int(state[0])))
    time.sleep(0.05)
rank = dist.get_rank()
record = {"rank": rank, "pid": os.getpid(), "generation": start_generation, "formed": formed, "met": met,
          "total": float(state[1])}
path = out / f"rank{rank}-pid{os.getpid()}.json"
path.with_suffix(".tmp").write_text(json.dumps(record))
path.with_suffix(".tmp").replace(path)
dist.barrier()
hd.shutdown_all()
