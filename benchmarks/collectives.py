"""Collectives: hpct vs stock ProcessGroupGloo, same ranks, same run.

Every rank holds both groups: hpct's world (rootless) and a ProcessGroupGloo made through
a FileStore, and times the same op on the same float32 buffer on each, alternating.
Latency is the median over iterations (after one warm-up); bandwidth is the algorithm
bandwidth (message size / latency).  CPU is the median process CPU time (every thread of the
rank: caller, worker, Gloo's device loop) per op: where ranks share few CPUs, latency
mostly measures the scheduler, and CPU shows the per-op overhead.  The size is each rank's input (all_reduce, all_gather,
all_to_all_single, gather, reduce_scatter_tensor) or output (scatter); roots are rank 0.

    python benchmarks/collectives.py [--n 2,4] [--sizes 4,65536,1048576,16777216,67108864] [--ops ...]
                                     [--log-allreduce]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions,  # noqa: E402
                                        GatherOptions, ReduceScatterOptions, ScatterOptions)

import hpct.distributed as hd  # noqa: E402
from hpct.demo import measure as _bench  # noqa: E402

SIZES = [4, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
OPS = ("all_reduce", "all_gather", "all_to_all_single", "gather", "scatter", "reduce_scatter", "barrier")


def op_call(op: str, pg, rank: int, n: int, numel: int):
    """A callable running ``op`` once on ``pg`` over float32 buffers made here, returning its Work."""
    x = torch.ones(numel)
    if op == "all_reduce":
        return lambda: pg.allreduce([x], AllreduceOptions())
    if op == "all_gather":
        gathered = torch.empty(numel * n)
        return lambda: pg._allgather_base(gathered, x, AllgatherOptions())
    if op == "all_to_all_single":
        out = torch.empty(numel)
        return lambda: pg.alltoall_base(out, x, [], [], AllToAllOptions())
    if op == "gather":
        outs = [[torch.empty(numel) for _ in range(n)]] if rank == 0 else []
        return lambda: pg.gather(outs, [x], GatherOptions())
    if op == "scatter":
        ins = [[torch.ones(numel) for _ in range(n)]] if rank == 0 else []
        return lambda: pg.scatter([x], ins, ScatterOptions())
    if op == "reduce_scatter":
        out = torch.empty(numel // n)
        return lambda: pg._reduce_scatter_base(out, x, ReduceScatterOptions())
    if op == "barrier":                                # no buffer: the size is ignored
        return lambda: pg.barrier()
    raise SystemExit(f"collectives.py: unknown op {op!r}; choose from {', '.join(OPS)}")


def label(nbytes: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def iterations(nbytes: int, budget: float) -> int:
    return max(3, min(200, int(budget / (1e-4 + nbytes / 2e8))))


def rank_fn(rank, n, base, store_path, sizes, budget, ops, log_allreduce=False):
    _bench.hpct_env(rank, n, base)
    if log_allreduce:          # small float sums in log depth at every size (not stock's bits)
        os.environ["HPCT_LOG_ALLREDUCE"] = "1"
    hd.init_process_group(timeout=300)
    hp = dist.group.WORLD
    store = dist.FileStore(store_path, n)
    gl = dist.ProcessGroupGloo(store, rank, n, datetime.timedelta(seconds=300))
    out = {}
    for nbytes in sizes:
        numel = -(-max(nbytes // 4, 1) // n) * n       # a multiple of n: all_to_all and reduce_scatter split it
        iters = iterations(nbytes * n, budget)
        for op in ops:
            calls = {"hpct": op_call(op, hp, rank, n, numel), "gloo": op_call(op, gl, rank, n, numel)}
            times = {"hpct": [], "gloo": []}
            cpu = {"hpct": [], "gloo": []}
            for i in range(iters + 1):
                for name, pg in (("hpct", hp), ("gloo", gl)):
                    pg.barrier().wait()
                    t0, c0 = time.perf_counter(), time.process_time()
                    calls[name]().wait()
                    if i:
                        times[name].append(time.perf_counter() - t0)
                        cpu[name].append(time.process_time() - c0)
            out[f"{op}/{nbytes}"] = {**{k: _bench.median(v) for k, v in times.items()},
                                     **{f"{k}_cpu": _bench.median(v) for k, v in cpu.items()}}
    try:
        dist.barrier()
        gl.barrier().wait()
    except Exception:  # noqa: BLE001
        pass
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="2,4")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="message sizes in bytes")
    ap.add_argument("--budget", type=float, default=1.0, help="target seconds per (op, size, backend)")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma list of: {', '.join(OPS)}")
    ap.add_argument("--log-allreduce", action="store_true",
                    help="hpct ranks run with HPCT_LOG_ALLREDUCE=1 (log-depth small float sums)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        ap.error(f"unknown op {unknown[0]!r}: choose from {', '.join(OPS)}")
    rows = []
    for n in [int(x) for x in args.n.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            ranks = _bench.Ranks(deadline_s=600)
            base = _bench.free_port_block(8 * n)
            for r in range(n):
                ranks.fork(r, rank_fn, r, n, base, os.path.join(tmp, "store"), sizes, args.budget, ops,
                           args.log_allreduce)
            res = ranks.collect()
        _bench.check(res, f"N={n}")
        for op in ops:
            for nbytes in sizes:
                key = f"{op}/{nbytes}"
                h = max(res[r][key]["hpct"] for r in range(n))
                g = max(res[r][key]["gloo"] for r in range(n))
                hc = max(res[r][key]["hpct_cpu"] for r in range(n))
                gc = max(res[r][key]["gloo_cpu"] for r in range(n))
                rows.append([op, n, "-" if op == "barrier" else label(nbytes), f"{h * 1e6:.0f}", f"{g * 1e6:.0f}",
                             f"{nbytes / h / 1e6:.1f}", f"{nbytes / g / 1e6:.1f}", f"{g / h:.2f}",
                             f"{hc * 1e6:.0f}", f"{gc * 1e6:.0f}"])
                if op == "barrier":
                    break
        print(f"  N={n} done", file=sys.stderr, flush=True)
    print(_bench.table(["op", "N", "size", "hpct us", "gloo us", "hpct MB/s", "gloo MB/s",
                        "hpct/gloo bw (= gloo/hpct latency)", "hpct cpu us", "gloo cpu us"], rows,
                       f"Collectives: hpct vs ProcessGroupGloo, float32, median latency and CPU per op, max over ranks "
                       f"({os.cpu_count()} CPUs, torch {torch.__version__})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
