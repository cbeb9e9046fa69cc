"""The agents' view rules in process, no network: a spare takes a lost node's slot, the
majority counts only the last view's survivors, equal-generation conflicts resolve the same way
on both sides, a dropped node comes back only after it is heard again, and idle agents follow.
Two or three agents here are plain objects whose pushes are delivered by hand (the wire and
the timing are tests/test_launch_recovery.py's)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from hpct.launch.membership import Membership

pytestmark = pytest.mark.unit


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def emit(self, event: str, text: str, **fields) -> None:
        self.seen.append((event, {"message": text, **fields}))


class Agent(Membership):
    """A Membership with the fields NodeAgent gives it; pushes are recorded, not sent."""

    def __init__(self, node: int, nnodes: int = 3, spares: int = 1) -> None:
        self.opts = SimpleNamespace(nnodes=nnodes, spare_nodes=spares, all_nodes=nnodes + spares, node_grace=5.0,
                                    nproc_per_node=2, run_id="t", hosts=[f"h{n}" for n in range(nnodes + spares)])
        self.node, self.cond, self.events = node, threading.Condition(), Recorder()
        self.generation, self.nodes = 0, list(range(nnodes))
        self.finished, self.leaving, self.gone, self.hellos, self.workers = set(), {}, {}, set(), {}
        self.failing = {}
        self.seen = {n: time.monotonic() for n in range(nnodes + spares)}
        self.end = self.signalled = None
        self.pushed: list[dict] = []

    def _tell_peers(self, message, to=None) -> None:
        self.pushed.append(message)

    def _view_moved(self, generation: int) -> None:
        pass

    def world(self) -> list[int]:
        return self._world()[0]

    def _world(self):
        p = self.opts.nproc_per_node
        return [n * p + local for n in self.nodes for local in range(p)], self.generation


def test_the_lowest_idle_spare_takes_a_lost_nodes_slot_and_its_ranks():
    a = Agent(0, spares=2)
    a._drop([1], [])
    assert (a.generation, a.nodes) == (1, [0, 3, 2]) and a.end is None
    assert a.world() == [0, 1, 6, 7, 4, 5], "ranks 2-3 now live at node 3's places"
    lost = [f for e, f in a.events.seen if e == "node-lost"][0]
    assert lost["message"] == "node 1 silent for 5 s; node 3 takes its slot"


def test_without_an_idle_node_the_view_shrinks_and_a_silent_spare_is_not_idle():
    a = Agent(0)
    a.seen[3] = time.monotonic() - 60          # the spare stopped pinging
    a._drop([2], [])
    assert a.nodes == [0, 1] and a.world() == [0, 1, 2, 3]


def test_a_spare_does_not_make_a_majority():
    a = Agent(0, spares=2)
    a._drop([1, 2], [])
    assert a.nodes == [0, 3, 4], "the spares filled the slots"
    assert a.end is not None and "1 of the last view's 3 nodes remain here, no majority" in a.end.message


def test_equal_generations_with_different_nodes_resolve_alike_on_both_sides():
    a, b = Agent(0, nnodes=4, spares=1), Agent(3, nnodes=4, spares=1)
    a._drop([2], [])                           # a: [0, 1, 4, 3]
    b._drop([1], [])                           # b: [0, 4, 2, 3]
    va, vb = (a.generation, list(a.nodes)), (b.generation, list(b.nodes))
    assert va[0] == vb[0] == 1 and va[1] != vb[1]
    a._merge(*vb, sender=3)
    assert (a.generation, a.nodes) == va, "a's view is the smaller: a keeps it"
    b._merge(*va, sender=0)                    # b takes it, less node 1 that b dropped, one on
    assert (b.generation, b.nodes) == (2, [0, 4, 3])
    a._merge(b.generation, b.nodes, sender=3)
    assert (a.generation, a.nodes) == (b.generation, b.nodes) == (2, [0, 4, 3])


def test_of_two_views_of_one_generation_the_node_left_out_follows_and_goes_idle():
    """Node 1 dropped node 2 and node 2 dropped node 1 (a pause): both choose [0, 1]; node 2 takes
    it as it is, without a move of its own, and is idle (a member of no world), never the end of the job."""
    one, two = Agent(1, spares=0), Agent(2, spares=0)
    one._drop([2], [])
    two._drop([1], [])
    two._merge(one.generation, one.nodes, sender=1)
    assert (two.generation, two.nodes) == (1, [0, 1]) and two.end is None
    one._merge(1, [0, 2], sender=2)
    assert one.nodes == [0, 1] and one.end is None
    one._merge(1, [0], sender=2)
    assert one.nodes == [0, 1], "a view without its sender is an idle agent's: not taken"


def test_a_dropped_node_stays_out_until_it_is_heard_again():
    a = Agent(0)
    a._drop([2], [])                           # generation 1: [0, 1]
    a._merge(3, [0, 1, 2], sender=1)            # a peer that never dropped it
    assert (a.generation, a.nodes) == (4, [0, 1]), "node 2 stripped, one generation on"
    reply = a._hello({"node": 2, **a._identity()})   # its agent came back
    assert reply["ok"] and reply["nodes"] == [0, 1] and not reply["again"], "not a member: no restart"
    assert a._idle() == [2, 3], "the returned node and the spare are both idle"
    a._merge(5, [0, 1, 2], sender=1)
    assert (a.generation, a.nodes) == (5, [0, 1, 2])


def test_the_lowest_member_grows_a_small_world_by_the_lowest_idle_node():
    lead, other = Agent(0), Agent(1)
    for agent in (lead, other):
        agent.seen[3] = time.monotonic() - 60   # the spare is silent: a shrink
        agent._drop([2], [])                   # both at [0, 1]
        agent.seen[2] = agent.seen[3] = time.monotonic()   # node 2's agent is back, and the spare
    other._take_idle()
    assert other.nodes == [0, 1], "only the view's lowest node grows it"
    lead._take_idle()
    assert (lead.generation, lead.nodes) == (2, [0, 1, 2])
    lead._take_idle()
    assert lead.nodes == [0, 1, 2], "--nnodes reached: the spare stays idle"


def test_an_idle_agent_follows_and_is_not_followed():
    spare, member = Agent(3), Agent(0)
    assert spare.node not in spare.nodes
    spare._drop([1], [])
    assert spare.nodes == [0, 1, 2] and not spare.pushed, "an idle agent drops nothing"
    member._drop([1], [])
    spare._merge(member.generation, member.nodes, sender=0)
    assert spare.nodes == [0, 3, 2]
    stale = Agent(3)
    stale.generation, stale.nodes = 7, [0, 1, 2]
    member._merge(stale.generation, stale.nodes, sender=4)
    assert member.generation == 1, "a view from outside the view is not taken"


def test_peek_answers_the_newest_world_without_moving_it():
    a = Agent(0)
    a._drop([1], [])
    assert a.handle({"op": "peek", "place": 6}) == {"generation": 1, "world_size": 6, "rank": 2,
                                                    "plan_ranks": [0, 1, 6, 7, 4, 5]}
    assert a.handle({"op": "peek", "place": 2})["error"] == "place 2 is not in the world of generation 1"
    assert a.generation == 1


def test_a_second_hello_from_a_member_is_a_restarted_agent_and_a_stranger_ends_only_a_new_job():
    a = Agent(0)
    assert a._hello({"node": 1, **a._identity()})["again"] is False
    assert a._hello({"node": 1, **a._identity()})["again"] is True
    a.workers = {0: object()}                     # running: a stranger is refused, the job goes on
    reply = a._hello({"node": 2, **a._identity(), "run_id": "other"})
    assert reply["error"] == "the agent of node 2 has run_id 'other', the agent of node 0 has 't'"
    assert a.end is None
    a.workers = {}                                # at start the whole job is refused
    assert a._hello({"node": 0, **a._identity()})["error"].startswith("two agents claim node rank 0")
    assert a.end is not None and a.end.message.startswith("refused at start: two agents claim node rank 0")
