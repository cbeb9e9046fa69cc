"""hpct-build build"""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from .builder import build_gloo
from .common import add_components, add_root, layout_of, manifests_of, progress_of

RECIPES = {"gloo": build_gloo}


def configure_parser(p: argparse.ArgumentParser) -> None:
    add_root(p)
    add_components(p, nargs="+")
    p.add_argument("--tests", action="store_true", help="also build the component's own test suite")
    p.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")


def execute(args: argparse.Namespace) -> int:
    layout, progress = layout_of(args), progress_of(args)
    for m in manifests_of(layout, args.components):
        recipe = RECIPES.get(m.name)
        if recipe is None:
            raise ConfigError(f"no build recipe for {m.name} in this version of hpct-build",
                              fix=f"build one of: {', '.join(RECIPES)}")
        prefix = recipe(layout, m, progress, tests=args.tests, jobs=args.jobs)
        print(f"{m.name} {m.version}: installed at {prefix}")
    return 0
