#!/usr/bin/env python3
"""Reconfigure latency (torch >= 2.14's ``dist._reconfigure``): hpct against stock Gloo, same run.

For every world size N (default 3, 8, 16), one process per rank on loopback, both backends
made with ``init_process_group(..., enable_reconfigure=True)`` and driven alike: handles
travel through a FileStore (the out-of-band exchange the API leaves to its caller), and each
step starts from a store barrier.  Three reconfigures, each timed from the call to the end of
a one-element all_reduce on the result (the slowest rank is reported):

* ``form``: the first reconfigure, all N ranks (a group made for reconfigure has no members);
* ``identity``: the same N ranks again with a fresh uuid;
* ``shrink``: rank N-1 left out (it stays alive and silent: no failure detection is timed).

    python benchmarks/reconfigure.py [--sizes 3,8,16] [--repeat 1] [--timeout 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

STEPS = ("form", "identity", "shrink")

WORKER = r"""
import datetime, json, os, sys, time
import torch
import torch.distributed as dist
mode, rank, size, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if mode == "hpct":
    import hpct.distributed  # registers the backend
store = dist.FileStore(path, size)
dist.init_process_group(mode, store=store, rank=rank, world_size=size,
                        timeout=datetime.timedelta(seconds=120), enable_reconfigure=True)

def barrier(key, who):
    store.set(f"{key}/b/{rank}", "1")
    for r in who:
        store.get(f"{key}/b/{r}")

def step(key, uuid, who):
    store.set(f"{key}/h/{rank}", dist._get_reconfigure_handle())
    handles = [store.get(f"{key}/h/{r}").decode() for r in who]
    barrier(key, who)
    t0 = time.perf_counter()
    dist._reconfigure(uuid, handles, timeout=datetime.timedelta(seconds=60)).wait()
    t = torch.ones(1)
    dist.all_reduce(t)
    seconds = time.perf_counter() - t0
    assert t.item() == len(who), (t, who)
    return seconds

res = {"form": step("form", 1, range(size)), "identity": step("identity", 2, range(size))}
if rank == size - 1:
    barrier("end", range(size))
else:
    res["shrink"] = step("shrink", 3, range(size - 1))
    barrier("end", range(size))
print(json.dumps({"rank": rank, "seconds": res}), flush=True)
os._exit(0)
"""


def run_once(mode: str, size: int, timeout: float, scratch: str) -> dict:
    """{step: seconds of the slowest rank}."""
    from hpct.ports import free_port_block
    base = free_port_block(8 * size)
    path = os.path.join(scratch, f"store-{mode}-{size}-{time.monotonic_ns()}")
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HPCT_PORT_BASE=str(base),
               N_PROC_PER_NODE=str(size), HPCT_HOSTS="127.0.0.1", HPCT_CONNECT_TIMEOUT="60")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, mode, str(r), str(size), path],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/", env=env)
             for r in range(size)]
    from hpct.demo.agent import rank_results
    ranks = rank_results(procs, time.monotonic() + timeout, f"{mode} N={size}")
    # the rank a shrink leaves out reports no "shrink"
    return {s: max([0.0] + [r["seconds"][s] for r in ranks if s in r["seconds"]]) for s in STEPS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="3,8,16", help="comma list of world sizes")
    ap.add_argument("--repeat", type=int, default=1, help="runs per size and backend (median per step)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = ap.parse_args(argv)
    import tempfile

    import torch
    import torch.distributed as dist
    if not hasattr(dist, "_reconfigure"):
        raise SystemExit(f"torch {torch.__version__} has no reconfigure API: run this with torch >= 2.14 "
                         "(ci/torch_tier.sh's environment has torch 2.15)")
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpct-reconfigure-") as scratch:
        for n in (int(s) for s in args.sizes.split(",")):
            if n < 2:
                raise SystemExit(f"--sizes: N={n} is too small (the shrink step needs N >= 2)")
            runs = {m: [run_once(m, n, args.timeout, scratch) for _ in range(args.repeat)] for m in ("hpct", "gloo")}
            rows.append({"n": n, **{f"{m}_{s}": statistics.median(r[s] for r in runs[m])
                                    for m in runs for s in STEPS}})
    print(f"reconfigure call to the end of the first all_reduce, loopback (slowest rank); {os.cpu_count()} CPUs; "
          f"torch {torch.__version__}; median of {args.repeat}")
    print(f"{'N':>4}  {'step':>8}  {'hpct [ms]':>10}  {'gloo [ms]':>10}  {'gloo/hpct':>9}")
    for r in rows:
        for s in STEPS:
            h, g = r[f"hpct_{s}"], r[f"gloo_{s}"]
            print(f"{r['n']:>4}  {s:>8}  {h * 1e3:>10.1f}  {g * 1e3:>10.1f}  {g / h:>8.2f}x")
    print(f"total benchmark time {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
