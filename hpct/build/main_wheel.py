"""hpct-build wheel"""

from __future__ import annotations

import argparse

from .common import add_root, layout_of, progress_of
from .wheel import build_wheel


def configure_parser(p: argparse.ArgumentParser) -> None:
    add_root(p)
    p.add_argument("--install", action="store_true", help="pip install the wheel into this interpreter")


def execute(args: argparse.Namespace) -> int:
    wheel = build_wheel(layout_of(args), progress_of(args), install=args.install)
    print(wheel)
    return 0
