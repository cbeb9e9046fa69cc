"""`hpct run --standby`: standbys import what the agent imports, a standby that fails says so and is
replaced after a backoff, and every start says whether it was warm or cold, and why (issue 41).

Standbys are the warm path of ``--no-fork-server`` (a node keeps none while its fork server lives,
the default), so these jobs run with it.  The workers are tests/launch_worker.py (no torch); the
standbys are hpct's own (they import torch), so a standby's warm-up takes seconds here."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hpct.ports import free_port_block
from hpct.testing.cluster import Agents

pytestmark = pytest.mark.multiprocess
WORKER = str(Path(__file__).with_name("launch_worker.py"))
LIMIT_S = 120


def args(tmp_path, standby: int, seconds: int = 60) -> list[str]:
    return ["--nproc-per-node", "1", "--no-fork-server", "--standby", str(standby),
            "--port-base", str(free_port_block(2 * 8 + 2)), WORKER, str(tmp_path), "until-replaced", str(seconds)]


def test_a_standby_beside_a_source_checkout_of_hpct_warms_and_a_replacement_starts_warm(tmp_path):
    """The job starts from a folder holding a source checkout of hpct (an hpct/ package without
    the compiled extension).  Before: the standby ran as `python -m hpct.launch.standby`, which puts
    the working folder first on sys.path, imported that folder, died silently, and the replacement
    started cold.  Now it imports the installed hpct, as the agent does."""
    (tmp_path / "hpct").mkdir()
    (tmp_path / "hpct" / "__init__.py").write_text("raise ImportError(\"cannot import name '_gloo' (a source tree)\")\n")
    with Agents(tmp_path, args(tmp_path, standby=1)) as agents:
        agents.start()
        agents.wait_event(0, "standby", LIMIT_S)
        os.kill(agents.worker_pid(0, 0), signal.SIGKILL)
        assert agents.wait(LIMIT_S) == [0], agents.output(0)
    replacement = agents.events(0, "start")[-1]
    assert replacement["generation"] == 1 and replacement["warm"] is True, replacement
    assert replacement["why"] == f"warm: standby pid {replacement['pid']}"
    assert agents.events(0, "standby-failed") == []


def test_a_standby_that_fails_to_warm_is_reported_with_its_log_and_tried_again_after_a_backoff(tmp_path):
    """A standby that dies before it is warm (here: a broken torch on its path) is an event with its
    exit and its log's last lines, on the console and in --json, and the next one starts after a
    backoff that doubles; the replacement then starts cold and says why."""
    broken = tmp_path / "broken"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text("raise RuntimeError('this torch is broken, on purpose')\n")
    with Agents(tmp_path, args(tmp_path, standby=1), env={"PYTHONPATH": str(broken)}) as agents:
        agents.start()
        failed = agents.wait_event(0, "standby-failed", LIMIT_S, count=2)
        os.kill(agents.worker_pid(0, 0), signal.SIGKILL)
        assert agents.wait(LIMIT_S) == [0], agents.output(0)
    first, second = failed[:2]
    assert first["message"].startswith(f"pid {first['pid']} exited before it was warm (exit 1); the next one in 1 s")
    assert "RuntimeError: this torch is broken, on purpose" in first["message"]
    assert Path(first["log"]).is_file() and first["retry_s"] == 1.0 and second["retry_s"] == 2.0
    assert second["t"] - first["t"] >= 1.0
    assert "standby-failed: pid" in agents.output(0)                    # on the console too
    replacement = agents.events(0, "start")[-1]
    assert replacement["warm"] is False and replacement["why"].startswith("cold: no standby was ready"), replacement
    assert "the last failed: standby pid" in replacement["why"]


def test_a_standby_killed_while_waiting_is_reported_and_replaced(tmp_path):
    # The first worker outlives every wait below: under load the second standby took longer to
    # warm than a 20 s job lasted (CI), and a finished job starts no more standbys.
    with Agents(tmp_path, args(tmp_path, standby=1, seconds=LIMIT_S)) as agents:
        agents.start()
        [ready] = agents.wait_event(0, "standby", LIMIT_S)
        os.killpg(ready["pid"], signal.SIGKILL)
        [failed] = agents.wait_event(0, "standby-failed", LIMIT_S)
        assert failed["pid"] == ready["pid"] and "exited while waiting (killed by signal 9)" in failed["message"]
        agents.wait_event(0, "standby", LIMIT_S, count=2)                 # a new one, after the backoff
        os.kill(agents.worker_pid(0, 0), signal.SIGKILL)
        assert agents.wait(LIMIT_S) == [0], agents.output(0)
    assert agents.events(0, "start")[-1]["warm"] is True


def test_a_replacement_without_standbys_says_it_started_cold_and_why(tmp_path):
    with Agents(tmp_path, args(tmp_path, standby=0, seconds=30)) as agents:
        agents.start()
        agents.wait_event(0, "start", LIMIT_S)
        os.kill(agents.worker_pid(0, 0), signal.SIGKILL)
        assert agents.wait(LIMIT_S) == [0], agents.output(0)
    first, replacement = agents.events(0, "start")
    assert first["why"] == "cold: a first start (generation 0)"
    assert replacement["why"] == "cold: no standby is kept (--standby 0)" and replacement["warm"] is False


def _started_s(pid: int) -> float:
    """When a live process started, in seconds since the machine's boot (one clock for every process)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")


def test_standbys_start_only_once_the_workers_world_formed(tmp_path):
    """A standby imports torch as the workers do: started beside them it takes their cores in the
    job's start (on 2 cores, 4 nodes x 4 workers, a fifth of them).  So a node starts its standbys
    once its workers told the agent that their world formed; a replacement then still starts warm."""
    join_after = 3.0
    with Agents(tmp_path, args(tmp_path, standby=1) + [str(join_after)]) as agents:
        agents.start()
        [ready] = agents.wait_event(0, "standby", LIMIT_S)
        worker = agents.worker_pid(0, 0)
        after = _started_s(ready["pid"]) - _started_s(worker)
        assert after >= join_after - 0.02, f"the standby started {after:.2f} s after the worker, before its world formed"
        assert list(tmp_path.glob(f"joined-0-{worker}")), "the worker told its agent"
        os.kill(worker, signal.SIGKILL)
        assert agents.wait(LIMIT_S) == [0], agents.output(0)
    replacement = agents.events(0, "start")[-1]
    assert replacement["warm"] is True and replacement["why"] == f"warm: standby pid {ready['pid']}", replacement
