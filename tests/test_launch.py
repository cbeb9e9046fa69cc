"""`hpct run`: torchrun's command line, bad input refused by name, workers' failures handled.

These use tests/launch_worker.py (no torch: each start takes milliseconds), so they prove the
agent's decisions; tests/test_launch_recovery.py proves the recovery with real training.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from hpct.errors import LaunchError
from hpct.launch.health import STOPPED_NO_SHOW_S
from hpct.ports import free_port_block
from hpct.testing.cluster import Agents
from util import run_cli

pytestmark = pytest.mark.multiprocess

WORKER = str(Path(__file__).with_name("launch_worker.py"))
# The worker imports no torch, so a fork server (hpct run's default) would import it for nothing in
# every agent: 66 s became 207 s for this file on 2 cores.  These tests prove the agent's decisions,
# which do not depend on how a worker starts; the whole file passed under the default (issue 59),
# and tests/test_launch_forkserver.py and the training tests run it.  The stopped no-show keeps the
# default: it stops a worker in its first instants, where a forked one's session once did not exist yet.
SPAWN = ("--no-fork-server",)
# gloo + nccl blocks of 8 slots for up to 4 workers per node, the agent's port and MASTER_PORT
PORTS = 2 * 8 * 4 + 2


def port_base() -> str:
    return str(free_port_block(PORTS))


def run(tmp_path, *args, timeout=60):
    return run_cli("hpct", "run", "--log-dir", str(tmp_path / "logs"), *SPAWN, *args, timeout=timeout, cwd=tmp_path)


@pytest.mark.unit
@pytest.mark.parametrize("args, message", [
    (["--tee", "3"], "hpct run cannot honour torchrun's --tee"),
    (["--local-addr", "x"], "cannot honour torchrun's --local-addr"),
    (["--nnodes", "1:4"], "--nnodes 1:4: hpct run takes one number, not torchrun's MIN:MAX range"),
    (["--nproc-per-node", "zero"], "--nproc-per-node 'zero' is not a positive whole number"),
    (["--nnodes", "2", "--hosts", "a,b,c"], "3"),
    (["--nnodes", "2"], "--nnodes 2 needs the nodes' addresses"),
    (["--standalone", "--nnodes", "2"], "--standalone runs one node, but --nnodes is 2"),
    (["--no-python", "--standby", "1"], "--standby needs a Python script"),
    (["--no-python", "--fork-server"], "--fork-server needs a Python script"),
    (["--stopped-grace", "-2"], "--stopped-grace -2.0 is negative"),
    (["--max-restarts", "-1"], "--max-restarts -1 is negative"),
    (["--nnodes", "2", "--hosts", "198.51.100.1,198.51.100.2"], "no entry of the host list"),
    (["--nnodes", "2", "--hosts", "127.0.0.1,127.0.0.1"], "127.0.0.1"),
])
def test_bad_input_is_refused_by_name(tmp_path, args, message):
    res = run(tmp_path, *args, WORKER, str(tmp_path), "sleep", "0")
    assert res.returncode == LaunchError.exit_code, res.stderr
    assert message in res.stderr, res.stderr
    assert "fix:" in res.stderr
    assert not list(tmp_path.glob("start-*")), "no worker may start"


@pytest.mark.unit
def test_a_missing_script_is_refused(tmp_path):
    res = run(tmp_path, "--standalone", str(tmp_path / "nope.py"))
    assert res.returncode == LaunchError.exit_code
    assert f"the training script {str(tmp_path / 'nope.py')!r} does not exist" in res.stderr


def test_workers_get_torchruns_environment_and_the_json_log(tmp_path):
    res = run(tmp_path, "--nproc-per-node", "2", "--rdzv-id", "job7", "--port-base", port_base(),
              "--master-addr", "10.0.0.9", "--json", str(tmp_path / "ev.jsonl"),
              WORKER, str(tmp_path), "sleep", "0")
    assert res.returncode == 0, res.stderr
    envs = sorted((json.loads(p.read_text()) for p in tmp_path.glob("start-*.json")), key=lambda e: e["RANK"])
    assert [e["RANK"] for e in envs] == ["0", "1"]
    for local, e in enumerate(envs):
        assert e["LOCAL_RANK"] == str(local) and e["WORLD_SIZE"] == "2" and e["LOCAL_WORLD_SIZE"] == "2"
        assert e["GROUP_RANK"] == "0" and e["TORCHELASTIC_RUN_ID"] == "job7" and e["MASTER_ADDR"] == "127.0.0.1"
        assert e["HPCT_USE_ROOTLESS"] == "1" and e["HPCT_GENERATION"] == "0" and e["N_PROC_PER_NODE"] == "2"
        assert int(e["MASTER_PORT"]) == int(e["HPCT_AGENT_PORT"]) + 1
    events = [json.loads(line) for line in (tmp_path / "ev.jsonl").read_text().splitlines()]
    assert all(e["schema_version"] == 1 and e["node"] == 0 and "time" in e for e in events)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "agent" and kinds[-1] == "done" and kinds.count("start") == 2
    assert any(e["event"] == "unused" and e["flag"] == "--master-addr" for e in events)
    assert "--master-addr is not used" in res.stderr
    assert (tmp_path / "logs" / "node0" / "rank0-g0.log").exists()


def test_a_worker_that_cannot_start_ends_the_job_at_once(tmp_path):
    t0 = time.monotonic()
    res = run(tmp_path, "--nproc-per-node", "2", "--max-restarts", "5", "--port-base", port_base(),
              WORKER, str(tmp_path), "fail", "7")
    assert res.returncode == 7, res.stderr
    assert "could not start (exit 7)" in res.stderr
    assert "cannot start, on purpose" in res.stderr          # the worker's last log lines
    assert len(list(tmp_path.glob("start-*.json"))) <= 2      # no retries
    assert time.monotonic() - t0 < 30


def test_a_workers_own_failure_is_retried_then_ends_the_job(tmp_path):
    res = run(tmp_path, "--nproc-per-node", "1", "--max-restarts", "2", "--port-base", port_base(),
              "--json", str(tmp_path / "ev.jsonl"), WORKER, str(tmp_path), "joined-fail", "3")
    assert res.returncode == 3, res.stderr
    assert "rank 0 failed 3 times (--max-restarts 2); last exit 3" in res.stderr
    assert "failing after joining, generation 2" in res.stderr
    starts = [json.loads(p.read_text()) for p in tmp_path.glob("start-*.json")]
    assert sorted(int(e["HPCT_GENERATION"]) for e in starts) == [0, 1, 2]
    assert sorted(e["TORCHELASTIC_RESTART_COUNT"] for e in starts) == ["0", "1", "2"]


def wait_ready(agents: Agents, out: Path, count: int, timeout: float = 30) -> None:
    """Wait for ``count`` workers' OUT/ready-* files (tests/launch_worker.py writes one once set up)."""
    deadline = time.monotonic() + timeout
    while len(list(out.glob("ready-*"))) < count:
        assert time.monotonic() < deadline, agents.output(0)
        time.sleep(0.02)


def test_sigterm_stops_the_workers_gracefully(tmp_path):
    with Agents(tmp_path, [*SPAWN, "--nproc-per-node", "2", "--port-base", port_base(),
                           WORKER, str(tmp_path), "term"]) as agents:
        agents.start()
        wait_ready(agents, tmp_path, 2)
        agents.procs[0].send_signal(signal.SIGTERM)
        assert agents.wait(30) == [128 + signal.SIGTERM]
        assert len(list(tmp_path.glob("term-*"))) == 2, "each worker got SIGTERM and exited by itself"
        assert "stopped by signal 15" in agents.output(0)


def test_two_agents_claiming_one_node_rank_are_refused(tmp_path):
    args = [*SPAWN, "--nnodes", "2", "--hosts", "127.0.0.1,127.0.0.2", "--node-rank", "0", "--port-base", port_base(),
            WORKER, str(tmp_path), "sleep", "20"]
    with Agents(tmp_path, args, nodes=2) as agents:
        agents.start()
        codes = None
        end = time.monotonic() + 30
        while codes is None and time.monotonic() < end:
            done = [p.poll() for p in agents.procs]
            codes = done if any(c is not None for c in done) else None
            time.sleep(0.05)
        loser = next(i for i, c in enumerate(codes) if c is not None)
        assert codes[loser] == LaunchError.exit_code
        out = agents.output(loser)
        assert "node 0's agent cannot listen at 127.0.0.1:" in out and "another agent already holds" in out


def test_agents_of_different_jobs_are_refused(tmp_path):
    base = port_base()
    nodes = [["--node-rank", "0", "--rdzv-id", "alpha"], ["--node-rank", "1", "--rdzv-id", "beta"]]
    with Agents(tmp_path, [*SPAWN, "--nnodes", "2", "--hosts", "127.0.0.1,127.0.0.2", "--port-base", base,
                           WORKER, str(tmp_path), "sleep", "20"], nodes=2, node_args=nodes) as agents:
        agents.start()
        codes = agents.wait(40)
    assert codes == [LaunchError.exit_code] * 2
    text = agents.output(0) + agents.output(1)
    refusal = [line for line in text.splitlines() if "error: refused at start" in line]
    assert len(refusal) == 2, text
    assert all("run_id" in line and "'alpha'" in line and "'beta'" in line for line in refusal), text
    assert "the same --rdzv-id" in text
    assert not list(tmp_path.glob("start-*")), "no worker may start"


def three_agents(tmp_path, nodes=3, **kw) -> Agents:
    hosts = ",".join(f"127.0.0.{i + 1}" for i in range(nodes))
    return Agents(tmp_path, [*SPAWN, "--nnodes", str(nodes), "--hosts", hosts, "--port-base", port_base(),
                             "--node-grace", "1", WORKER, str(tmp_path), "term"], nodes=nodes,
                  node_args=[["--node-rank", str(i)] for i in range(nodes)], **kw)


def test_a_node_that_leaves_is_dropped_by_the_others(tmp_path):
    with three_agents(tmp_path) as agents:
        agents.start()
        for n in range(3):
            agents.wait_event(n, "start", 30)
        agents.procs[2].send_signal(signal.SIGTERM)
        assert agents.procs[2].wait(timeout=30) == 128 + signal.SIGTERM
        for n in (0, 1):         # the first agent to see it drops node 2; the other takes that view
            assert agents.wait_event(n, "view", 30)[-1]["nodes"] == [0, 1]
        lost = agents.events(0, "node-lost") + agents.events(1, "node-lost")
        assert lost and all(e["nodes"] == [2] and "node 2 left" in e["message"] for e in lost)
        assert all(p.poll() is None for p in agents.procs[:2]), "2 of 3 is a majority: the job goes on"


def test_a_side_without_a_majority_stops(tmp_path):
    with three_agents(tmp_path, nodes=2) as agents:
        agents.start()
        for n in range(2):
            agents.wait_event(n, "start", 30)
        agents.procs[1].kill()           # node 1 disappears without a word
        assert agents.procs[0].wait(timeout=30) == LaunchError.exit_code
        out = agents.output(0)
        assert "1 of the last view's 2 nodes remain here, no majority" in out, out
        assert len(list(tmp_path.glob("term-0-*"))) == 1, "node 0's worker was stopped"


def test_a_cancel_of_every_agent_ends_the_job_not_n_node_losses(tmp_path):
    with three_agents(tmp_path) as agents:
        agents.start()
        for n in range(3):
            agents.wait_event(n, "start", 30)
        for p in agents.procs:
            p.send_signal(signal.SIGTERM)
        assert agents.wait(30) == [128 + signal.SIGTERM] * 3
        for n in range(3):
            assert not agents.events(n, "node-lost"), agents.output(n)
            assert "stopped by signal 15" in agents.events(n, "end")[0]["message"]


def test_an_unused_spare_node_waits_idle_and_ends_with_the_job(tmp_path):
    hosts = "127.0.0.1,127.0.0.2,127.0.0.3"
    with Agents(tmp_path, [*SPAWN, "--nnodes", "2", "--spare-nodes", "1", "--hosts", hosts, "--port-base", port_base(),
                           WORKER, str(tmp_path), "sleep", "3"], nodes=3,
                node_args=[["--node-rank", str(i)] for i in range(3)]) as agents:
        agents.start()
        assert agents.wait(90) == [0, 0, 0], agents.output(2)
    idle = agents.events(2, "idle")
    assert idle and idle[0]["nodes"] == [0, 1], agents.output(2)
    assert not agents.events(2, "start"), "a spare starts no worker while the view is whole"
    assert "this node was not needed" in agents.events(2, "done")[0]["message"]
    assert sorted(p.name.split("-")[1] for p in tmp_path.glob("start-*")) == ["0", "1"]


def test_a_node_dropped_while_alive_stops_its_workers_and_is_taken_back(tmp_path):
    """Node 2's agent is paused (SIGSTOP) past the grace: the others drop it.  Resumed, it learns it
    is out of the view, stops its worker and says hello again; node 0 grows the view back and
    node 2 starts a worker at the new generation."""
    with three_agents(tmp_path) as agents:
        agents.start()
        for n in range(3):
            agents.wait_event(n, "start", 30)
        agents.procs[2].send_signal(signal.SIGSTOP)
        agents.wait_event(0, "view", 30, where=lambda e: e["nodes"] == [0, 1])
        agents.procs[2].send_signal(signal.SIGCONT)
        agents.wait_event(2, "dropped", 30)
        back = agents.wait_event(0, "view", 30, where=lambda e: e["nodes"] == [0, 1, 2])[0]
        agents.wait_event(2, "admitted", 30)
        start = agents.wait_event(2, "start", 30, count=2)[-1]
        assert start["generation"] >= back["generation"] and start["rank"] == 2
        assert len(list(tmp_path.glob("term-2-*"))) == 1, "the dropped node's worker was stopped"
        assert all(p.poll() is None for p in agents.procs), "nobody ended the job"


def test_a_newcomer_that_cannot_join_before_the_job_ends_is_stopped_not_retried(tmp_path):
    """Node 2 of 3 is lost; the spare (node 3) takes its slot, but its worker (which never tells the
    agent it joined) is still waiting when the members finish: the spare's agent stops it and ends
    with 0 instead of counting a failed start."""
    hosts = ",".join(f"127.0.0.{i + 1}" for i in range(4))
    with Agents(tmp_path, [*SPAWN, "--nnodes", "3", "--spare-nodes", "1", "--hosts", hosts, "--port-base", port_base(),
                           "--node-grace", "1", WORKER, str(tmp_path), "sleep", "5"], nodes=4,
                node_args=[["--node-rank", str(i)] for i in range(4)]) as agents:
        agents.start()
        for n in range(3):
            agents.wait_event(n, "start", 30)
        agents.wait_event(3, "idle", 30)
        agents.procs[2].kill()
        agents.wait_event(3, "admitted", 30)
        codes = [agents.procs[n].wait(timeout=60) for n in (0, 1, 3)]
        assert codes == [0, 0, 0], agents.output(3)
    [stopped] = agents.events(3, "exit")
    assert stopped["message"].endswith("stopped: the job's other nodes finished before it joined"), stopped
    assert not agents.events(3, "worker-lost"), agents.output(3)


def kill_rank_1_before_a_finish(tmp_path, nproc: int, mode: str) -> tuple[Agents, dict[int, str]]:
    """tests/launch_worker.py's ``mode`` on one node (rank 0 exits 0 after 2-3 s), rank 1 SIGKILLed
    once all started; the agent must end with 0 within 30 s.  Returns the stopped ranks' messages."""
    with Agents(tmp_path, [*SPAWN, "--nproc-per-node", str(nproc), "--port-base", port_base(), WORKER, str(tmp_path),
                           mode, str(nproc)]) as agents:
        agents.start()
        agents.wait_event(0, "start", 30, count=nproc)
        os.kill(agents.worker_pid(0, 1), signal.SIGKILL)
        assert agents.wait(30) == [0], agents.output(0)
    return agents, {e["rank"]: e["message"] for e in agents.events(0, "exit") if "stopped" in e["message"]}


def test_a_replacement_is_stopped_when_a_worker_of_its_world_has_finished(tmp_path):
    """A worker killed after the job's last collective: its peer on the same node finishes, so the
    replacement's world can never form (a finished rank never comes to re-form).  The agent stops it
    and ends with 0 instead of waiting for it until HPCT_CONNECT_TIMEOUT.  (Found by the launch
    benchmark: the kill landed after the last step and the agent ran on for 176 s.)"""
    agents, stopped = kill_rank_1_before_a_finish(tmp_path, 2, "finish-or-wait")
    assert sorted(stopped) == [1], agents.output(0)
    assert stopped[1].endswith("stopped: a worker of this node finished before it joined"), stopped
    assert [e["generation"] for e in agents.events(0, "start")] == [0, 0, 1]


def test_a_survivor_re_forming_when_a_worker_of_its_node_finished_is_stopped(tmp_path):
    """A worker killed in the job's final barrier: the barrier can let some ranks through (they
    exit 0) while others fail it and re-form.  A finished rank never comes to re-form, so their
    new world could never form: before, they waited for it until HPCT_CONNECT_TIMEOUT (300 s) and
    then failed the job.  Now the agent stops them, as it stops the replacement, and ends with 0."""
    agents, stopped = kill_rank_1_before_a_finish(tmp_path, 3, "finish-or-re-form")
    assert sorted(stopped) == [1, 2], agents.output(0)
    assert stopped[1].endswith("stopped: a worker of this node finished before it joined"), stopped
    assert stopped[2].endswith("stopped: a worker of this node finished while it re-formed"), stopped
    assert [e["rank"] for e in agents.events(0, "exit") if e["message"].endswith("finished")] == [0]


@pytest.mark.parametrize("hang", ["stopped", "deadlocked"])
def test_a_worker_that_never_comes_to_re_form_is_killed_at_once_if_stopped_else_past_its_op_timeout(tmp_path, hang):
    """Rank 0's world failed and it re-forms; rank 1 never comes.  A worker stopped by a signal runs
    nothing until continued: its agent kills it STOPPED_NO_SHOW_S after it saw it stopped, not an op
    timeout (60 s here) later; a worker that runs but never asks (deadlocked) keeps its op timeout
    (2 s), within which a busy worker would still come.  The loss path replaces both."""
    op_timeout = 60 if hang == "stopped" else 2
    # --stopped-grace 0: the stopped worker is left to this path (a grace takes it sooner, view or not).
    spawn = SPAWN if hang == "deadlocked" else ()
    with Agents(tmp_path, [*spawn, "--nproc-per-node", "2", "--stopped-grace", "0", "--port-base", port_base(),
                           WORKER, str(tmp_path), "re-form-or-hang", str(op_timeout)]) as agents:
        agents.start()
        wait_ready(agents, tmp_path, 1)
        pid = agents.worker_pid(0, 1)
        if hang == "stopped":
            os.kill(pid, signal.SIGSTOP)
        (tmp_path / "go").write_text("")
        try:
            assert agents.wait(40) == [0], agents.output(0)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    [no_show] = agents.events(0, "no-show")
    [moved] = [e for e in agents.events(0, "view") if "re-form asked by a worker" in e["message"]]
    assert (no_show["rank"], no_show["pid"], no_show["stopped"]) == (1, pid, hang == "stopped"), no_show
    waited = no_show["t"] - moved["t"]
    if hang == "stopped":
        assert STOPPED_NO_SHOW_S <= waited < 10, no_show
        assert "stopped by a signal for" in no_show["message"], no_show
    else:
        assert op_timeout <= waited < op_timeout + 5, no_show
        assert "past its op timeout (2 s)" in no_show["message"], no_show
    [lost] = [e for e in agents.events(0, "worker-lost") if e["pid"] == pid]
    assert lost["code"] == -signal.SIGKILL
    assert [e["generation"] for e in agents.events(0, "start") if e["rank"] == 1] == [0, 2], \
        "replaced at the move its loss made"


def test_an_agent_restarted_within_the_grace_restarts_its_workers_as_replacements(tmp_path):
    """Node 2's agent and worker die and the agent is started again before the others drop the node:
    its peers know its agent said hello before, so it moves the view one generation on and starts
    its worker as a replacement there (a generation-0 worker would meet nobody)."""
    with three_agents(tmp_path) as agents:
        agents.start()
        starts = [agents.wait_event(n, "start", 30)[0] for n in range(3)]
        agents.procs[2].kill()
        agents.procs[2].wait(timeout=10)
        os.kill(starts[2]["pid"], signal.SIGKILL)
        agents.restart(2)
        again = agents.wait_event(2, "start", 30, count=2)[-1]
        assert again["generation"] >= 1 and again["rank"] == 2, agents.output(2)
        assert "node 2's agent came back" in agents.output(2)
        for n in (0, 1):
            agents.wait_event(n, "view", 30, where=lambda e: e["generation"] >= 1 and e["nodes"] == [0, 1, 2])
            assert not agents.events(n, "start")[1:], "only node 2's worker restarted"
