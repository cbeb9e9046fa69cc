"""`hpct demo` runs end to end, bounded, and reports a bit-identical recovery."""

from __future__ import annotations

import pytest

from util import run_cli

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.serial]


def test_demo_runs_and_prints_the_table():
    res = run_cli("hpct", "demo", timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "bit-identical after recovery: yes" in out
    assert "survivors kept their processes: yes" in out
    for row in ("start-up: process start -> first all_reduce", "recovery: SIGKILL -> first all_reduce",
                "stock full restart"):
        assert row in out, out


def test_demo_rejects_bad_arguments():
    res = run_cli("hpct", "demo", "--ranks", "1", timeout=60)
    assert res.returncode != 0
    assert "--ranks must be at least 2" in res.stderr + res.stdout
