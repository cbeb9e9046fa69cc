"""hpct-build build"""

from __future__ import annotations

import argparse

from ..cliutil import print_json
from ..errors import ConfigError
from .builder import build_gloo
from .common import add_components, add_root, layout_of, manifests_of, progress_of

RECIPES = {"gloo": build_gloo, "pytorch": None}   # pytorch: hpct.build.pytorch (options below)
PYTORCH_ONLY = ("dry_run", "json", "cuda", "cuda_arch", "nccl")


def configure_parser(p: argparse.ArgumentParser) -> None:
    add_root(p)
    add_components(p, nargs="+")
    p.add_argument("--tests", action="store_true", help="also build the component's own test suite")
    p.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    torch = p.add_argument_group("pytorch")
    torch.add_argument("--dry-run", action="store_true",
                       help="print the exact environment and commands of the build, run nothing")
    torch.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")
    torch.add_argument("--cuda", action="store_true", help="build with CUDA (default: CPU only)")
    torch.add_argument("--cuda-arch", default=None, metavar="LIST",
                       help="TORCH_CUDA_ARCH_LIST, e.g. '8.0;9.0' (default with --cuda: 8.0;9.0)")
    torch.add_argument("--nccl", default=None, metavar="hpct|bundled|PREFIX",
                       help="NCCL of a CUDA build: hpct's patched build (default), PyTorch's bundled "
                            "one, or an install prefix")


def execute(args: argparse.Namespace) -> int:
    layout, progress = layout_of(args), progress_of(args)
    manifests = manifests_of(layout, args.components)
    used = [f"--{o.replace('_', '-')}" for o in PYTORCH_ONLY if getattr(args, o, None)]
    if used and any(m.name != "pytorch" for m in manifests):
        raise ConfigError(f"{', '.join(used)} apply to `build pytorch` only", fix="build pytorch on its own")
    if args.json and not args.dry_run:
        raise ConfigError("--json needs --dry-run", fix="add --dry-run")
    for m in manifests:
        if m.name not in RECIPES:
            raise ConfigError(f"no build recipe for {m.name} in this version of hpct-build",
                              fix=f"build one of: {', '.join(RECIPES)}")
        if m.name == "pytorch":
            from . import pytorch
            opts = dict(cuda=args.cuda, cuda_arch=args.cuda_arch, nccl=args.nccl, jobs=args.jobs)
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
        prefix = RECIPES[m.name](layout, m, progress, tests=args.tests, jobs=args.jobs)
        print(f"{m.name} {m.version}: installed at {prefix}")
    return 0
