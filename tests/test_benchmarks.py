"""The benchmarks run from a checkout and print what their docs promise (small N only).

The numbers themselves are not asserted (they are measurements); what is asserted is
the behaviour they report: lazy pairs leave at most log2(N)+2 connections per rank, the
full mesh N-1, and every arrival order completes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from util import REPO

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]


def _run(script: str, *args: str, timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=timeout, cwd="/")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_scale_reports_log_connections_for_lazy_pairs_and_the_mesh_for_full(tmp_path):
    out = tmp_path / "scale.json"
    text = _run("scale.py", "--n", "6", "--mesh", "6", "--stock", "", "--netns", "", "--json", str(out))
    doc = json.loads(out.read_text())
    assert doc["schema"] == 1 and doc["costs"]["conn_s"] > 0 and doc["costs"]["hop_s"] > 0
    runs = {r["stack"]: r for r in doc["runs"]}
    assert runs["hpct-lazy"]["error"] is None and runs["hpct-mesh"]["error"] is None, runs
    # a binomial tree (formation) and a ring (the allreduce): at most log2(6) + 2 peers
    assert runs["hpct-lazy"]["conn_max"] <= 4 and runs["hpct-lazy"]["recovery"]["conn_max"] <= 4
    assert runs["hpct-mesh"]["conn_max"] == 5
    assert runs["hpct-lazy"]["recovery_s"] > 0
    assert "| hpct-lazy | loopback | 6 |" in text, text
    model = _run("model.py", "--inputs", str(out), "--png", str(tmp_path / "model.png"), "--n", "1000,100000")
    assert (tmp_path / "model.png").stat().st_size > 1000
    assert "100000" in model, model


def test_startup_every_arrival_order_completes():
    text = _run("startup.py", "--n", "3", "--repeat", "1", "--orders", "in order,reverse,random")
    for order in ("in order", "reverse", "random"):
        assert re.search(rf"^\| 3 \|\s+{order} \|", text, re.MULTILINE), text


def test_an_unknown_arrival_order_is_refused_before_anything_runs():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "startup.py"), "--orders", "sideways"],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode != 0
    assert "unknown arrival order 'sideways'" in proc.stderr, proc.stderr


@pytest.mark.multihost
def test_diloco_moves_about_h_times_fewer_bytes_than_stock_ddp(tmp_path):
    # Four namespaces behind the userspace switch (no delay here: only the byte counts are
    # checked, and they do not depend on it).  H = 10: fp32 DiLoCo puts about 1/10 of DDP's
    # bytes on the wire per step, int8 about a quarter of that again.
    from hpct.testing.netns import unavailable_reason
    why = unavailable_reason()
    if why:
        pytest.skip(why)
    out = tmp_path / "diloco.json"
    _run("diloco.py", "--steps", "20", "--h", "10", "--delay-ms", "0", "--modes", "ddp-gloo,diloco,diloco-int8",
         "--json", str(out))
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    ddp, fp32, int8 = (rows[m]["bytes_per_step"] for m in ("ddp-gloo", "diloco", "diloco-int8"))
    assert 6 < ddp / fp32 < 14, rows
    assert 2.5 < fp32 / int8 < 5, rows


def test_groups_reports_live_groups_against_stock_gloo():
    text = _run("groups.py", "--sizes", "2", "--groups", "4")
    assert "4 live groups: new_group + first all_reduce each" in text, text
    assert re.search(r"^\s+2\s+[\d.]+\s+[\d.]+\s+[\d.]+x$", text, re.MULTILINE), text


def test_shrink_reports_hpct_against_stocks_re_initialisation_and_the_nccl_reference():
    text = _run("shrink.py", "--sizes", "3", timeout=240)
    assert re.search(r"^\s+3\s+[\d.]+\s+[\d.]+\s+[\d.]+x$", text, re.MULTILINE), text
    assert "stock destroy+TCPStore+init" in text and "1.4-2.0 s" in text, text


@pytest.mark.multihost
def test_diagnose_matrix_in_rounds_and_serial_cover_the_same_pairs_and_names_a_slow_link():
    text = _run("diagnose.py", "--hosts", "4", "--slow-hosts", "4", "--ratios", "100", "--no-profile", timeout=300)
    # 4 hosts: 3 rounds of 2 pairs, or 6 rounds of one; nothing suspect on a clean bridge
    assert re.search(r"^\| 4 \| 3 \| [0-9.]+ \| 6 \| [0-9.]+ \| [0-9.]+x \| 0 \|$", text, re.MULTILINE), text
    assert "model at 1024 nodes" in text and "rounds 1023 x" in text and "one pair at a time 523776 x" in text
    # one link at 1/100 of the median: the table has its row, and exactly that link was named
    assert re.search(r"^\| 4 \| [0-9]+ \| 100 \| [0-9.e+-]+ \| [0-9]+ \| [0-9.]+ \| [0-9.]+ \| yes \|$", text, re.MULTILINE), text


def test_profile_comm_benchmark_reports_overhead_and_accuracy():
    text = _run("profile_comm.py", "--rounds", "1", "--steps", "4", "--width", "128", "--layers", "4", timeout=300)
    assert "summary: profiling overhead" in text and "comm/direct" in text, text
    for mode in ("plain", "off", "hook", "on", "disabled"):
        assert re.search(rf"^\s+{mode}\s+[0-9.]+ ", text, re.MULTILINE), (mode, text)


@pytest.mark.slow
def test_launch_replaces_one_worker_in_place_where_torchrun_restarts_all(tmp_path):
    """The early kill (0.5 s after the job's first completed step): hpct run forks the replacement
    from its fork server (its default), torchrun restarts every worker."""
    out = tmp_path / "launch.json"
    text = _run("launch.py", "--config", "1x2", "--kill-after-first-step", "0.5", "--steps", "40",
                "--launchers", "hpct,torchrun", "--json", str(out))
    doc = json.loads(out.read_text())
    assert doc["schema"] == 1 and doc["configs"][0]["config"] == "1x2" and doc["kill_after_first_step"] == 0.5
    runs = {r["launcher"]: r for r in doc["configs"][0]["runs"]}
    hp, tr = runs["hpct"], runs["torchrun"]
    assert hp["error"] is None and tr["error"] is None, runs
    assert hp["restarted"] == [1] and hp["started"] == ["forked"], hp     # only the killed rank, forked
    assert hp["steps_lost"] <= 1 and hp["recovery_s"] > 0, hp             # survivors kept their steps
    assert tr["restarted"] == [0, 1] and tr["steps_lost"] >= 1, tr        # everyone again from step 0
    assert re.search(r"^\| 1x2 +\| hpct run +\| +[0-9.]+ \| .* \| +forked \|", text, re.MULTILINE), text
    assert "SIGKILL of the last rank 0.5 s after every rank's first completed step" in text, text
    assert "goal: a worker killed 0.5 s after the job's first completed step: every rank on its next step" in text


def test_launch_refuses_a_kill_that_lands_after_the_jobs_last_step():
    """8 steps end before hpct's standby is warm (it starts once the world formed): the benchmark
    says so and exits 1, instead of killing a rank whose peers have finished, or waiting for a
    standby that a finished job never warms (it did, past the test's timeout)."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "launch.py"), "--config", "1x2",
                           "--kill-step", "3", "--steps", "8", "--launchers", "hpct-standby"],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # the job ends with the standbys still warming when its steps are quicker than their import
    assert re.search(r"rank 1 (was at step [678] of 8 once the standbys were warm|finished its 8 steps before the "
                     r"standbys were warm), too late to measure a recovery: give more --steps or a longer --step-time",
                     proc.stdout + proc.stderr), proc.stdout


@pytest.mark.slow
def test_launch_node_loss_shrinks_the_survivors_in_place_or_a_spare_takes_the_slot(tmp_path):
    from hpct.testing.netns import unavailable_reason
    if (why := unavailable_reason()) is not None:
        pytest.skip(why)
    out = tmp_path / "launch.json"
    text = _run("launch.py", "--config", "3x1", "--kill-step", "3", "--steps", "8",
                "--launchers", "hpct-node,hpct-spare", "--json", str(out))
    shrink, spare = json.loads(out.read_text())["configs"][0]["runs"]
    for run in (shrink, spare):
        assert run["error"] is None, run
        assert run["steps_lost"] == 0 and 0 < run["dropped_s"] <= run["recovery_s"], run
        assert "node 2 " in run["how"], run
    assert shrink["restarted"] == [], shrink        # the survivors kept their processes
    # The spare's worker holds the lost rank 2 (a new process, forked from the spare's fork server); the
    # survivors kept theirs.
    assert spare["restarted"] == [2] and spare["spare_started"] == ["forked"], spare
    assert "node 3 takes its slot" in spare["how"], spare
    assert re.search(r"^3x1, hpct run, a node lost \(--node-grace 1\): .* dropped it [0-9.]+ s after the kill", text,
                     re.MULTILINE), text
    assert re.search(r"^3x1, hpct run --spare-nodes 1, a node lost .* the spare's repaired world's first step", text,
                     re.MULTILINE), text
