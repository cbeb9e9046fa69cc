#!/usr/bin/env python3
"""The NCCL engine's own path per op, on a CPU: the engine over a null NCCL and runtime.

Every NCCL call and CUDA driver call is a C function that returns at once (hpct/testing/nccl_sim/null.c,
called by the engine's native launch through its addresses, as libnccl's and libcuda's are on a
GPU), so what is timed is hpct's code alone: building the op, the Work, the launch (one native call:
the capture check, the follow, the group, the end event), the bookkeeping, the wait; with
``get_future()`` on every op, as DDP's reducer asks, also the future.  On a GPU the host time per op
is this plus the real calls (the bare ncclGroupStart/ncclAllReduce/ncclGroupEnd of a blocking comm
cost 9-10 us on an H200 host, docs/gpu.md), so this number is what the engine can still cut.
Issue 61's targets: <= 6 us per op, <= 10 us with a future.

Rows: the plain op; a future on every op whose op had ended when asked (the null runtime's events
have), completed at once; the same with every event reported not ended when first asked, so that
the native completer's thread settles each future (its wake-up per op is the cost; for information:
DDP asks for a bucket's future right after launching it, and a backward pass's buckets share one
wake).  ``cpu us``: the calling thread's CPU time per op; on a shared machine the wall time also
holds the time the thread waited for a core.

It also times the same loop through ``torch.distributed``'s stock Gloo on a 1-rank group, the
cheapest op a stock backend offers on this machine, as the ratio's reference (a CPU has no stock
ProcessGroupNCCL; the GPU proof compares with that one).

    python benchmarks/engine_path.py [--ops 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

PLAIN_TARGET_US, FUTURE_TARGET_US = 6.0, 10.0


def per_op_us(fn, ops: int) -> tuple[float, float]:
    """(wall, calling thread's CPU) microseconds per op."""
    for _ in range(min(2000, ops // 10)):
        fn()
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(ops):
        fn()
    return (time.perf_counter() - t0) / ops * 1e6, (time.thread_time() - c0) / ops * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    from hpct.distributed.nccl.engine import NcclEngine
    from hpct.testing.nccl_sim.null import NullNccl, NullRuntime

    lib = NullNccl()

    def engine(name, runtime):
        e = NcclEngine(rank=0, size=1, global_ranks=[0], generation=0, group_index=0, group_name=name,
                       listen_addr="127.0.0.1:1", addresses=["127.0.0.1:1"], job_key=1, connect_timeout=5,
                       op_timeout=60, library=lib, load=lambda: lib, runtime=runtime, blocking_comm=True)
        e.allreduce([t]).wait()                  # the comm forms, the threads start
        return e
    t = torch.ones(1)
    eng, slow = engine("bench", NullRuntime()), engine("bench-completer", NullRuntime(pending=True))

    def plain():
        eng.allreduce([t]).wait()

    def with_future():
        eng.allreduce([t]).get_future().wait()

    def completer():
        slow.allreduce([t]).get_future().wait()

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    def gloo():
        dist.all_reduce(t)

    names = ("engine: all_reduce(...).wait()", "engine: get_future() on every op (DDP)",
             "engine: the same, settled by the completer", "stock Gloo, 1 rank: dist.all_reduce")
    rows = dict(zip(names, (plain, with_future, completer, gloo)))
    results = {name: [] for name in rows}
    for _ in range(args.rounds):                 # interleaved rounds: machine noise falls on all alike
        for name, fn in rows.items():
            results[name].append(per_op_us(fn, args.ops))
    for e in (eng, slow):
        e.shutdown(5.0)
    dist.destroy_process_group()
    med = {name: (statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals))
           for name, vals in results.items()}
    ref = med[names[-1]][0]
    print(f"{'per op, median of ' + str(args.rounds) + ' rounds of ' + str(args.ops):44s} "
          f"{'us':>8s} {'cpu us':>8s} {'x Gloo':>8s}")
    for name, (wall, cpu) in med.items():
        print(f"{name:44s} {wall:8.2f} {cpu:8.2f} {wall / ref:8.2f}")
    for what, name, target in (("per op", names[0], PLAIN_TARGET_US), ("with a future", names[1], FUTURE_TARGET_US)):
        wall = med[name][0]
        print(f"target: the engine's path {what} <= {target:g} us: {'met' if wall <= target else 'not met'} "
              f"({wall:.2f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
