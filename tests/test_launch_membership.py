"""The agents' view rules in process, no network: a spare takes a lost node's slot, the
majority counts only the last view's survivors, equal-generation conflicts resolve the same way
on both sides, a dropped node comes back only after it is heard again, idle agents follow, and a
worker that never comes to re-form after a move that broke its world is taken for hung.
Two or three agents here are an agent's real parts (tests/agent_parts.py) whose pushes are
delivered by hand (the wire and the timing are tests/test_launch_recovery.py's)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest

from hpct import wire
from hpct.launch import membership
from hpct.launch.health import STOPPED_NO_SHOW_S, no_shows, note_stopped, stopped_past
from hpct.launch.pool import STANDBY_DEFER_S, standbys_due
from hpct.launch.procs import is_stopped

from agent_parts import Agent

pytestmark = pytest.mark.unit


def test_the_lowest_idle_spare_takes_a_lost_nodes_slot_and_its_ranks():
    a = Agent(0, spares=2)
    a.view.drop([1], [])
    assert (a.view.generation, a.view.nodes) == (1, [0, 3, 2]) and a.view.end is None
    assert a.world() == [0, 1, 6, 7, 4, 5], "ranks 2-3 now live at node 3's places"
    lost = [f for e, f in a.events.seen if e == "node-lost"][0]
    assert lost["message"] == "node 1 silent for 5 s; node 3 takes its slot"


def test_without_an_idle_node_the_view_shrinks_and_a_silent_spare_is_not_idle():
    a = Agent(0)
    a.view.seen[3] = time.monotonic() - 60          # the spare stopped pinging
    a.view.drop([2], [])
    assert a.view.nodes == [0, 1] and a.world() == [0, 1, 2, 3]


def test_a_spare_does_not_make_a_majority():
    a = Agent(0, spares=2)
    a.view.drop([1, 2], [])
    assert a.view.nodes == [0, 3, 4], "the spares filled the slots"
    assert a.view.end is not None and "1 of the last view's 3 nodes remain here, no majority" in a.view.end.message


def test_equal_generations_with_different_nodes_resolve_alike_on_both_sides():
    a, b = Agent(0, nnodes=4, spares=1), Agent(3, nnodes=4, spares=1)
    a.view.drop([2], [])                           # a: [0, 1, 4, 3]
    b.view.drop([1], [])                           # b: [0, 4, 2, 3]
    va, vb = (a.view.generation, list(a.view.nodes)), (b.view.generation, list(b.view.nodes))
    assert va[0] == vb[0] == 1 and va[1] != vb[1]
    a.view.merge(*vb, sender=3)
    assert (a.view.generation, a.view.nodes) == va, "a's view is the smaller: a keeps it"
    b.view.merge(*va, sender=0)                    # b takes it, less node 1 that b dropped, one on
    assert (b.view.generation, b.view.nodes) == (2, [0, 4, 3])
    a.view.merge(b.view.generation, b.view.nodes, sender=3)
    assert (a.view.generation, a.view.nodes) == (b.view.generation, b.view.nodes) == (2, [0, 4, 3])


def test_of_two_views_of_one_generation_the_node_left_out_follows_and_goes_idle():
    """Node 1 dropped node 2 and node 2 dropped node 1 (a pause): both choose [0, 1]; node 2 takes
    it as it is, without a move of its own, and is idle (a member of no world), never the end of the job."""
    one, two = Agent(1, spares=0), Agent(2, spares=0)
    one.view.drop([2], [])
    two.view.drop([1], [])
    two.view.merge(one.view.generation, one.view.nodes, sender=1)
    assert (two.view.generation, two.view.nodes) == (1, [0, 1]) and two.view.end is None
    one.view.merge(1, [0, 2], sender=2)
    assert one.view.nodes == [0, 1] and one.view.end is None
    one.view.merge(1, [0], sender=2)
    assert one.view.nodes == [0, 1], "a view without its sender is an idle agent's: not taken"


def test_a_dropped_node_stays_out_until_it_is_heard_again():
    a = Agent(0)
    a.view.drop([2], [])                           # generation 1: [0, 1]
    a.view.merge(3, [0, 1, 2], sender=1)            # a peer that never dropped it
    assert (a.view.generation, a.view.nodes) == (4, [0, 1]), "node 2 stripped, one generation on"
    reply = a.talk.hello({"node": 2, **a.talk.identity()})   # its agent came back
    assert reply["ok"] and reply["nodes"] == [0, 1] and not reply["again"], "not a member: no restart"
    assert a.view.idle() == [2, 3], "the returned node and the spare are both idle"
    a.view.merge(5, [0, 1, 2], sender=1)
    assert (a.view.generation, a.view.nodes) == (5, [0, 1, 2])


def test_the_lowest_member_grows_a_small_world_by_the_lowest_idle_node():
    lead, other = Agent(0), Agent(1)
    for agent in (lead, other):
        agent.view.seen[3] = time.monotonic() - 60   # the spare is silent: a shrink
        agent.view.drop([2], [])                   # both at [0, 1]
        agent.view.seen[2] = agent.view.seen[3] = time.monotonic()   # node 2's agent is back, and the spare
    other.view.take_idle()
    assert other.view.nodes == [0, 1], "only the view's lowest node grows it"
    lead.view.take_idle()
    assert (lead.view.generation, lead.view.nodes) == (2, [0, 1, 2])
    lead.view.take_idle()
    assert lead.view.nodes == [0, 1, 2], "--nnodes reached: the spare stays idle"


def test_an_idle_agent_follows_and_is_not_followed():
    spare, member = Agent(3), Agent(0)
    assert spare.view.node not in spare.view.nodes
    spare.view.drop([1], [])
    assert spare.view.nodes == [0, 1, 2] and not spare.pushed, "an idle agent drops nothing"
    member.view.drop([1], [])
    spare.view.merge(member.view.generation, member.view.nodes, sender=0)
    assert spare.view.nodes == [0, 3, 2]
    stale = Agent(3)
    stale.view.generation, stale.view.nodes = 7, [0, 1, 2]
    member.view.merge(stale.view.generation, stale.view.nodes, sender=4)
    assert member.view.generation == 1, "a view from outside the view is not taken"


def test_peek_answers_the_newest_world_without_moving_it():
    a = Agent(0)
    a.view.drop([1], [])
    assert a.talk.handle({"op": "peek", "place": 6}) == {"generation": 1, "world_size": 6, "rank": 2,
                                                    "plan_ranks": [0, 1, 6, 7, 4, 5]}
    assert a.talk.handle({"op": "peek", "place": 2})["error"] == "place 2 is not in the world of generation 1"
    assert a.view.generation == 1


def test_a_second_hello_from_a_member_is_a_restarted_agent_and_a_stranger_ends_only_a_new_job():
    a = Agent(0)
    assert a.talk.hello({"node": 1, **a.talk.identity()})["again"] is False
    assert a.talk.hello({"node": 1, **a.talk.identity()})["again"] is True
    a.workers[0] = object()                       # running: a stranger is refused, the job goes on
    reply = a.talk.hello({"node": 2, **a.talk.identity(), "run_id": "other"})
    assert reply["error"] == "the agent of node 2 has run_id 'other', the agent of node 0 has 't'"
    assert a.view.end is None
    a.workers.clear()                             # at start the whole job is refused
    assert a.talk.hello({"node": 0, **a.talk.identity()})["error"].startswith("two agents claim node rank 0")
    assert a.view.end is not None and a.view.end.message.startswith("refused at start: two agents claim node rank 0")


def test_only_a_grow_leaves_the_members_world_whole():
    """agent.py waits for every member to re-form after a move that broke their world, and takes
    one that never comes for hung; a grow is taken at a step boundary, so nobody is waited for."""
    lead = Agent(0, spares=2)
    lead.view.drop([2], [])                                 # the spare 3 takes node 2's slot
    with lead.view.cond:
        lead.view.move(lead.view.generation + 1, lead.view.nodes, "1 worker(s) lost on node 0")
    lead.view.seen[4] = time.monotonic() - 60                # the second spare is silent: a shrink
    lead.view.drop([1], [])
    lead.view.seen[1] = time.monotonic()                     # node 1's agent came back: idle
    lead.view.take_idle()
    assert lead.view.nodes == [0, 3, 1]
    assert lead.moves == [(1, False), (2, False), (3, False), (4, True)]
    other = Agent(1, spares=2)
    other.view.merge(1, [0, 1], sender=0)                   # a peer's shrink, then the peer's grow
    other.view.merge(2, [0, 1, 4], sender=0)
    assert other.moves == [(1, False), (2, True)]


def test_a_joined_worker_tells_its_generation_and_op_timeout():
    a = Agent(0)
    w = SimpleNamespace(proc=SimpleNamespace(pid=41), place=0, generation=0, joined=False, formed=-1,
                        op_timeout=None)
    a.workers[0] = w
    assert a.talk.handle({"op": "joined", "place": 0, "generation": 3, "pid": 41, "op_timeout": 7.5}) == {"ok": True}
    assert (w.joined, w.formed, w.op_timeout) == (True, 3, 7.5)
    a.talk.handle({"op": "joined", "place": 0, "generation": 2, "pid": 41})   # late, and from an older build
    assert (w.formed, w.op_timeout) == (3, 7.5), "a late report moves nothing back"



class Proc:
    def __init__(self, alive: bool = True, pid: int = 4242) -> None:
        self.alive, self.pid = alive, pid

    def poll(self):
        return None if self.alive else -9


def worker(**fields) -> SimpleNamespace:
    """A worker whose world formed in generation 1, op timeout 10 s, last heard at t=100."""
    return SimpleNamespace(**{"joined": True, "reaped": False, "formed": 1, "watched": 100.0, "op_timeout": 10.0,
                              "proc": Proc(), "stopped_since": None, **fields})


def test_a_worker_silent_past_its_op_timeout_after_a_breaking_move_is_a_no_show():
    hung = worker()
    assert no_shows([hung], 2, broke_at=105.0, now=115.5, default_s=300.0) == [hung]
    assert no_shows([hung], 2, broke_at=105.0, now=114.5, default_s=300.0) == [], "within its op timeout"
    assert no_shows([worker(op_timeout=None)], 2, broke_at=105.0, now=115.5, default_s=300.0) == [], \
        "an unknown op timeout waits the connect deadline"
    assert no_shows([worker(op_timeout=None)], 2, 105.0, now=406.0, default_s=300.0) != []


def test_a_worker_that_asked_re_formed_is_new_dead_or_reaped_is_not_a_no_show():
    late = dict(broke_at=105.0, now=200.0, default_s=300.0)
    assert no_shows([worker(watched=106.0)], 2, **late) == [], "asked the agent after the move: it comes"
    assert no_shows([worker(formed=2)], 2, **late) == [], "its world formed in the newest generation"
    assert no_shows([worker(joined=False)], 2, **late) == [], "a replacement not joined yet: the stale rules"
    assert no_shows([worker(proc=Proc(alive=False))], 2, **late) == [], "gone: the loss path has it"
    assert no_shows([worker(reaped=True)], 2, **late) == [], "killed once already"
    assert no_shows([worker()], 2, broke_at=None, now=200.0, default_s=300.0) == [], "only grows since start"


def test_a_silent_worker_seen_stopped_is_a_no_show_without_waiting_its_op_timeout():
    """A SIGSTOPped worker cannot come before someone continues it: waiting out its op timeout
    (10 s here) after its peers' collectives already timed out on it only adds to the stall."""
    stopped, sleeping = worker(), worker(proc=Proc(pid=4343))
    probe = {4242: True, 4343: False}.__getitem__
    note_stopped([stopped, sleeping], now=105.2, probe=probe)
    assert (stopped.stopped_since, sleeping.stopped_since) == (105.2, None)
    note_stopped([stopped, sleeping], now=105.9, probe=probe)
    assert stopped.stopped_since == 105.2, "seen stopped since its first look"
    assert no_shows([stopped, sleeping], 2, broke_at=105.0, now=105.9, default_s=300.0) == [], \
        f"seen stopped for less than {STOPPED_NO_SHOW_S} s"
    assert no_shows([stopped, sleeping], 2, broke_at=105.0, now=106.3, default_s=300.0) == [stopped]
    note_stopped([stopped], now=106.4, probe=lambda pid: False)
    assert stopped.stopped_since is None, "continued: it may still come within its op timeout"
    assert no_shows([stopped], 2, broke_at=105.0, now=106.5, default_s=300.0) == []
    late = worker(watched=105.5)
    note_stopped([late], now=106.0, probe=lambda pid: True)
    assert no_shows([late], 2, broke_at=105.0, now=200.0, default_s=300.0) == [], \
        "asked the agent after the move: it is not the one its peers wait for"


def test_a_worker_stopped_past_the_stopped_grace_is_taken_whatever_the_view():
    """The job's collectives wait on a stopped worker from its first second, view move or not: past
    --stopped-grace it is taken; a shorter stop rides through, and a grace of 0 takes nobody."""
    stopped, brief, gone = worker(formed=2), worker(formed=2, proc=Proc(pid=4343)), worker(proc=Proc(alive=False))
    note_stopped([stopped, brief, gone], now=100.0, probe=lambda pid: True)
    assert gone.stopped_since is None, "exited: the loss path has it"
    assert stopped_past([stopped, brief], now=102.9, grace=3.0) == [], "stopped for less than the grace"
    note_stopped([stopped, brief], now=101.0, probe={4242: True, 4343: False}.__getitem__)
    assert brief.stopped_since is None, "continued after a second: it rode through"
    assert stopped_past([stopped, brief], now=103.0, grace=3.0) == [stopped]
    assert stopped_past([stopped], now=1000.0, grace=0.0) == [], "--stopped-grace 0: waited for"
    stopped.reaped = True
    assert stopped_past([stopped], now=103.0, grace=3.0) == [], "killed once already"


def test_is_stopped_reads_a_real_process_state():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert not is_stopped(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not is_stopped(proc.pid):
            assert time.monotonic() < deadline, "never seen stopped"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while is_stopped(proc.pid):
            assert time.monotonic() < deadline, "never seen running again"
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert not is_stopped(proc.pid), "a reaped process is not stopped"


def answering(monkeypatch, views: dict) -> list[str]:
    """The peers answer a ping with ``views[host]`` (generation, nodes); a host not there is silent."""
    asked = []

    def ask(host, port, message, timeout):
        asked.append(host)
        if host not in views:
            raise wire.WireError(f"agent {host}:{port}: timed out")
        generation, nodes = views[host]
        return {"generation": generation, "nodes": nodes, "node": int(host[1:])}

    monkeypatch.setattr(membership.wire, "ask", ask)
    return asked


def test_a_re_form_with_every_peer_answering_moves_after_the_short_wait_not_the_grace(monkeypatch):
    """A peer stopped past the op timeout: nobody was lost, every agent answers.  The re-form
    waited the whole grace (5 s here, plus a second) before; the stopped peer's hang was longer by it."""
    a = Agent(0, spares=0)
    asked = answering(monkeypatch, {"h1": (0, [0, 1, 2]), "h2": (0, [0, 1, 2])})
    t0 = time.monotonic()
    reply = a.talk.handle({"op": "world", "place": 1, "formed": 0, "pid": 7})
    took = time.monotonic() - t0
    assert reply == {"generation": 1, "world_size": 6, "rank": 1, "plan_ranks": [0, 1, 2, 3, 4, 5]}
    assert membership.REFORM_WAIT_S <= took < a.opts.node_grace, took
    assert sorted(asked) == ["h1", "h2"] and a.view.nodes == [0, 1, 2]
    assert [f["why"] for e, f in a.events.seen if e == "view"] == ["re-form asked by a worker"]


def test_a_re_form_takes_a_peers_newer_view_and_waits_the_grace_for_a_silent_peer(monkeypatch):
    a = Agent(0, spares=0)
    answering(monkeypatch, {"h1": (1, [0, 1, 2]), "h2": (0, [0, 1, 2])})     # node 1 replaced a worker
    assert a.talk.handle({"op": "world", "place": 0, "formed": 0, "pid": 7})["generation"] == 1
    assert [f["why"] for e, f in a.events.seen if e == "view"] == ["a peer's view"]
    b = Agent(0, spares=0)
    b.opts.node_grace = 1.0
    answering(monkeypatch, {"h1": (0, [0, 1, 2])})                            # node 2 is silent
    t0 = time.monotonic()
    reply = b.talk.handle({"op": "world", "place": 0, "formed": 0, "pid": 7})
    assert time.monotonic() - t0 >= b.opts.node_grace, "a silent peer is dropped only after the grace"
    assert (reply["generation"], b.view.nodes) == (1, [0, 1])
    assert [f["message"] for e, f in b.events.seen if e == "node-lost"] == \
        ["node 2 did not answer a probe (a worker was waiting)"]


def test_a_peer_refusing_every_ask_is_lost_after_refused_s_and_one_that_does_not_answer_keeps_the_grace():
    """A refusal means nothing listens at the peer's agent port (its agent was killed, its host is
    up): it is lost after REFUSED_S, not the 5 s grace.  An ask that times out (a paused agent, whose
    kernel still accepts; a host gone) keeps the grace, and so does a refusal followed by one."""
    refused, timed_out = wire.WireError("refused", refused=True), wire.WireError("timed out")
    a = Agent(0, spares=1)
    for err in (refused, refused):
        a.view.unanswered(1, err)
    a.view.unanswered(2, refused)
    a.view.unanswered(2, timed_out)
    now = time.monotonic()
    for table in (a.view.refused, a.view.failing):            # the first failed ask was this long ago
        for n in table:
            table[n] -= membership.REFUSED_S + 0.1
    for n in (1, 2):
        a.view.seen[n] = now - membership.REFUSED_S - 0.1
    with a.view.cond:
        assert a.view.lost_peers(now) == [1], "refused past REFUSED_S is lost; refused then timed out is not yet"
        assert a.view.lost_peers(now + a.opts.node_grace) == [1, 2], "the timed-out one after the grace"
    a.view.drop([1], [])
    [(event, lost)] = [(e, f) for e, f in a.events.seen if e == "node-lost"]
    assert lost["message"] == ("node 1 refused every ask for 1.5 s (nothing listens at its agent port: its "
                               "agent is gone); node 3 takes its slot"), lost
    assert lost["refused"] == [1] and a.view.nodes == [0, 3, 2] and 1 not in a.view.refused

    b = Agent(0)
    b.view.unanswered(1, refused)
    b.view.refused[1] -= membership.REFUSED_S + 0.1
    b.view.merge(0, [0, 1, 2], 1)                       # it answered since: its agent is back
    with b.view.cond:
        assert b.view.lost_peers(time.monotonic()) == [] and not b.view.refused
    c = Agent(0)
    c.opts.node_grace = 0.5                         # a grace shorter than REFUSED_S still governs
    c.view.unanswered(1, refused)
    c.view.refused[1] -= 0.6
    with c.view.cond:
        assert c.view.lost_peers(time.monotonic()) == [1]
        why, refusing = c.view.silence(1, probed=False)
        assert refusing and why.startswith("refused every ask for 0.5 s")
    d = Agent(0)                                    # silent for the grace, refusing only lately
    d.view.unanswered(1, wire.WireError("timed out"))
    d.view.unanswered(1, refused)
    d.view.failing[1] -= d.opts.node_grace + 0.1
    d.view.seen[1] -= d.opts.node_grace + 0.1
    d.view.drop([1], [])
    [lost] = [f for e, f in d.events.seen if e == "node-lost"]
    assert lost["message"].startswith("node 1 silent for 5 s") and lost["refused"] == [], lost


def test_a_node_another_agent_dropped_for_refusing_is_not_grown_back_until_it_is_heard_again():
    """Node 1 drops node 2 for refusing (1.5 s after its last answer, well within the grace) and
    node 0, the lowest member, takes that view.  Node 0 heard node 2 within the grace but its own
    asks were refused since: before, it grew node 2 back at once, and the view flapped between
    [0, 1] and [0, 1, 2] every heartbeat until the workers gave up (benchmarks/launch.py, a node
    lost with no spare).  It is taken back once it pings again."""
    a = Agent(0, spares=0)
    a.view.unanswered(2, wire.WireError("refused", refused=True))
    a.view.merge(1, [0, 1], 1)
    a.view.take_idle()
    assert (a.view.generation, a.view.nodes) == (1, [0, 1]), "a node refusing asks is not idle"
    a.talk.handle({"op": "ping", "generation": 1, "nodes": [0, 1], "node": 2})     # its agent is back, idle
    a.view.take_idle()
    assert (a.view.generation, a.view.nodes) == (2, [0, 1, 2])


def test_a_node_given_away_as_slow_or_failing_asks_still_hears_that_the_job_finished():
    """Node 2's slot went to the spare for a lossy link, and node 3's asks fail: both wait
    outside the view for the job, and _idle() leaves both out (neither may be taken in).  Before,
    the members told only _idle()'s nodes that they finished: the slow node heard nothing, took
    the silence for a lost network and exited 18 after the job had finished (the goodput soak)."""
    a = Agent(0, nnodes=2, spares=3)
    a.view.nodes = [0, 4]
    a.view.slow[2] = time.monotonic()
    a.view.unanswered(3, wire.WireError("timed out"))
    del a.view.seen[1]                               # a spare whose agent was never heard
    assert 2 not in a.view.idle() and 3 not in a.view.idle()
    assert a.view.contacts() == [2, 3, 4]
    a.view.finished.add(3)
    a.view.gone[2] = time.monotonic() + 1            # dropped after it was last heard
    assert a.view.contacts() == [4]


def test_a_final_word_is_asked_again_where_no_answer_came_and_not_where_the_host_refused():
    """The job's last word (finished, or leaving) crosses the links that are worst at the end: a
    node that gave no answer is asked again, FINAL_TRIES asks in all; one whose host refuses is
    not (nothing listens there), and every node is told at once."""
    got: list[dict] = []
    with socket.socket() as lossy, socket.socket() as closed:
        lossy.bind(("127.0.0.1", 0))
        lossy.listen(4)
        port = lossy.getsockname()[1]
        closed.bind(("127.0.0.2", port))        # bound, not listening: the kernel refuses

        def serve():                            # the first ask is lost: closed without an answer
            for answer in (False, True):
                conn, _ = lossy.accept()
                with conn, conn.makefile("rwb") as f:
                    got.append(json.loads(f.readline()))
                    if answer:
                        f.write(b'{"ok": true}\n')
                        f.flush()
        server = threading.Thread(target=serve, daemon=True)
        server.start()
        a = Agent(0)
        a.talk.addrs, a.talk.port = ["127.0.0.9", "127.0.0.1", "127.0.0.2"], port
        started = time.monotonic()
        a.talk.tell_peers({"op": "leave", "node": 0, "reason": "done"}, [1, 2], membership.FINAL_TRIES)
        server.join(5.0)
    assert time.monotonic() - started < membership.ASK_TIMEOUT_S
    assert got == [{"op": "leave", "node": 0, "reason": "done"}] * 2


def test_an_ask_tells_a_refused_port_from_one_that_never_answers():
    with socket.socket() as quiet:
        quiet.bind(("127.0.0.1", 0))
        quiet.listen(1)                             # the kernel accepts; nobody answers: a paused agent
        with pytest.raises(wire.WireError) as paused:
            wire.ask("127.0.0.1", quiet.getsockname()[1], {"op": "ping"}, 0.3)
        assert not paused.value.refused and "timed out" in str(paused.value)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))               # bound, not listening: the kernel refuses
        with pytest.raises(wire.WireError) as gone:
            wire.ask("127.0.0.1", closed.getsockname()[1], {"op": "ping"}, 0.3)
        assert gone.value.refused and "refused" in str(gone.value)


def test_standbys_wait_for_the_first_start_to_form_its_world_or_a_bound():
    first = [SimpleNamespace(joined=True, generation=0), SimpleNamespace(joined=False, generation=0)]
    assert not standbys_due(first, started=100.0, now=101.0), "a worker of the first start has not formed"
    assert standbys_due(first, started=100.0, now=100.0 + STANDBY_DEFER_S + 0.1), "a script that never tells"
    first[1].joined = True
    assert standbys_due(first, started=100.0, now=101.0)
    replaced = [SimpleNamespace(joined=True, generation=0), SimpleNamespace(joined=False, generation=2)]
    assert standbys_due(replaced, started=100.0, now=101.0), "a replacement used one: refill at once"
    assert standbys_due([], started=100.0, now=101.0)
