"""`hpct demo`'s argument checks and its headline number's arithmetic.  The demo itself runs end to end in
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


def test_failure_to_training_resumed_is_the_kill_to_every_ranks_next_step():
    """The demo's headline number (hpct/demo/launched.py): from the SIGKILL to the moment the last
    rank completed a step after it, the killed rank's replacement included; a rank that never
    stepped after the kill is an error, not a number."""
    from hpct.demo.launched import Launched
    starts = [{"event": "start", "rank": r, "pid": 10 + r, "generation": 0} for r in range(3)]

    def rec(rank, *steps):
        return {"rank": rank, "events": [], "stepped": [{"step": 0, "t": t, "generation": 0} for t in steps]}
    records = [rec(0, 1.0, 5.2, 5.9), rec(1, 1.0, 5.3), rec(2, 1.0), rec(2, 5.6)]   # rank 2 killed, replaced
    job = Launched(records, starts, "hpct run --nproc-per-node 3", victim=2, t_kill=5.0)
    assert job.resumed_s() == pytest.approx(0.6)
    with pytest.raises(RuntimeError, match=r"ranks \[2\] completed no step after the kill"):
        Launched(records[:3], starts, "hpct run --nproc-per-node 3", victim=2, t_kill=5.0).resumed_s()
