"""``hpct doctor``: one table (or JSON document) saying whether this build and node are ready."""

from __future__ import annotations

import argparse

from .cliutil import print_json
from .errors import DoctorFailed


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document: ok, and every check with status, detail and fix")


def execute(args: argparse.Namespace) -> int:
    from .doctor import as_json, failures, render_table
    from .doctor_run import run_checks
    rows = run_checks()
    if args.json:
        print_json(as_json(rows))
    else:
        print(render_table(rows))
    bad = failures(rows)
    if bad:
        raise DoctorFailed(f"{len(bad)} required check(s) failed: {', '.join(r.check for r in bad)}",
                           fix="apply the fix shown for each failing row, then run hpct doctor again")
    return 0
