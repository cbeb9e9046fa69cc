"""hpct-build wheel"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import ConfigError
from .common import add_root, layout_of, progress_of

COMPONENTS = ("hpct", "nccl")


def configure_parser(p: argparse.ArgumentParser) -> None:
    add_root(p)
    p.add_argument("component", nargs="?", default="hpct", metavar="COMPONENT",
                   help="hpct (default): the hpct wheel; nccl[=VERSION]: the patched NCCL build as a "
                        "drop-in NVIDIA wheel (2.21.5: nvidia-nccl-cu12; 2.30.7: nvidia-nccl-cu13)")
    p.add_argument("--install", action="store_true",
                   help="pip install this interpreter's wheel into it (without --python: build only that one)")
    p.add_argument("--python", action="append", default=None, metavar="PYTHON",
                   help="hpct: an interpreter to build for (a path, or a version such as 3.12), repeatable; "
                        "default: all, one wheel per supported CPython found on PATH and under pyenv")
    p.add_argument("--sdist", action="store_true", help="hpct: also write the source distribution into dist/")
    p.add_argument("--prefix", type=Path, default=None,
                   help="nccl: the NCCL install prefix to package (default: hpct-build build nccl's)")
    p.add_argument("--dist", type=Path, default=None, help="nccl: where to write the wheel (default: dist/)")


def execute(args: argparse.Namespace) -> int:
    component, _, version = args.component.partition("=")
    if component not in COMPONENTS or (version and component != "nccl"):
        raise ConfigError(f"no wheel for {args.component!r}",
                          fix="build one of: hpct, nccl, nccl=VERSION")
    layout, progress = layout_of(args), progress_of(args)
    if component == "nccl":
        if args.python or args.sdist:
            raise ConfigError("--python and --sdist apply to the hpct wheel only", fix="drop them")
        from .nccl_wheel import build_nccl_wheel, install
        wheel = build_nccl_wheel(layout, progress, prefix=args.prefix, dist=args.dist, version=version or None)
        if args.install:
            install(wheel, progress)
        print(wheel)
        return 0
    if args.prefix is not None or args.dist is not None:
        raise ConfigError("--prefix and --dist apply to `wheel nccl` only", fix="drop them")
    from .wheel import build_wheels
    pythons = args.python or ([sys.executable] if args.install else ["all"])
    for path in build_wheels(layout, progress, pythons, install=args.install, sdist=args.sdist):
        print(path)
    return 0
