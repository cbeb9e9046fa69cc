"""``hpct run``: torchrun's command line; one agent per node keeps healthy workers alive."""

from __future__ import annotations

import argparse
import os


def configure_parser(p: argparse.ArgumentParser) -> None:
    from .launch.options import configure_parser as options
    p.epilog = ("torchrun's flags work with the word changed; a killed worker is replaced at the survivors' "
                "next generation and they recover in-process (docs/launch.md)")
    options(p)


def execute(args: argparse.Namespace) -> int:
    from .launch.agent import NodeAgent
    from .launch.options import RunOptions
    opts = RunOptions.from_mapping(vars(args), os.environ)
    return NodeAgent(opts, dict(os.environ)).run()
