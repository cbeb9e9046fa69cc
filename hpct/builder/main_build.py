"""hpct-build build"""

from __future__ import annotations

import argparse

from ..cliutil import print_json
from ..errors import ConfigError
from .builder import build_gloo
from .nccl import build_nccl
from .common import add_components, add_root, layout_of, manifests_of, progress_of

RECIPES = {"gloo": build_gloo, "pytorch": None, "nccl": build_nccl}   # pytorch: hpct.builder.pytorch
# option -> the components it applies to (any other component refuses it)
SCOPED = {"dry_run": ("pytorch",), "json": ("pytorch",), "nccl": ("pytorch",),
          "cuda": ("pytorch", "nccl"), "cuda_arch": ("pytorch", "nccl"), "funcs": ("nccl",)}


def configure_parser(p: argparse.ArgumentParser) -> None:
    add_root(p)
    add_components(p, nargs="+")
    p.add_argument("--tests", action="store_true", help="also build the component's own test suite")
    p.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    torch = p.add_argument_group("pytorch")
    torch.add_argument("--dry-run", action="store_true",
                       help="print the exact environment and commands of the build, run nothing")
    torch.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")
    torch.add_argument("--cuda", nargs="?", const=True, default=None, metavar="VERSION",
                       help="pytorch: build with CUDA (default: CPU only); nccl: the CUDA version "
                            "to build with, 12.4 (default) or 12.8")
    torch.add_argument("--cuda-arch", default=None, metavar="LIST",
                       help="pytorch: TORCH_CUDA_ARCH_LIST, e.g. '8.0;9.0' (default with --cuda: 8.0;9.0); "
                            "nccl: compute capabilities, e.g. 80,90 (the default)")
    torch.add_argument("--nccl", default=None, metavar="hpct|bundled|PREFIX",
                       help="NCCL of a CUDA build: hpct's patched build (default), PyTorch's bundled "
                            "one, or an install prefix")
    nccl = p.add_argument_group("nccl")
    nccl.add_argument("--funcs", default=None, metavar="SPEC",
                      help="NCCL's ONLY_FUNCS: build only these collectives' device code, e.g. "
                           "\"SendRecv\" or \"AllReduce Sum f32 * *|SendRecv\" (default: all; ~16 min)")


def execute(args: argparse.Namespace) -> int:
    layout, progress = layout_of(args), progress_of(args)
    manifests = manifests_of(layout, args.components)
    for opt, scope in SCOPED.items():
        others = [m.name for m in manifests if m.name not in scope]
        if getattr(args, opt, None) and others:
            flag = f"--{opt.replace('_', '-')}"
            raise ConfigError(f"{flag} apply to `build {' or '.join(scope)}` only (not {', '.join(others)})",
                              fix=f"build {' or '.join(scope)} on its own")
    if args.cuda is not None and args.cuda is not True and any(m.name == "pytorch" for m in manifests):
        raise ConfigError(f"`build pytorch --cuda` takes no version (got {args.cuda!r}): it uses the "
                          "CUDA that CUDA_HOME or nvcc on PATH provides", fix="write --cuda alone")
    if args.json and not args.dry_run:
        raise ConfigError("--json needs --dry-run", fix="add --dry-run")
    for m in manifests:
        if m.name not in RECIPES:
            raise ConfigError(f"no build recipe for {m.name} in this version of hpct-build",
                              fix=f"build one of: {', '.join(RECIPES)}")
        if m.name == "pytorch":
            from . import pytorch
            opts = dict(cuda=bool(args.cuda), cuda_arch=args.cuda_arch, nccl=args.nccl, jobs=args.jobs)
            if args.dry_run:
                plan = pytorch.plan(layout, m, **opts)
                if args.json:
                    print_json({"component": "pytorch", **plan.as_dict()})
                else:
                    print(plan.render())
                continue
            wheel = pytorch.build(layout, m, progress, **opts)
            print(f"{m.name} {m.version}: wheel at {wheel}")
            continue
        if m.name == "nccl":
            prefix = build_nccl(layout, m, progress, tests=args.tests, jobs=args.jobs,
                                cuda=None if args.cuda is True else args.cuda,
                                cuda_arch=args.cuda_arch, funcs=args.funcs)
            print(f"{m.name} {m.version}: installed at {prefix}")
            continue
        prefix = RECIPES[m.name](layout, m, progress, tests=args.tests, jobs=args.jobs)
        print(f"{m.name} {m.version}: installed at {prefix}")
    return 0
