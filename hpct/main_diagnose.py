"""``hpct diagnose``: every rank measures its links; rank 0 prints the verdict.

Exit 0 when nothing is suspect, SuspectFound's code (16) when a link, a node or a setting
is, RendezvousError's (11) when a rank never arrived at its planned address, DiagnoseTimeout's
(17) when the --timeout passed first (rank 0 still prints what was measured).
"""

from __future__ import annotations

import argparse
import json
import os


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=_positive, default=30.0,
                   help="seconds for the whole diagnosis, connecting included (default 30)")
    p.add_argument("--port-base", type=int, default=None,
                   help="first port of the diagnosis (default: right after the plan's NCCL block, so it "
                        "runs beside a job that holds the plan's ports)")
    p.add_argument("--all-local", action="store_true",
                   help="pair every local rank with its counterpart on the other node (a NIC per GPU)")
    p.add_argument("--serial", action="store_true", help="measure every link alone (slower; no shared spine)")
    p.add_argument("--bw-ratio", type=_positive, default=0.7,
                   help="a link below this x the median bandwidth is suspect (default 0.7)")
    p.add_argument("--lat-ratio", type=_positive, default=1.5,
                   help="a link above this x the median latency is suspect (default 1.5)")
    p.add_argument("--window-ms", type=_positive, default=100.0,
                   help="how long each direction of a link streams data (default 100 ms): a slow link "
                        "moves less in it, it does not take longer")
    p.add_argument("--bytes", type=int, default=8 << 20,
                   help="most bytes per direction of a link's run, even inside its window (default 8 MiB)")
    p.add_argument("--proc-sys", default="/proc/sys", help="where the kernel's settings are read (default /proc/sys)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (with a schema version)")
    p.add_argument("--plot", metavar="FILE", help="write the node-to-node bandwidth heatmap to FILE (PNG)")


def execute(args: argparse.Namespace) -> int:
    from .diagnose import diagnosis, links, report, verdict
    from .errors import ConfigError, DiagnoseTimeout, SuspectFound
    if args.bytes < 1 << 12:
        raise ConfigError(f"--bytes {args.bytes} is too small to measure a bandwidth", fix="pass at least 4096")
    opts = diagnosis.Options(
        timeout=args.timeout, port_base=args.port_base, all_local=args.all_local, serial=args.serial,
        thresholds=verdict.Thresholds(args.bw_ratio, args.lat_ratio),
        sizes=links.Sizes(window_s=args.window_ms / 1e3, message=min(args.bytes, 1 << 20), budget=args.bytes,
                          first_chunk=min(args.bytes, links.Sizes.first_chunk)),
        proc_sys=args.proc_sys, quiet=args.json)
    got = diagnosis.run(opts)
    if got["world_size"] and _rank() == 0:
        if args.plot:
            report.plot(got, args.plot)
        if args.json:
            print(json.dumps(got, indent=1))
        else:
            print(report.table(got))
    if not got["complete"]:
        raise DiagnoseTimeout(got["timeout"], fix="raise --timeout; rank 0 printed every link measured before "
                                                  "(a link that moves almost nothing is named, not waited for)")
    found = report.suspects(got)
    if found:
        raise SuspectFound(f"{len(found)} finding{'s' * (len(found) != 1)}: " + found[0],
                           fix="see the report above (rank 0's output); docs/diagnose.md says how to read it")
    return 0


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)
