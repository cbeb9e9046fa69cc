"""hpct-build wheel"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import ConfigError
from .common import add_root, layout_of, progress_of

COMPONENTS = ("hpct", "nccl", "torch")


def configure_parser(p: argparse.ArgumentParser) -> None:
    add_root(p)
    p.add_argument("component", nargs="?", default="hpct", metavar="COMPONENT",
                   help="hpct (default): the hpct wheel; nccl[=VERSION]: the patched NCCL build as a "
                        "drop-in NVIDIA wheel (2.21.5: nvidia-nccl-cu12; 2.30.7: nvidia-nccl-cu13); "
                        "torch=VERSION: PyPI's torch wheel with hpct's PyTorch series, built out of tree")
    p.add_argument("--install", action="store_true",
                   help="pip install this interpreter's wheel into it (without --python: build only that one)")
    p.add_argument("--python", action="append", default=None, metavar="PYTHON",
                   help="hpct, torch: an interpreter to build for (a path, a version such as 3.12, or all), "
                        "repeatable; default for hpct: all, one wheel per supported CPython found on PATH and "
                        "under pyenv; for torch: this interpreter")
    p.add_argument("--sdist", action="store_true", help="hpct: also write the source distribution into dist/")
    p.add_argument("--prefix", type=Path, default=None,
                   help="nccl: the NCCL install prefix to package (default: hpct-build build nccl's)")
    p.add_argument("--dist", type=Path, default=None, help="nccl, torch: where to write the wheel (default: dist/)")
    p.add_argument("--torch-wheel", type=Path, default=None, metavar="WHEEL",
                   help="torch: the PyPI wheel to start from, already downloaded (its sha256 must be the pin's)")
    p.add_argument("--no-nccl", action="store_true",
                   help="torch: leave ProcessGroupNCCL stock (no CUDA headers needed; the build is 4x shorter)")
    p.add_argument("-j", "--jobs", type=int, default=None, help="torch: compile jobs (default: all cores)")


def execute(args: argparse.Namespace) -> int:
    component, _, version = args.component.partition("=")
    if component not in COMPONENTS or (version and component == "hpct"):
        raise ConfigError(f"no wheel for {args.component!r}",
                          fix="build one of: hpct, nccl, nccl=VERSION, torch=VERSION")
    layout, progress = layout_of(args), progress_of(args)
    if component != "torch" and (args.torch_wheel or args.no_nccl or args.jobs):
        raise ConfigError("--torch-wheel, --no-nccl and --jobs apply to `wheel torch=VERSION` only", fix="drop them")
    if component == "torch":
        return _torch(args, layout, progress, version)
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


def _torch(args: argparse.Namespace, layout, progress, version: str) -> int:
    if args.prefix is not None or args.sdist:
        raise ConfigError("--prefix and --sdist do not apply to `wheel torch=VERSION`", fix="drop them")
    from .sources import load_manifest
    from .torch_wheel import build
    wheels = build(layout, load_manifest(layout, "pytorch", version or None), progress,
                   args.python or [sys.executable], dist=args.dist, given=args.torch_wheel, jobs=args.jobs,
                   nccl=not args.no_nccl)
    if args.install:
        import subprocess
        mine = [w for w in wheels if f"-cp{sys.version_info[0]}{sys.version_info[1]}-" in w.name]
        for wheel in mine:
            # With its dependencies, as a user's pip would: torch 2.6.0's NVIDIA wheels, and its NCCL
            # pin, which hpct's drop-in nvidia-nccl-cu12 2.21.5+hpct satisfies where it is installed.
            for extra in (["--force-reinstall", "--no-deps"], []):
                rc = subprocess.run([sys.executable, "-m", "pip", "install", *extra, str(wheel)]).returncode
                if rc != 0:
                    from ..errors import BuildError
                    raise BuildError(f"pip install {wheel.name} into {sys.executable} failed (exit {rc})",
                                     fix="see pip's output above")
    for wheel in wheels:
        print(wheel)
    return 0
