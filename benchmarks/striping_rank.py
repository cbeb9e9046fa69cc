"""One rank of benchmarks/striping.py (inside its namespace): all_reduce throughput, one JSON line.

    python striping_rank.py MIB KS REPS
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

mib, ks, reps = int(sys.argv[1]), [int(k) for k in sys.argv[2].split(",")], int(sys.argv[3])
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
x = torch.ones(mib * (1 << 20) // 4)


def rate(fn) -> float:
    fn()                                     # connects the pairs; not timed
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return mib / best


out = {}
# stock PyTorch first: torch's Gloo (TCPStore on rank 0), one connection per peer pair
dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=300))
out["stock-gloo"] = rate(lambda: dist.all_reduce(x))
dist.destroy_process_group()

import hpct.distributed as hd  # noqa: E402
from hpct.distributed.training.striping import StripedGroup  # noqa: E402

hd.init_process_group(timeout=300.0)
for k in ks:
    sg = StripedGroup(k)
    out[f"hpct k={k}"] = rate(lambda: sg.all_reduce(x))
    sg.destroy()
print(json.dumps({"rank": rank, "mib_per_s": out}), flush=True)
hd.shutdown_all()
