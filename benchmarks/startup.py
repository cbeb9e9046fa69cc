"""Start-up: process start -> first successful all_reduce, max over ranks.

hpct (rootless: no store, the plan gives every peer's address)
against stock PyTorch (ProcessGroupGloo with a TCPStore on rank 0, tcp:// init), in
the same run, N ranks on this machine, started in rank order (and, for hpct, also in
reverse order: rank 0 last, which stock PyTorch cannot speed up: every rank waits for the
store).  Ranks are forked from a parent that has already
imported torch (see hpct/distributed/measure.py), so the times are the rendezvous + connect.

    python benchmarks/startup.py [--n 2,4,8,16,32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import hpct.distributed  # noqa: E402,F401  (registers the backend before forking)
from hpct.distributed import measure as m  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="2,4,8,16,32", help="comma list of world sizes")
    ap.add_argument("--repeat", type=int, default=3, help="runs per point (the median is shown)")
    args = ap.parse_args(argv)
    rows = []
    for n in [int(x) for x in args.n.split(",")]:
        h = m.median([m.startup("hpct", n) for _ in range(args.repeat)])
        hl = m.median([m.startup("hpct-last", n) for _ in range(args.repeat)])
        s = m.median([m.startup("stock", n) for _ in range(args.repeat)])
        rows.append([n, f"{s * 1000:.0f}", f"{h * 1000:.0f}", f"{s / h:.2f}x", f"{hl * 1000:.0f}", f"{s / hl:.2f}x"])
        print(f"  N={n}: stock {s * 1000:.0f} ms, hpct {h * 1000:.0f} ms, hpct rank 0 last {hl * 1000:.0f} ms",
              file=sys.stderr, flush=True)
    print(m.table(["N", "stock Gloo+TCPStore (ms)", "hpct (ms)", "stock/hpct",
                        "hpct, rank 0 last (ms)", "stock/hpct"], rows,
                       f"Start-up: process start -> first all_reduce, max over ranks "
                       f"({os.cpu_count()} CPUs, torch {torch.__version__}, median of {args.repeat})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
