"""Start-up: release -> the last rank's first all_reduce, for four arrival orders.

Three stacks in the same run, N forked ranks released together (a parent that has
already imported torch forks them, so the times are the rendezvous and connect):
  stock   PyTorch's ProcessGroupGloo with a TCPStore on rank 0 (tcp:// init), full mesh;
  hpct    the hpct backend (no store, lazy pairs, group formed by one allreduce);
  raw     hpct's storeless Gloo context alone, built as the backend builds it.
Arrival orders: in order / reverse / random (ranks 5 ms apart), and one late (rank 0,
which the others dial, 2 s after the rest).  Besides the total, ``after last`` is the
time from the last rank's arrival to the last first all_reduce: what arriving last costs.

    python benchmarks/startup.py [--n 2,4,8,16,32] [--orders ...] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import hpct.distributed  # noqa: E402,F401  (registers the backend before forking)
from hpct.demo import measure as m  # noqa: E402

STACKS = ("stock", "hpct", "raw")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="2,4,8,16,32", help="comma list of world sizes")
    ap.add_argument("--orders", default=",".join(m.ORDERS), help=f"comma list of: {', '.join(m.ORDERS)}")
    ap.add_argument("--repeat", type=int, default=3, help="runs per point (the median is shown)")
    args = ap.parse_args(argv)
    orders = [o.strip() for o in args.orders.split(",")]
    for o in orders:
        try:
            m.arrivals(o, 1)      # an unknown order fails here, before anything runs
        except ValueError as err:
            ap.error(str(err))
    rows = []
    for n in [int(x) for x in args.n.split(",")]:
        for order in orders:
            got = {}
            for stack in STACKS:
                runs = [m.startup(stack, n, order) for _ in range(args.repeat)]
                got[stack] = {k: m.median([r[k] for r in runs]) for k in ("total", "after_last")}
            s, h, r = got["stock"], got["hpct"], got["raw"]
            ms = lambda x: f"{x * 1000:.0f}"   # noqa: E731
            rows.append([n, order, ms(s["total"]), ms(h["total"]), ms(r["total"]),
                         f"{s['total'] / h['total']:.1f}x", f"{h['total'] / r['total']:.2f}x",
                         ms(s["after_last"]), ms(h["after_last"])])
            print(f"  N={n} {order}: stock {ms(s['total'])} ms, hpct {ms(h['total'])} ms, "
                  f"raw {ms(r['total'])} ms", file=sys.stderr, flush=True)
    print(m.table(["N", "arrival", "stock (ms)", "hpct (ms)", "raw ctx (ms)", "stock/hpct", "hpct/raw",
                   "stock after last (ms)", "hpct after last (ms)"], rows,
                  f"Start-up: release -> last first all_reduce ({os.cpu_count()} CPUs, torch "
                  f"{torch.__version__}, median of {args.repeat})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
