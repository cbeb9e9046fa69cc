"""``hpct``: check and prepare a node for rootless start-up."""

from __future__ import annotations

from typing import Sequence

from .cliutil import run_cli

VERBS = {
    "doctor": "check the installed build and this node; exit 0 only when all required checks pass",
    "ports": "show, apply or check the port plan against the kernel's port ranges",
    "demo": "train on a few local ranks, kill one, recover in-process; timings next to stock PyTorch",
    "run": "launch a training script like torchrun; a lost worker is replaced, the others keep running",
    "diagnose": "run on every rank of a job: measure every link, name the slow one and the settings that differ",
}


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hpct", __doc__.splitlines()[0].split(": ", 1)[1], "hpct", VERBS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
