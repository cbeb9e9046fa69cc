"""A node whose links turn slow gives its slot to an idle node: the judgement (hpct/launch/links.py)
from the medians every agent reports of its asks, and the view move the lowest member makes from
it.  In process, no network: the agents and reports are made by hand (a real lossy port, its
timings and the training job's end are tests/test_launch_recovery.py's)."""

from __future__ import annotations

import time

import pytest

from hpct import wire
from hpct.launch.links import MIN_SAMPLES, SLOW_HOLD_S, WINDOW, LinkTimes, parse, slow_nodes

from agent_parts import Agent

pytestmark = pytest.mark.unit

FAST, SLOW = 1.0, 90.0      # ms per ask: between healthy nodes, and through a port with 20 ms each way


def reports(slow: int, members: list[int], idle: tuple[int, ...] = (), fast: float = FAST,
            slow_ms: float = SLOW) -> dict[int, dict[int, float]]:
    """As the agents make them: every member asks every other member, an idle node asks the members;
    the asks through node ``slow``'s port take ``slow_ms``."""
    return {a: {b: slow_ms if slow in (a, b) else fast for b in members if b != a} for a in [*members, *idle]}


def feed(agent: Agent, rows: dict[int, dict[int, float]]) -> None:
    now = time.monotonic()
    agent.view.heard_links = {n: (now, dict(row)) for n, row in rows.items() if n != agent.view.node}
    for peer, ms in rows.get(agent.view.node, {}).items():
        for _ in range(MIN_SAMPLES):
            agent.view.link_times.record(peer, ms / 1e3)


def test_the_node_behind_a_slow_port_stands_out_and_no_other():
    assert slow_nodes(reports(1, [0, 1, 2], idle=(3,)), 10) == {1: (SLOW, FAST)}
    assert list(slow_nodes(reports(1, [0, 1, 2]), 10)) == [1], "three nodes judge without a spare"
    assert list(slow_nodes(reports(2, [0, 1, 2, 3], idle=(4,)), 10)) == [2], "the 4x4 soak's shape"
    assert list(slow_nodes(reports(3, [0, 1, 2], idle=(3,)), 10)) == [3], "an idle node on a slow port"


def test_load_that_slows_every_link_alike_singles_out_nobody():
    rows = {a: {b: 50.0 for b in range(4) if b != a} for a in range(4)}
    assert slow_nodes(rows, 10) == {}
    rows[0][1] = 400.0                   # one asker's spike on one link: the other links of 0 and 1 outvote it
    assert slow_nodes(rows, 10) == {}


def test_an_asks_round_trip_is_the_links_not_the_time_a_busy_agent_takes_to_answer():
    # A descheduled agent answering late lifted its node above the others in a fault-free soak
    # and moved its slot; the kernel's handshake round trip does not see the answerer's delay.
    def late(request: dict) -> dict:
        time.sleep(0.3)
        return {"op": "pong"}

    server = wire.Server("127.0.0.1", 0, late)
    try:
        t0 = time.monotonic()
        reply, rtt = wire.ask_timed("127.0.0.1", server.sock.getsockname()[1], {"op": "ping"}, 5.0)
        took = time.monotonic() - t0
    finally:
        server.close()
    assert reply == {"op": "pong"} and took >= 0.3
    assert 0 < rtt < 0.05, f"the round trip {rtt * 1e3:.1f} ms holds the answer's delay"


def test_two_nodes_are_never_judged_and_the_limit_holds():
    assert slow_nodes({0: {1: SLOW}, 1: {0: SLOW}}, 10) == {}, "either end of one link could be the slow one"
    assert slow_nodes(reports(1, [0, 1, 2], fast=0.1, slow_ms=8.0), 10) == {}, "80x, but under --slow-link-ms"
    assert slow_nodes(reports(1, [0, 1, 2], fast=3.0, slow_ms=11.0), 10) == {}, "over the limit, not 4x the rest"
    assert slow_nodes(reports(1, [0, 1, 2], idle=(3,)), 0) == {}, "--slow-link-ms 0 judges nothing"


def test_link_times_keep_a_window_and_forget_a_peer_no_longer_asked():
    t = LinkTimes()
    t.record(1, 0.001)
    t.record(1, 0.001)
    assert t.medians([1]) == {}, f"fewer than {MIN_SAMPLES} answered asks: not reported yet"
    t.record(1, 0.5)
    assert t.medians([1]) == {1: 1.0}, "the median: one slow ask of three moves nothing"
    for _ in range(WINDOW):
        t.record(1, 0.002)
    assert t.medians([1]) == {1: 2.0}, "only the last WINDOW asks count"
    assert t.medians([2]) == {} and 1 not in t.samples, "a node that left the view comes back unjudged"


def test_reports_come_over_the_wire_with_string_keys_and_junk_is_dropped():
    assert parse({"1": 2.5, "x": 1, "2": "fast", "3": -1, "4": None}) == {1: 2.5}
    assert parse(["1", 2]) == {} and parse(None) == {}
    a = Agent(0)
    reply = a.talk.handle({"op": "ping", "generation": 0, "nodes": [0, 1, 2], "node": 1, "links": {"0": 90.0}})
    assert a.view.heard_links[1][1] == {0: 90.0} and reply["links"] == {} and reply["nodes"] == [0, 1, 2]
    assert a.view.ping()["links"] == {}, "no peer asked often enough yet"


def test_the_lowest_member_gives_a_slow_members_slot_to_the_spare_after_the_hold():
    lead = Agent(0)                          # nodes [0, 1, 2], spare 3
    feed(lead, reports(1, [0, 1, 2], idle=(3,)))
    lead.view.give_slow_slot(lead.view.judge_links())
    assert (lead.view.generation, lead.view.nodes) == (0, [0, 1, 2]), f"not before it stood out for {SLOW_HOLD_S} s"
    lead.view.slow[1] -= SLOW_HOLD_S
    lead.view.give_slow_slot(lead.view.judge_links())
    assert (lead.view.generation, lead.view.nodes) == (1, [0, 3, 2]) and lead.view.end is None
    assert lead.world() == [0, 1, 6, 7, 4, 5], "ranks 2-3 now live at the spare's places"
    assert lead.moves == [(1, False)], "the members' world breaks: they re-form with the spare"
    (event,) = [f for e, f in lead.events.seen if e == "slow-node"]
    assert event["message"] == ("node 1's links are slow: an ask takes 90 ms against 1 ms between the others "
                                "(--slow-link-ms 10); node 3 takes its slot")
    assert (event["node"], event["spare"], event["link_ms"], event["others_ms"]) == (1, 3, SLOW, FAST)
    slowpoke = Agent(1)
    slowpoke.view.merge(lead.view.generation, lead.view.nodes, sender=0)
    assert slowpoke.view.node not in slowpoke.view.nodes and slowpoke.view.end is None, "it follows, idle, and may come back"


def test_a_slow_member_keeps_its_slot_unless_a_healthy_idle_node_and_the_lowest_member_take_it():
    other = Agent(2)
    feed(other, reports(1, [0, 1, 2], idle=(3,)))
    other.view.judge_links()
    other.view.slow[1] -= SLOW_HOLD_S
    other.view.give_slow_slot(other.view.judge_links())
    assert other.view.nodes == [0, 1, 2], "only the view's lowest node moves it"
    lead = Agent(0)
    lead.view.seen[3] = time.monotonic() - 60    # the spare is silent: nobody to give the slot to
    feed(lead, reports(1, [0, 1, 2], idle=(3,)))
    lead.view.judge_links()
    lead.view.slow[1] -= SLOW_HOLD_S
    lead.view.give_slow_slot(lead.view.judge_links())
    assert lead.view.nodes == [0, 1, 2], "without a spare the slow link is ridden through"
    feed(lead, reports(1, [0, 1, 2], fast=2.0, slow_ms=2.0))
    assert lead.view.judge_links() == {} and lead.view.slow == {}, "a link that healed starts the hold again"


def test_when_the_lowest_member_is_slow_the_next_one_gives_its_slot():
    """The 30-minute soak: node 1, first in the view [1, 4, 2, 3], was the slow one and moved the
    view without itself.  Only members push views, so nobody heard it; its workers stopped, the
    others re-formed with node 1 again, it dropped itself again, and they waited for its workers
    until their connect deadline ended the job.  The lowest member that is not slow moves now."""
    slowpoke, lead = Agent(0), Agent(1)         # nodes [0, 1, 2], spare 3; node 0's port is slow
    for agent in (slowpoke, lead):
        feed(agent, reports(0, [0, 1, 2], idle=(3,)))
        agent.view.judge_links()
        agent.view.slow[0] -= SLOW_HOLD_S
        agent.view.give_slow_slot(agent.view.judge_links())
    assert (slowpoke.view.generation, slowpoke.view.nodes) == (0, [0, 1, 2]), "the slow node does not move the view"
    assert (lead.view.generation, lead.view.nodes) == (1, [3, 1, 2]) and lead.view.end is None
    slowpoke.view.merge(lead.view.generation, lead.view.nodes, sender=1)
    assert slowpoke.view.node not in slowpoke.view.nodes and slowpoke.view.generation == 1, "it hears the view and follows"


def test_a_spare_behind_a_slow_port_is_not_taken_in():
    lead = Agent(0)
    feed(lead, reports(3, [0, 1, 2], idle=(3,)))
    assert list(lead.view.judge_links()) == [3] and lead.view.idle() == []
    lead.view.drop([2], [])
    assert lead.view.nodes == [0, 1], "a lost node's slot is not given to a node whose links are slow: a shrink"


def test_a_job_of_two_nodes_gives_a_slow_nodes_slot_to_the_spare_and_goes_on():
    """Two members and a spare: the swap keeps one of the last view's two nodes, but the slow one
    answers (it is slow, not cut off), so this side is no minority and nothing is split.  Before,
    the member that gave the slot and the spare that took it both ended the job ("1 of the last
    view's 2 nodes remain here, no majority"), found by a node slow from the job's start."""
    lead, spare, slowpoke = Agent(1, nnodes=2), Agent(2, nnodes=2), Agent(0, nnodes=2)
    feed(lead, reports(0, [0, 1], idle=(2,)))
    lead.view.judge_links()
    lead.view.slow[0] -= SLOW_HOLD_S
    lead.view.give_slow_slot(lead.view.judge_links())
    assert (lead.view.generation, lead.view.nodes) == (1, [2, 1]) and lead.view.end is None, lead.view.end and lead.view.end.message
    for agent in (spare, slowpoke):
        agent.view.merge(lead.view.generation, lead.view.nodes, sender=1)
    assert (spare.view.generation, spare.view.nodes) == (1, [2, 1]) and spare.view.end is None, "the spare takes the slot"
    assert slowpoke.view.nodes == [2, 1] and slowpoke.view.end is None, "the slow node follows, idle"
    lost = Agent(1, nnodes=2)
    lost.view.drop([0], [])
    assert lost.view.nodes == [2, 1] and "1 of the last view's 2 nodes remain here" in lost.view.end.message, \
        "a silent node is still no majority's: the side that cannot hear it stops"
