"""`hpct demo`'s argument checks.  The demo itself runs end to end in
tests/test_entrypoints.py::test_readme_command_1_main_job (the main job ends with it, through the
installed console script), which asserts its table and its bit-identical recovery."""

from __future__ import annotations

import pytest

from util import run_cli

pytestmark = pytest.mark.unit


def test_demo_rejects_bad_arguments():
    res = run_cli("hpct", "demo", "--ranks", "1", timeout=60)
    assert res.returncode != 0
    assert "--ranks must be at least 2" in res.stderr + res.stdout
