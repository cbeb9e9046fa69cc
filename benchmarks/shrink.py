#!/usr/bin/env python3
"""Shrink latency: from the shrink call to the end of the first all_reduce on the shrunk group.

For every world size N (default 8, 16, 32) both variants run in the same invocation, on
loopback, one process per rank; rank N-1 leaves (it stays alive, silent, so that the
measurement is the survivors' re-formation and not a failure detection):

* ``hpct``:  ``hd.shrink([N-1])`` on the N-1 survivors (the group is aborted and re-formed at
  the next generation from the port plan: no store), then a one-element all_reduce;
* ``torch``: stock Gloo has no shrink, so its equivalent: ``destroy_process_group()``, a new
  TCPStore hosted by the new rank 0 on a fresh port, ``init_process_group("gloo")`` at N-1,
  then the same all_reduce.

The time reported is the slowest survivor's, each measured from its own call (both variants
start from a barrier of the full world).  The NCCL public reference for ncclCommShrink is
printed as text only: it is a different transport and machine, nothing here measures it.

    python benchmarks/shrink.py [--sizes 8,16,32] [--repeat 1] [--timeout 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

NCCL_REFERENCE = "NCCL ncclCommShrink (public reference, not measured here): 1.4-2.0 s"

WORKER = r"""
import datetime, json, os, sys, time
import torch
import torch.distributed as dist
mode, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
timeout = datetime.timedelta(seconds=120)
if mode == "hpct":
    import hpct.distributed as hd
    hd.init_process_group(timeout=120)
else:
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timeout)
dist.barrier()
if rank == size - 1:             # the leaver: silent until the survivors are done (then killed)
    print(json.dumps({"rank": rank, "left": True}), flush=True)
    time.sleep(600)
    os._exit(0)
t0 = time.perf_counter()
if mode == "hpct":
    hd.shrink([size - 1])
else:
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", int(os.environ["SHRUNK_PORT"]), size - 1, is_master=rank == 0,
                          timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size - 1, timeout=timeout)
t = torch.ones(1)
dist.all_reduce(t)
seconds = time.perf_counter() - t0
assert t.item() == size - 1, t
print(json.dumps({"rank": rank, "seconds": seconds}), flush=True)
dist.barrier()
if mode == "hpct":
    hd.shutdown_all()
else:
    dist.destroy_process_group()
os._exit(0)
"""


def run_once(mode: str, size: int, timeout: float) -> float:
    """Seconds of the slowest survivor, shrink call to first all_reduce done."""
    from hpct.ports import free_port_block
    base = free_port_block(size + 2)
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(base + size), SHRUNK_PORT=str(base + size + 1), GLOO_SOCKET_IFNAME="lo",
               HPCT_PORT_BASE=str(base), N_PROC_PER_NODE=str(size), HPCT_CONNECT_TIMEOUT="60")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, mode, str(r), str(size)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(size)]
    from hpct.demo.agent import slowest_rank_seconds
    try:                                 # the survivors; the leaver is killed below
        return slowest_rank_seconds(procs[:-1], time.monotonic() + timeout, f"{mode} N={size}")
    finally:
        leaver = procs[-1]
        if leaver.poll() is None:
            leaver.kill()
            leaver.communicate(timeout=10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,16,32", help="comma list of world sizes before the shrink")
    ap.add_argument("--repeat", type=int, default=1, help="runs per size and variant (median)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = ap.parse_args(argv)
    import torch
    started = time.monotonic()
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        if n < 3:
            raise SystemExit(f"--sizes: N={n} is too small (a shrink of 1 rank needs N >= 3)")
        hp = statistics.median(run_once("hpct", n, args.timeout) for _ in range(args.repeat))
        tt = statistics.median(run_once("torch", n, args.timeout) for _ in range(args.repeat))
        rows.append({"n": n, "hpct_s": hp, "torch_s": tt})
    print(f"shrink N -> N-1, shrink call to first all_reduce on the shrunk group, loopback (slowest "
          f"survivor); {os.cpu_count()} CPUs; torch {torch.__version__}; median of {args.repeat}")
    print(f"{'N':>4}  {'hpct shrink [ms]':>17}  {'stock destroy+TCPStore+init [ms]':>33}  {'stock/hpct':>10}")
    for r in rows:
        print(f"{r['n']:>4}  {r['hpct_s'] * 1e3:>17.1f}  {r['torch_s'] * 1e3:>33.1f}  "
              f"{r['torch_s'] / r['hpct_s']:>9.2f}x")
    print(NCCL_REFERENCE)
    print(f"total benchmark time {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
