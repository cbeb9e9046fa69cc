"""`hpct run` with real training (examples/ddp.py): a killed worker is replaced and nobody else
restarts (checked by pid), with and without a warm standby, on one node and on two; a lost node
is dropped and the survivors shrink.  Final parameters are compared with the same script run
without faults by stock torchrun on Gloo: a replacement must change nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest

from hpct.launch.membership import HEARTBEAT_S, REFUSED_S
from hpct.ports import free_port_block
from hpct.testing.cluster import Agents, progress, records
from hpct.testing.netns import netns_network, unavailable_reason
from launch_jobs import (EXAMPLE, FSDP2, LIMIT_S, LONG_STEPS, STEPS, check_replaced, kill_once_warm, stock_digest,
                         wait_progress)
from util import run_rank_script

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = pytest.mark.serial


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_killed_worker_is_replaced_from_a_standby_and_nobody_else_restarts(tmp_path):
    # --no-fork-server's warm path; the fork server's (the default) runs in the two-node, FSDP2, spare
    # and Slurm tests.
    expect = stock_digest(tmp_path, 3, steps=LONG_STEPS)
    out = tmp_path / "out"
    out.mkdir()
    args = ["--nproc-per-node", "3", "--no-fork-server", "--standby", "1",
            "--port-base", str(free_port_block(2 * 8 * 3 + 2)),
            EXAMPLE, *LONG_STEPS, "--out", str(out)]
    with Agents(tmp_path, args) as agents:
        agents.start()
        kill_once_warm(agents, out, 0, 1)
        assert agents.wait(LIMIT_S) == [0], agents.output(0)
    check_replaced(agents, out, 1, 3, expect)
    replacement = agents.events(0, "start")[-1]
    assert replacement["rank"] == 1 and replacement["warm"] is True
    assert replacement["pid"] in {e["pid"] for e in agents.events(0, "standby")}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_worker_stopped_past_the_stopped_grace_is_replaced_and_nobody_else_restarts(tmp_path):
    """Rank 1 is SIGSTOPped and never continued (a hang that never ends), and the job keeps torch's op
    timeout (30 minutes): its agent sees it stopped and kills it --stopped-grace (2 s) later, a
    standby takes its rank, the others recover in their processes, and the parameters are the
    fault-free run's.  Before, its peers waited for it until their op timeout and their re-form (the
    soak's long stops cost 11-14 s so); before that, until HPCT_CONNECT_TIMEOUT, over and over.
    The no-show path (--stopped-grace 0) is tests/test_launch.py's."""
    expect = stock_digest(tmp_path, 3, steps=LONG_STEPS)
    out = tmp_path / "out"
    out.mkdir()
    args = ["--nproc-per-node", "3", "--no-fork-server", "--standby", "1", "--stopped-grace", "2",
            "--port-base", str(free_port_block(2 * 8 * 3 + 2)), EXAMPLE, *LONG_STEPS, "--out", str(out)]
    with Agents(tmp_path, args) as agents:
        agents.start()
        pid = kill_once_warm(agents, out, 0, 1, sig=signal.SIGSTOP)
        stopped_at = time.time()
        try:
            assert agents.wait(LIMIT_S) == [0], agents.output(0)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    check_replaced(agents, out, 1, 3, expect)
    [taken] = agents.events(0, "stopped")
    assert (taken["rank"], taken["pid"]) == (1, pid) and "--stopped-grace 2" in taken["message"], taken
    waited = datetime.fromisoformat(taken["time"]).timestamp() - stopped_at
    assert 2 <= waited < 4, taken
    assert not agents.events(0, "no-show"), agents.output(0)
    assert agents.events(0, "start")[-1]["warm"] is True


@pytest.mark.multiprocess
def test_a_worker_killed_after_the_last_step_is_replaced_and_the_job_ends_clean(tmp_path):
    """Rank 1 is killed in its sleep after the last step, before the job's final barrier.  Before:
    the others' final barrier failed outside the recovery loop, they exited 1 and a job that had
    taken every step ended failed.  Now leaving is part of the loop: they recover, the replacement
    takes the final state, and all leave with the fault-free digest."""
    expect = stock_digest(tmp_path, 3, steps=LONG_STEPS)
    out = tmp_path / "out"
    out.mkdir()
    last = int(LONG_STEPS[1])
    args = ["--nproc-per-node", "3", "--port-base", str(free_port_block(2 * 8 * 3 + 2)),
            EXAMPLE, *LONG_STEPS, "--out", str(out)]
    with Agents(tmp_path, args) as agents:
        agents.start()
        wait_progress(agents, out, 1, last, poll=0.005)     # then it sleeps 0.15 s: poll finer than that
        os.kill(agents.worker_pid(0, 1), signal.SIGKILL)
        assert agents.wait(LIMIT_S) == [0], agents.output(0)
    recs = check_replaced(agents, out, 1, 3, expect)
    assert {r["recoveries"][0]["at_step"] for r in recs if r["generation"] == 0} == {last}


@pytest.mark.multihost
@pytest.mark.slow
def test_two_nodes_replace_a_killed_worker(tmp_path):
    if (why := unavailable_reason()) is not None:
        pytest.skip(why)
    expect = stock_digest(tmp_path, 4)
    out = tmp_path / "out"
    out.mkdir()
    with netns_network(2, name_prefix="hpct-run", subnet="10.236.0") as ns:
        hosts = ",".join(n.address for n in ns)
        args = ["--nnodes", "2", "--nproc-per-node", "2", "--hosts", hosts, "--rdzv-id", "two",
                EXAMPLE, *STEPS, "--out", str(out)]
        with Agents(tmp_path, args, nodes=2, namespaces=ns) as agents:
            agents.start()
            wait_progress(agents, out, 3, 10)
            os.kill(agents.worker_pid(1, 3), signal.SIGKILL)
            assert agents.wait(LIMIT_S) == [0, 0], agents.output(0) + agents.output(1)
        check_replaced(agents, out, 3, 4, expect)
        assert agents.events(0, "view")[-1]["generation"] == 1, "node 0 learnt the new generation"


JOIN_SCRIPT = """
import importlib.util, json, sys
import torch
import torch.distributed as dist
import hpct.distributed as hd
spec = importlib.util.spec_from_file_location("fsdp2", sys.argv[1])
fsdp2 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fsdp2)
hd.init_process_group(timeout=60)
rank = dist.get_rank()
mesh, model, opt = fsdp2.build(2)
got = []
for case in sys.argv[2:]:
    steps, _, older = case.partition("/")
    now = fsdp2.shards(opt)
    before = {"params": [p + 1.0 for p in now["params"]], "momentum": now["momentum"]}
    kept = {"now": now, "before": None if older == "none" else before}
    try:
        step = fsdp2.join(mesh, opt, None if rank == 3 else kept, int(steps.split(",")[rank]))
        local = opt.param_groups[0]["params"][0].to_local()
        taken = "now" if torch.equal(local, now["params"][0]) else "before" if torch.equal(
            local, before["params"][0]) else "neither"
        got.append([step, taken])
    except SystemExit as err:
        got.append(str(err))
    with torch.no_grad():      # every case starts from the same shards
        for p, local in zip(opt.param_groups[0]["params"], now["params"]):
            p.to_local().copy_(local)
print("JOINED " + json.dumps(got), flush=True)
dist.barrier()
hd.shutdown_all()
"""


@pytest.mark.multiprocess
def test_fsdp2_join_takes_the_furthest_replica_and_heals_a_torn_step(tmp_path):
    """examples/fsdp2.py's join after rank 3 was lost, with the steps the survivors' states reached.
    Mesh replicate x shard: replicate groups {0, 2} and {1, 3}.  A peer lost at a collective's end
    lets some ranks step and not others: within a group the furthest copy wins (nobody steps
    twice); when the two groups' shards are one step apart (torn), the group ahead takes the copy
    from before its step, so the model is whole again.  Without that copy the job must end with
    that message rather than train on a torn model."""
    cases = ["6,6,6,0", "5,6,6,0", "6,5,6,0", "6,5,6,0/none"]
    codes, outputs = run_rank_script(tmp_path, JOIN_SCRIPT, [FSDP2, *cases], 4, 120)
    assert codes == {r: 0 for r in range(4)}, outputs
    torn = ("fsdp2.py: a lost rank tore a step: some shards are at step 6 and others at 5, and no "
            "replica holds the older copy; resume from a checkpoint")
    for rank, out in enumerate(outputs):
        [line] = [ln for ln in out.splitlines() if ln.startswith("JOINED ")]
        healed = [5, "before" if rank in (0, 2) else "now"]
        assert json.loads(line[len("JOINED "):]) == [[6, "now"], [6, "now"], healed, torn], out


@pytest.mark.multihost
@pytest.mark.slow
def test_an_fsdp2_hsdp_job_replaces_a_killed_worker_from_its_replicas_shards(tmp_path):
    """examples/fsdp2.py on 2 nodes x 2 (mesh replicate 2 x shard 2): rank 3 on node 1 is killed; its
    replacement, forked from node 1's fork server, takes its shards and momentum from rank 1 on
    node 0, its replica.  The run ends with the full parameters of a fault-free stock run, bit for bit."""
    if (why := unavailable_reason()) is not None:
        pytest.skip(why)
    expect = stock_digest(tmp_path, 4, FSDP2, LONG_STEPS)
    out = tmp_path / "out"
    out.mkdir()
    with netns_network(2, name_prefix="hpct-run", subnet="10.236.0") as ns:
        args = ["--nnodes", "2", "--nproc-per-node", "2",
                "--hosts", ",".join(n.address for n in ns), FSDP2, *LONG_STEPS, "--out", str(out)]
        with Agents(tmp_path, args, nodes=2, namespaces=ns) as agents:
            agents.start()
            kill_once_warm(agents, out, 1, 3, warm="fork-server")
            assert agents.wait(LIMIT_S) == [0, 0], agents.output(0) + agents.output(1)
        check_replaced(agents, out, 3, 4, expect)
        replacement = [e for e in agents.events(1, "start") if e["generation"] > 0]
        assert [e["why"].startswith("forked: from the fork server") for e in replacement] == [True], replacement


@contextlib.contextmanager
def three_nodes(tmp_path: Path, grace: float, script: list[str], spares: int = 0, flags: tuple[str, ...] = ()):
    """Three agents (and ``spares`` spare nodes' agents) in network namespaces, one worker each,
    running examples/ddp.py into tmp_path/out."""
    if (why := unavailable_reason()) is not None:
        pytest.skip(why)
    out = tmp_path / "out"
    out.mkdir()
    with netns_network(3 + spares, name_prefix="hpct-run", subnet="10.236.0") as ns:
        args = [*flags, "--nnodes", "3", "--spare-nodes", str(spares), "--nproc-per-node", "1",
                "--hosts", ",".join(n.address for n in ns), "--node-grace", str(grace),
                EXAMPLE, *script, "--out", str(out)]
        with Agents(tmp_path, args, nodes=3 + spares, namespaces=ns,
                    env={"HPCT_CONNECT_TIMEOUT": "30"}) as agents:
            agents.start()
            yield agents, out


def lose_node(agents: Agents, node: int) -> None:
    """The node goes: its agent, then its worker."""
    pid = agents.worker_pid(node, node)
    agents.procs[node].kill()
    agents.procs[node].wait(timeout=10)
    os.kill(pid, signal.SIGKILL)


@pytest.mark.multihost
@pytest.mark.slow
def test_a_lost_node_is_dropped_the_survivors_shrink_and_a_worker_lost_then_is_replaced_at_its_plan_place(tmp_path):
    """Node 1 of 3 is lost: the agents drop it and the survivors shrink in their processes to places
    [0, 2] (node 2's worker is now rank 1 at place 2).  Then node 2's worker is killed: its agent
    starts a replacement at rank 1 with HPCT_PLAN_PLACES=0,2, so it listens at place 2's address
    where rank 0 looks for it.  (The shrink alone, run to the end, was a test of its own: the
    shrunk world here trains, then finishes after the replacement.)  The grace is 5 s: node 1 is
    dropped for refusing its agent port well within it, and the view must not take it back."""
    with three_nodes(tmp_path, 5, ["--steps", "60", "--step-time", "0.03"]) as (agents, out):
        wait_progress(agents, out, 0, 5)
        first = {n: agents.worker_pid(n, n) for n in (0, 2)}
        lose_node(agents, 1)
        agents.wait_event(2, "view", 30, where=lambda e: e["nodes"] == [0, 2])
        target, end = progress(out, 0) + 3, time.monotonic() + 60    # the shrunk world trains
        while progress(out, 0) < target:
            assert time.monotonic() < end and agents.procs[0].poll() is None, agents.output(0)[-3000:]
            time.sleep(0.05)
        os.kill(first[2], signal.SIGKILL)
        codes = [agents.procs[n].wait(timeout=LIMIT_S) for n in (0, 2)]
        assert codes == [0, 0], agents.output(0) + agents.output(2)
    recs = records(out)
    final = {r["rank"]: r for r in recs if r["pid"] != first.get(1)}
    assert sorted(final) == [0, 1], recs
    assert final[0]["pid"] == first[0], "node 0's worker restarted"
    assert final[1]["pid"] != first[2] and final[1]["generation"] >= 2, final[1]
    assert final[0]["digest"] == final[1]["digest"]
    replaced = [e for e in agents.events(2, "start") if e["generation"] > 0]
    assert len(replaced) == 1 and replaced[0]["rank"] == 1 and replaced[0]["place"] == 2, agents.output(2)
    assert final[1]["place"] == 2          # examples/ddp.py names its step log and progress by place
    # No survivor restarted for the lost node: node 0's worker re-formed in its process (after a
    # failed step, or at a step boundary when node 1's worker outlived its agent by a step).
    assert final[0]["generation"] == 0 and (final[0]["recoveries"] or final[0]["grows"]), final[0]
    assert not [e for e in agents.events(0, "start") if e["generation"] > 0], "node 0 restarted a worker"
    lost = [e for n in (0, 2) for e in agents.events(n, "node-lost")]
    assert lost and all(e["nodes"] == [1] == e["refused"] for e in lost), agents.output(0) + agents.output(2)
    for n in (0, 2):                 # one agent noticed first; the other took its view
        views = [e["nodes"] for e in agents.events(n, "view")]
        assert views[-1] == [0, 2] and [0, 1, 2] not in views[1:], agents.output(n)


@pytest.mark.multihost
@pytest.mark.slow
@pytest.mark.parametrize("start", ["spawned", "forked"])
def test_a_spare_node_takes_a_lost_nodes_ranks_and_the_run_is_bit_identical(tmp_path, start):
    """Node 1 of 3 is lost; the spare (node 3) takes its slot: the world keeps 3 ranks, the
    spare's worker is rank 1 at place 3 and receives the state, and the parameters equal a
    fault-free stock run of 3 ranks.  The grace is 10 s, but node 1's host refuses its agent port
    (nothing listens there any more), so it is dropped after REFUSED_S: before, a killed agent
    cost its node the whole grace.  Forked (the default), every worker is forked, the spare keeps no
    standby, and node 1's server outlives its killed agent until its worker is gone."""
    expect = stock_digest(tmp_path, 3)
    flags = ("--no-fork-server",) if start == "spawned" else ()
    with three_nodes(tmp_path, 10, STEPS, spares=1, flags=flags) as (agents, out):
        agents.wait_event(3, "idle", 60)
        wait_progress(agents, out, 0, 10)
        first = {n: agents.worker_pid(n, n) for n in (0, 2)}
        killed = time.time()
        lose_node(agents, 1)
        codes = [agents.procs[n].wait(timeout=LIMIT_S) for n in (0, 2, 3)]
        assert codes == [0, 0, 0], agents.output(0) + agents.output(3)
    final = {r["rank"]: r for r in records(out) if r["pid"] not in (first.get(1),)}
    assert sorted(final) == [0, 1, 2], final
    assert [final[0]["pid"], final[2]["pid"]] == [first[0], first[2]], "a survivor restarted"
    assert final[1]["generation"] >= 1 and final[1]["pid"] == agents.worker_pid(3, 1)
    assert final[1]["place"] == 3 and agents.events(3, "start")[-1]["place"] == 3
    assert {r["digest"] for r in final.values()} == {expect}
    for n in (0, 2, 3):
        assert agents.events(n, "view")[-1]["nodes"] == [0, 3, 2], agents.output(n)
    assert agents.events(3, "admitted"), agents.output(3)
    [lost] = [e for n in (0, 2) for e in agents.events(n, "node-lost")][:1]
    assert lost["refused"] == [1] and "refused every ask for 1.5 s" in lost["message"], lost
    dropped = datetime.fromisoformat(lost["time"]).timestamp() - killed
    assert REFUSED_S <= dropped < REFUSED_S + 2 * HEARTBEAT_S + 1.5, (dropped, lost)
    if start == "forked":
        whys = [e["why"] for n in (0, 2, 3) for e in agents.events(n, "start")]
        assert len(whys) == 3 and all(w.startswith("forked: from the fork server") for w in whys), whys
        assert not agents.events(3, "standby"), "an idle node with a fork server keeps no standby"


@pytest.mark.multihost
@pytest.mark.slow
@pytest.mark.parametrize("newcomer", ["joins", "lost"])
def test_a_node_that_comes_back_joins_by_grow(tmp_path, newcomer):
    """Node 2 of 3 is lost and the survivors shrink to 2 ranks; its agent, started again, is
    idle and the view takes it back: the members call hd.grow() at a step boundary
    (membership_changed()), the node's new worker joins as rank 2 and receives the state.
    ``lost``: that worker is stopped at its start, so the members' grow connects a world that
    waits for it; after --stopped-grace its agent kills it and starts another at the next
    generation.  Before: grow() connected without a view watch, the second worker refused the
    members' older generation, and they raised and exited 1 (the job ended).  Now the grow's
    connect follows the view, as recover()'s does."""
    with three_nodes(tmp_path, 1, ["--steps", "80", "--step-time", "0.03"]) as (agents, out):
        wait_progress(agents, out, 0, 5)
        first = {n: agents.worker_pid(n, n) for n in (0, 1)}
        lose_node(agents, 2)
        agents.wait_event(0, "view", 30, where=lambda e: e["nodes"] == [0, 1])
        agents.restart(2)
        stopped = None
        if newcomer == "lost":
            stopped = agents.wait_event(2, "start", 60, where=lambda e: e["generation"] > 0)[0]["pid"]
            os.kill(stopped, signal.SIGSTOP)
            agents.wait_event(2, "stopped", 30, where=lambda e: e["pid"] == stopped)
        else:
            agents.wait_event(0, "view", 60, where=lambda e: e["nodes"] == [0, 1, 2])
        codes = [agents.procs[n].wait(timeout=LIMIT_S) for n in (0, 1, 2)]
        assert codes == [0, 0, 0], agents.output(0) + agents.output(2)
    recs = records(out)
    final = {r["rank"]: r for r in recs if r["pid"] in first.values() or r["generation"] > 0}
    assert sorted(final) == [0, 1, 2], recs
    assert [final[0]["pid"], final[1]["pid"]] == [first[0], first[1]], "a member restarted"
    assert final[2]["pid"] != stopped
    assert all(final[r]["grows"] and final[r]["grows"][-1]["world_size"] == 3 for r in (0, 1)), final
    assert len({r["digest"] for r in final.values()}) == 1
    assert agents.events(2, "idle") and agents.events(2, "admitted"), agents.output(2)


OVERTAKEN_STEPS = 120


@contextlib.contextmanager
def overtaken_job(tmp_path: Path, *worker_args: str):
    """tests/overtaken_worker.py (STALL_GENERATION [HOLD_RANK] = ``worker_args``) as 3 workers of
    one node, 5 steps in, when rank 2 has just been SIGKILLed; yields (agents, out)."""
    out = tmp_path / "out"
    out.mkdir()
    args = ["--nproc-per-node", "3", "--max-restarts", "0", "--port-base", str(free_port_block(2 * 8 * 3 + 2)),
            str(Path(__file__).with_name("overtaken_worker.py")), str(out), str(OVERTAKEN_STEPS), *worker_args]
    with Agents(tmp_path, args, env={"HPCT_CONNECT_TIMEOUT": "60"}) as agents:
        agents.start()
        wait_progress(agents, out, 0, 5)
        os.kill(agents.worker_pid(0, 2), signal.SIGKILL)
        yield agents, out


def overtaken_records(out: Path) -> dict[int, dict]:
    """Each rank's record of an overtaken_job; every rank finished with the fault-free total."""
    recs = {r["rank"]: r for r in records(out)}
    assert sorted(recs) == [0, 1, 2]
    expect = float(3 * sum(range(1, OVERTAKEN_STEPS + 1)))
    assert {r["total"] for r in recs.values()} == {expect}
    return recs


@pytest.mark.multiprocess
def test_a_recovery_overtaken_by_a_newer_view_meets_the_others_there(tmp_path):
    """The replacement is lost while the survivors connect the world that waits for it: the agent
    moves the view on and starts another.  Before: the survivors' recover() kept connecting the
    older world until its deadline (or a peer's newer generation refused it) and raised
    RendezvousError, the worker exited 1 and the job ended (the goodput soak lost two nodes 2.7 s
    apart this way).  Now the connect gives way to the newer view and everyone meets there."""
    with overtaken_job(tmp_path, "1") as (agents, out):
        stalled = wait_files(agents, out, "stalled-*", 1)
        wait_files(agents, out, "recovering-*", 2)
        time.sleep(1.0)            # the survivors are connecting generation 1, waiting for rank 2
        os.kill(int(stalled[0].name.split("-")[1]), signal.SIGKILL)
        assert agents.wait(LIMIT_S) == [0], agents.output(0)
    recs = overtaken_records(out)
    first = {e["rank"]: e["pid"] for e in agents.events(0, "start") if e["generation"] == 0}
    for rank in (0, 1):            # the very processes of generation 0, recovered once, into generation 2
        assert recs[rank]["pid"] == first[rank] and recs[rank]["met"] == [2], recs[rank]
    assert recs[2]["generation"] == 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("replacement", ["connects", "stalls"])
def test_a_replacement_overtaken_before_it_joined_follows_or_restarts_in_the_newer_view(tmp_path, replacement):
    """Rank 2 is lost; while its replacement connects generation 1 (or stalls before connecting),
    the survivor it waits for (rank 1) is lost too and the view moves to generation 2.  Before:
    the agent stopped the unjoined replacement and counted that as one more lost worker, moving
    the view again, which made the next replacement stale in turn (the goodput soak's generations
    climbed to 39 this way, and a first connect refused by a newer peer ended the job).  Now a
    replacement that connects follows the view itself (the same process joins generation 2), and
    one that stalls is stopped and started again in generation 2, a `stale` event, not a fault."""
    stall = "1" if replacement == "stalls" else "99"
    with overtaken_job(tmp_path, stall, "1") as (agents, out):
        holding = wait_files(agents, out, "holding-*", 1)
        late = wait_files(agents, out, "stalled-*" if replacement == "stalls" else "connecting-1-*", 1)
        time.sleep(1.0)            # rank 0 and the replacement connect generation 1, waiting for rank 1
        os.kill(int(holding[0].name.split("-")[1]), signal.SIGKILL)
        assert agents.wait(LIMIT_S) == [0], agents.output(0)
    recs = overtaken_records(out)
    starts = agents.events(0, "start")
    assert max(e["generation"] for e in starts) == 2, starts       # one generation per lost worker
    first = next(e["pid"] for e in starts if e["generation"] == 0 and e["rank"] == 0)
    assert recs[0]["pid"] == first and recs[0]["met"] == [2], recs[0]
    assert recs[1]["generation"] == 2 and recs[2]["formed"] == 2, recs
    late_pid = int(late[0].name.rsplit("-", 1)[1])
    if replacement == "connects":
        assert recs[2]["pid"] == late_pid and recs[2]["generation"] == 1, recs[2]
        assert agents.events(0, "stale") == []
    else:
        assert [(e["pid"], e["generation"]) for e in agents.events(0, "stale")] == [(late_pid, 1)]
        assert recs[2]["generation"] == 2


@pytest.mark.multiprocess
def test_a_peer_that_dies_in_the_connect_before_its_agent_knows_is_followed_not_fatal(tmp_path):
    """Rank 2 is lost and its replacement stalls: ranks 0 and 1 connect generation 1, rank 1's
    count given to rank 0, which waits for rank 2's.  Then rank 1 dies while its agent is stopped:
    the socket closes at once, and an agent under load learns of the death later (the CI goodput
    soak lost its job this way, a kill 0.3 s after another).  Before: rank 0's connect failed as
    "did not form within the connect deadline", the agent's view had not moved, rank 0 raised and
    exited 1, and the job ended.  Now rank 0 asks its agent for the world after generation 1,
    as after a failed step, and meets the others in generation 2 with its state."""
    with overtaken_job(tmp_path, "1") as (agents, out):
        wait_files(agents, out, "stalled-*", 1)
        wait_files(agents, out, "recovering-*", 2)
        time.sleep(1.0)            # ranks 0 and 1 connect generation 1, rank 0 waiting for rank 2
        victim, agent = agents.worker_pid(0, 1), agents.procs[0].pid
        os.kill(agent, signal.SIGSTOP)
        try:
            os.kill(victim, signal.SIGKILL)
            time.sleep(2.5)        # rank 0's connect failed; a view watch's peek (1 s) went unanswered
        finally:
            os.kill(agent, signal.SIGCONT)
        assert agents.wait(LIMIT_S) == [0], agents.output(0)
    recs = overtaken_records(out)
    first = next(e["pid"] for e in agents.events(0, "start") if e["generation"] == 0 and e["rank"] == 0)
    assert recs[0]["pid"] == first and recs[0]["met"] == [2], recs[0]
    assert recs[1]["generation"] == 2 and recs[2]["generation"] == 2, recs


def wait_files(agents: Agents, out: Path, pattern: str, count: int, timeout: float = 120) -> list[Path]:
    end = time.monotonic() + timeout
    while len(found := sorted(out.glob(pattern))) < count:
        assert time.monotonic() < end, f"no {count} {pattern} within {timeout:g} s:\n{agents.output(0)[-3000:]}"
        assert all(p.poll() is None for p in agents.procs), agents.output(0)[-3000:]
        time.sleep(0.05)
    return found
