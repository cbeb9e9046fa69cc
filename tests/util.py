"""Helpers for the tests: run the installed console scripts with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ENTRY_POINTS = {"hpct-build": "hpct.build.cli", "hpct": "hpct.cli"}


def run_cli(prog: str, *args: str, env: dict | None = None, timeout: float = 600,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run an installed console script (via its module, so PATH games are possible)."""
    code = f"import sys; from {ENTRY_POINTS[prog]} import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd or "/")


def same(a, b) -> bool:
    """Equal results as torch gives them: tensors of one dtype, shape and value, nested alike."""
    import torch
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
