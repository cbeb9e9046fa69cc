"""hpct-build all"""

from __future__ import annotations

import argparse
import sys

from ..errors import SourceError
from . import main_status, patches
from .common import add_root, layout_of, manifests_of, progress_of
from .main_fetch import SOURCE_ENV, SOURCES_ENV, source_for
from .sources import load_manifest, pinned_versions
from .sources import fetch
from .wheel import build_wheel


def configure_parser(p: argparse.ArgumentParser) -> None:
    add_root(p)
    p.add_argument("--no-install", action="store_true", help="build the wheel but do not install it")


def execute(args: argparse.Namespace) -> int:
    layout, progress = layout_of(args), progress_of(args)
    manifests = []
    for m in manifests_of(layout, None):
        # Every pinned version (NCCL pins one per PyTorch it serves), the default first.
        manifests += [m] + [load_manifest(layout, m.name, v) for v in pinned_versions(layout, m.name)[1:]]
    for m in manifests:
        try:
            fetch(layout, m, progress, source=source_for(m, None))
        except SourceError as err:
            if m.name != "nccl":
                raise
            # No NCCL provider is reachable on every machine; the rest does not need it.
            env, folder = SOURCE_ENV.format(NAME="NCCL"), SOURCES_ENV.format(NAME="NCCL")
            print(f"hpct-build: nccl {m.version} skipped: {err.problem} (set {folder} to a folder of tag "
                  f"tarballs nccl-<version>-1.tar.gz, or {env} to a tarball or tree)", file=sys.stderr)
            continue
        if patches.load_series(layout, m).entries:
            patches.check(layout, m, progress)
    build_wheel(layout, progress, install=not args.no_install)
    status_args = argparse.Namespace(root=layout.root, json=False)
    return main_status.execute(status_args)
