"""What both console scripts share: verb dispatch, ``-v``, error rendering.

Each verb lives in its own module (``main_<verb>.py``) exposing
``configure_parser(subparsers)`` and ``execute(args) -> int``.  Modules are
imported only for the verb that runs, so ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Sequence

from .errors import HpctError

JSON_SCHEMA_VERSION = 1


def run_cli(prog: str, description: str, package: str, verbs: dict[str, str],
            argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run one verb.  ``verbs`` maps verb name to help line."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show tracebacks and subprocess output")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    argv = list(sys.argv[1:] if argv is None else argv)
    # Only the verb being run is imported: a stub parser stands in for the rest.
    chosen = next((a for a in argv if a in verbs), None)
    for verb, help_line in verbs.items():
        if verb == chosen:
            module = importlib.import_module(f"{package}.main_{verb}")
            p = sub.add_parser(verb, help=help_line, description=help_line)
            module.configure_parser(p)
            p.set_defaults(_module=module)
        else:
            sub.add_parser(verb, help=help_line)
    args = parser.parse_args(argv)
    try:
        return int(args._module.execute(args) or 0)
    except HpctError as err:
        if args.verbose:
            import traceback
            traceback.print_exc()
        print(f"{prog}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def print_json(payload: dict) -> None:
    """Every ``--json`` document carries the schema version first."""
    print(json.dumps({"schema_version": JSON_SCHEMA_VERSION, **payload}, indent=2, sort_keys=False))
