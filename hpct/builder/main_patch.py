"""hpct-build patch"""

from __future__ import annotations

import argparse

from . import patches
from .common import add_components, add_root, layout_of, manifests_of, progress_of
from .main_fetch import source_for
from .sources import fetch


def configure_parser(p: argparse.ArgumentParser) -> None:
    add_root(p)
    add_components(p)
    p.add_argument("--check", action="store_true",
                   help="apply to a scratch copy of the pristine tree and discard it")
    p.add_argument("--record-sha256", action="store_true",
                   help="like --check, then write the touched files' sha256 beside the series "
                        f"({patches.TOUCHED_SHA256}); later applies verify them")


def execute(args: argparse.Namespace) -> int:
    layout, progress = layout_of(args), progress_of(args)
    for m in manifests_of(layout, args.components):
        series = patches.load_series(layout, m)
        if not series.entries:
            progress.step(f"{m.name} {m.version}: no patch series; nothing to apply")
            continue
        fetch(layout, m, progress, source=source_for(m, None))
        if args.check or args.record_sha256:
            patches.check(layout, m, progress, record=args.record_sha256)
            print(f"{m.name} {m.version}: all {len(series.entries)} patches apply "
                  f"(series {series.identity()})")
        else:
            dest = patches.patch(layout, m, progress)
            print(f"{m.name} {m.version}: patched tree at {dest} (series {series.identity()})")
    return 0
