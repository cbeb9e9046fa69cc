"""What both console scripts share: verb dispatch, ``--version``, ``-v``, error rendering.

Each verb lives in its own module (``main_<verb>.py``) exposing
``configure_parser(subparsers)`` and ``execute(args) -> int``.  Modules are
imported only for the verb that runs, so ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Sequence

from .errors import HpctError

JSON_SCHEMA_VERSION = 1


SIGPIPE_EXIT = 141         # what a shell reports for a program ended by SIGPIPE (128 + 13)


def run_cli(prog: str, description: str, package: str, verbs: dict[str, str],
            argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run one verb.  ``verbs`` maps verb name to help line.

    No verb prints the help (exit 0).  A reader that goes away (``| head``) ends the
    command quietly with the shell's SIGPIPE status instead of a traceback.
    """
    try:
        return _run(prog, description, package, verbs, argv)
    except BrokenPipeError:
        _discard_stdout()
        return SIGPIPE_EXIT


def _run(prog: str, description: str, package: str, verbs: dict[str, str],
         argv: Sequence[str] | None) -> int:
    from . import __version__
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"{prog} {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show tracebacks and subprocess output")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
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
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        sys.stdout.flush()          # --help or --version printed: a closed pipe shows up here
        raise
    if args.verb is None:
        parser.print_help()
        sys.stdout.flush()
        return 0
    try:
        code = int(args._module.execute(args) or 0)
        sys.stdout.flush()          # inside the try: a closed pipe shows up here, not at exit
        return code
    except HpctError as err:
        if args.verbose:
            import traceback
            traceback.print_exc()
        sys.stdout.flush()
        print(f"{prog}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _discard_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):    # no usable stdout at all: nothing left to protect
        pass


def console_script(name: str) -> str | None:
    """Where pip put the installed ``name`` console script of hpct, or None.

    The scripts folder of the interpreter may be off PATH (a pyenv shim not yet
    rehashed, a --user install): callers use this to run or point at the real file.
    """
    from importlib import metadata
    try:
        files = metadata.distribution("hpct").files or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == name and len(f.parts) >= 2 and f.parts[-2] in ("bin", "Scripts"):
            path = f.locate()
            if os.path.isfile(path):
                return os.path.abspath(path)
    return None


def print_json(payload: dict) -> None:
    """Every ``--json`` document carries the schema version first."""
    print(json.dumps({"schema_version": JSON_SCHEMA_VERSION, **payload}, indent=2, sort_keys=False))
