#!/usr/bin/env python3
"""Time to a first allreduce: hpct storeless Gloo vs stock PyTorch Gloo via TCPStore.

For every world size N (default 2, 4, 8, 16, 32) both variants run in the same
invocation, on loopback, one process per rank:

* ``hpct``:  hpct._gloo.Context from the port plan (no store, no root), then a
  one-element allreduce;
* ``torch``: torch.distributed.init_process_group("gloo") with env:// (rank 0
  hosts the TCPStore), then the same allreduce.

Process start-up and imports are excluded: every rank imports what it needs,
reports "ready", and all ranks are released together; the time reported for N
is the slowest rank's time from release to the end of its first allreduce.
Ports come from the port plan (a free block below 20000) for hpct and for the
TCPStore.  Every process is bounded by a timeout.  Prints a table with the ratio
torch / hpct per N.  Needs torch for the comparison (it is skipped without).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time

WORKER = r"""
import json, os, sys, time
mode, rank, size, cfg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
if mode == "hpct":
    import array
    import hpct._gloo as g
else:
    import datetime
    import torch
    import torch.distributed as dist
print("ready", flush=True)
go = float(sys.stdin.readline())
if mode == "hpct":
    peers = [tuple(p) for p in cfg["peers"]]
    ctx = g.Context(rank, size, 1, peers, timeout=60.0, connect_timeout=60.0)
    buf = array.array("f", [1.0])
    ctx.allreduce(buf)
    assert buf[0] == size
    done = time.time()
    ctx.close()
else:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["store_port"]),
                      GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == size
    done = time.time()
    dist.destroy_process_group()
print(json.dumps({"rank": rank, "seconds": done - go}), flush=True)
"""


def run_once(mode: str, size: int, timeout: float) -> float:
    from hpct.ports import free_port_block, peer_table
    base = free_port_block(size + 1)
    cfg = {"peers": peer_table(["127.0.0.1"], base, 0, size, size, 1), "store_port": base + size}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, mode, str(r), str(size), json.dumps(cfg)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd="/", env=env) for r in range(size)]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:                       # wait until every rank has imported
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([p.stdout], [], [], left)[0]:
                    raise TimeoutError(f"{mode} N={size}: ranks not ready in {timeout} s")
                line = p.stdout.readline()
                if line.strip() == "ready":
                    break
                if not line:
                    raise RuntimeError(f"{mode} N={size}: a rank died: {p.stderr.read()[-2000:]}")
        go = time.time()
        for p in procs:
            p.stdin.write(f"{go}\n")
            p.stdin.flush()
    except BaseException:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
        raise
    from hpct.demo.agent import slowest_rank_seconds
    return slowest_rank_seconds(procs, deadline, f"{mode} N={size}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,4,8,16,32", help="comma list of world sizes")
    ap.add_argument("--repeat", type=int, default=1, help="runs per size and variant (median)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    started = time.monotonic()
    rows = []
    for n in sizes:
        hp = statistics.median(run_once("hpct", n, args.timeout) for _ in range(args.repeat))
        tt = statistics.median(run_once("torch", n, args.timeout) for _ in range(args.repeat)) \
            if have_torch else float("nan")
        rows.append({"n": n, "hpct_s": hp, "torch_s": tt, "ratio": tt / hp if have_torch else None})
    import platform
    torch_version = __import__("torch").__version__ if have_torch else "not installed"
    print(f"time to first allreduce on loopback (slowest rank, imports excluded); "
          f"{os.cpu_count()} CPUs; torch {torch_version}; median of {args.repeat}")
    print(f"{'N':>4}  {'hpct storeless [ms]':>20}  {'torch gloo+TCPStore [ms]':>25}  {'torch/hpct':>10}")
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "n/a"
        print(f"{r['n']:>4}  {r['hpct_s'] * 1e3:>20.1f}  {r['torch_s'] * 1e3:>25.1f}  {ratio:>10}")
    print(f"total benchmark time {time.monotonic() - started:.1f} s ({platform.python_version()})")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
