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
