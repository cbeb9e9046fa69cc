#!/usr/bin/env python3
"""Many live groups: 64 new_group + a first all_reduce on each, hpct vs stock Gloo.

For every world size N (default 2, 4) both variants run in the same invocation, on
loopback, one process per rank:

* ``hpct``:  hpct.distributed.init_process_group (rootless), then G times
  dist.new_group(all ranks) and a one-element all_reduce on each new group, all kept alive;
  every group of a process listens on its one port (patch 0018);
* ``torch``: init_process_group("gloo") with env:// (rank 0 hosts the TCPStore), then the
  same G new_group(backend="gloo") and all_reduces.

The time reported is the slowest rank's, from a barrier after the world formed to the end
of its last first all_reduce (imports and the world's start-up excluded).  HPCT_PORT_SLOTS
is set to G + 1 for hpct so that a build still capped by port slots can be measured too.
Prints a table with the ratio torch / hpct per N.  Every process is bounded by a timeout.

    python benchmarks/groups.py [--sizes 2,4] [--groups 64] [--repeat 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

WORKER = r"""
import datetime, json, os, sys, time
import torch
import torch.distributed as dist
mode, rank, size, groups = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
timeout = datetime.timedelta(seconds=60)
if mode == "hpct":
    import hpct.distributed as hd
    hd.init_process_group(timeout=60)
    backend = None
else:
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timeout)
    backend = "gloo"
dist.barrier()
t0 = time.perf_counter()
live = []
for i in range(groups):
    g = dist.new_group(list(range(size)), backend=backend)
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    assert t.item() == size, t
    live.append(g)
seconds = time.perf_counter() - t0
dist.barrier()
if mode == "hpct":
    hd.shutdown_all()
else:
    dist.destroy_process_group()
print(json.dumps({"rank": rank, "seconds": seconds}), flush=True)
"""


def run_once(mode: str, size: int, groups: int, timeout: float) -> float:
    from hpct.ports import free_port_block
    slots = groups + 1
    base = free_port_block(2 * slots * size + 1)
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(base + 2 * slots * size), GLOO_SOCKET_IFNAME="lo",
               HPCT_PORT_BASE=str(base), HPCT_PORT_SLOTS=str(slots), N_PROC_PER_NODE=str(size),
               HPCT_CONNECT_TIMEOUT="60")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, mode, str(r), str(size), str(groups)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(size)]
    from hpct.demo.agent import slowest_rank_seconds
    return slowest_rank_seconds(procs, time.monotonic() + timeout, f"{mode} N={size}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,4", help="comma list of world sizes")
    ap.add_argument("--groups", type=int, default=64, help="groups created and kept alive")
    ap.add_argument("--repeat", type=int, default=1, help="runs per size and variant (median)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = ap.parse_args(argv)
    import torch
    started = time.monotonic()
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        hp = statistics.median(run_once("hpct", n, args.groups, args.timeout) for _ in range(args.repeat))
        tt = statistics.median(run_once("torch", n, args.groups, args.timeout) for _ in range(args.repeat))
        rows.append({"n": n, "hpct_s": hp, "torch_s": tt, "ratio": tt / hp})
    print(f"{args.groups} live groups: new_group + first all_reduce each, loopback (slowest rank); "
          f"{os.cpu_count()} CPUs; torch {torch.__version__}; median of {args.repeat}")
    print(f"{'N':>4}  {'hpct [ms]':>10}  {'torch gloo [ms]':>16}  {'torch/hpct':>10}")
    for r in rows:
        print(f"{r['n']:>4}  {r['hpct_s'] * 1e3:>10.1f}  {r['torch_s'] * 1e3:>16.1f}  {r['ratio']:>9.2f}x")
    print(f"total benchmark time {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
