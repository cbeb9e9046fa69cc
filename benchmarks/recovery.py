"""Recovery: a rank is SIGKILLed -> first successful all_reduce of the rebuilt group (max over ranks).

Three ways, in the same run, N ranks on this machine, the last rank killed while every
rank runs all_reduce in a loop; a replacement rank is started at once (forked from a warm
parent, as a spare would be):
- hpct in-process: survivors see the failure (Gloo fails the whole storeless context at
  once), call hpct.distributed.recover() (abort, generation + 1, rootless connect);
- stock in-process: survivors wait for their all_reduce to fail (a dead neighbour is seen at
  once, any other rank waits for the op timeout, --stock-timeout), destroy_process_group(),
  and init again through a new TCPStore;
- stock full restart (what torchrun does): every process is killed and N fresh Python
  processes import torch, rendezvous through a TCPStore and run the all_reduce.

With --late S the replacement also starts S seconds after the kill (one late rank):
``after it`` is then the time from its start to the rebuilt group's first all_reduce.

    python benchmarks/recovery.py [--n 4,8,16] [--stock-timeout 5] [--late 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import hpct.distributed  # noqa: E402,F401  (registers the backend before forking)
from hpct.demo import measure as m  # noqa: E402


def _measured(what: str, fn, *args, **kwargs) -> float | None:
    """Seconds, or None (said on stderr with the reason) for a run that did not complete."""
    try:
        seconds = fn(*args, **kwargs)
    except (TimeoutError, RuntimeError, SystemExit) as err:
        print(f"  {what}: did not complete: {err}", file=sys.stderr, flush=True)
        return None
    print(f"  {what}: {seconds:.3f} s", file=sys.stderr, flush=True)
    return seconds


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not (a and b) else f"{a / b:.1f}x"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="4,8,16", help="comma list of world sizes")
    ap.add_argument("--stock-timeout", type=float, default=5.0,
                    help="op timeout of the stock process groups (seconds)")
    ap.add_argument("--late", type=float, default=0.0,
                    help="the replacement starts this many seconds after the kill (in-process runs)")
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args(argv)
    rows, data = [], []
    for n in [int(x) for x in args.n.split(",")]:
        h = _measured(f"hpct N={n}", m.recovery_in_process, "hpct", n, args.stock_timeout, late=args.late)
        s = _measured(f"stock N={n}", m.recovery_in_process, "stock", n, args.stock_timeout, late=args.late)
        f = _measured(f"full restart N={n}", m.full_restart, n)
        rows.append([n, _ms(h), _ms(s), _ratio(s, h), _ms(f), _ratio(f, h),
                     _ms(h and h - args.late), _ms(s and s - args.late)])
        data.append({"n": n, "late_s": args.late, "hpct_s": h, "stock_inprocess_s": s, "stock_restart_s": f})
    print("(-: did not complete; the reason is on stderr)", file=sys.stderr)
    print(m.table(["N", "hpct in-process (ms)", "stock in-process (ms)", "stock/hpct",
                        "stock full restart (ms)", "restart/hpct", "hpct after it (ms)",
                        "stock after it (ms)"], rows,
                       f"Recovery: SIGKILL of one rank -> first all_reduce of the rebuilt group, max over ranks "
                       f"({os.cpu_count()} CPUs, torch {torch.__version__}, stock op timeout "
                       f"{args.stock_timeout:g} s, replacement {args.late:g} s late)"))
    if args.json:
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
