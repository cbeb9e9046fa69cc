"""Options and helpers that several hpct-build verbs share."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import ConfigError
from .layout import WORKDIR_ENV, Layout, resolve_layout
from .progress import Progress
from .sources import Manifest, components, load_manifest


def add_root(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, default=None,
                   help="the hpct checkout (default: found from the current directory)")
    p.add_argument("--workdir", type=Path, default=None,
                   help=f"work in this folder instead of the checkout (default: ${WORKDIR_ENV}); "
                        "it gets a copy of the manifests and patches: the checkout's, or outside one "
                        "those the installed hpct carries")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")


def add_components(p: argparse.ArgumentParser, nargs: str = "*") -> None:
    p.add_argument("components", nargs=nargs, metavar="COMPONENT[=VERSION]",
                   help="gloo, pytorch or nccl (default: all)")


def layout_of(args: argparse.Namespace) -> Layout:
    return resolve_layout(getattr(args, "root", None), getattr(args, "workdir", None))


def progress_of(args: argparse.Namespace) -> Progress:
    return Progress(quiet=getattr(args, "quiet", False) or getattr(args, "json", False))


def manifests_of(layout: Layout, specs: list[str] | str | None) -> list[Manifest]:
    if isinstance(specs, str):
        specs = [specs]
    if not specs:
        return [load_manifest(layout, name) for name in components(layout)]
    out = []
    for spec in specs:
        name, _, version = spec.partition("=")
        if not name:
            raise ConfigError(f"bad component {spec!r}", fix="write COMPONENT or COMPONENT=VERSION")
        out.append(load_manifest(layout, name, version or None))
    return out
