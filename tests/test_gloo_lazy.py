"""Lazy storeless pairs (Gloo patches 0015-0016) across processes on loopback.

A lazy context connects only what its operations use: the group forms by counting its
members up and down a binomial tree (at most log2(N)+1 peers per rank).  The higher rank of a pair dials; a
lower rank that needs the pair first rings the higher one's doorbell, so a rank that
arrives last connects at once instead of waiting out its peers' retry backoff.
The faults and abort suites also run in this mode (their ``connect_mode`` fixture).
"""

from __future__ import annotations

import math
import random
import time

import pytest

from gloo_helpers import loopback_peers, run_group

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]

LAZY = {"lazy": True}


def _ok(workers, event):
    for w in workers:
        assert w.proc.returncode == 0, w.describe()
        w.event(event)


@pytest.mark.parametrize("size", [3, 8, 13, 16])
def test_a_group_forms_on_a_tree_and_the_rest_connects_on_use(size):
    """After connect (a count up and down a binomial tree) no rank holds more than
    log2(N)+1 peers, and after the first allreduce (recursive doubling: the
    partners rank ^ 2^k, which include the tree's) no more than log2(N)+2; every
    collective and point-to-point still gives exact results on pairs opened on use."""
    # Each count is followed by an allreduce: no rank gets past it (to operations that
    # open more pairs) before every rank has counted.
    script = [{"op": "connect", **LAZY}, {"op": "connections"}, {"op": "allreduce"},
              {"op": "connections"}, {"op": "allreduce"},
              {"op": "collectives", "elements": 100}, {"op": "close"}]
    workers = run_group(size, script, timeout=60 + 4 * size, connect_timeout=40)
    _ok(workers, "collectives_ok")
    for w in workers:
        counts = [e["count"] for e in w.events if e["event"] == "connections"]
        assert 1 <= counts[0] <= math.ceil(math.log2(size)) + 1, w.describe()
        assert counts[0] <= counts[1] <= math.log2(size) + 2, w.describe()
    # The tree's root has a child for every power of two below N.  Its ring predecessor N-1
    # may already have started the next allreduce (it counted and passed the tree before
    # rank 0 counted) and dialled rank 0: that one pair, and no other, may be there too.
    children = {1 << k for k in range(math.ceil(math.log2(size)))}
    allowed = {len(children)} if size - 1 in children else {len(children), len(children) + 1}
    root_count = [e["count"] for e in workers[0].events if e["event"] == "connections"][0]
    assert root_count in allowed, (root_count, allowed)


# Dialers wait 5-15 s between attempts (10 s +-50 %): without the doorbell, a rank
# that arrives after its dialers' first attempt would wait seconds for the next one.
BACKOFF = {"retry_delay_initial": 10.0, "retry_delay_max": 10.0}


def _arrivals(order: str, size: int) -> list[float]:
    if order == "rank 0 last":
        return [1.5] + [0.0] * (size - 1)
    if order == "reverse":
        return [0.25 * (size - 1 - r) for r in range(size)]
    if order == "random":
        ranks = list(range(size))
        random.Random(11).shuffle(ranks)
        return [0.25 * ranks.index(r) for r in range(size)]
    return [0.0] * size


@pytest.mark.parametrize("order", ["in order", "rank 0 last", "reverse", "random"])
def test_the_last_rank_to_arrive_does_not_wait_out_a_backoff(order):
    """Whatever the arrival order, the rank that arrives last connects (its first
    allreduce included) within a second, though its dialers' retry delay is 5-15 s."""
    size = 6
    delays = _arrivals(order, size)
    per_rank = {r: {"script": [{"op": "sleep", "seconds": d}, {"op": "connect", **LAZY, **BACKOFF},
                               {"op": "allreduce"}, {"op": "close"}]}
                for r, d in enumerate(delays)}
    workers = run_group(size, [], per_rank=per_rank, timeout=60, connect_timeout=30)
    _ok(workers, "allreduce_ok")
    last = max(range(size), key=lambda r: delays[r])
    took = workers[last].event("connected")["seconds"]
    assert took < 1.0, f"rank {last} (last, {order}) took {took} s to connect:\n" + workers[last].describe()


def test_missing_rank_fails_everyone_by_the_deadline_and_the_cause_travels():
    """A rank that never starts: every other rank fails with ConnectTimeoutError by
    the deadline (plus the notice's hop), and every message names the missing rank
    and its address, also on ranks that never needed a pair with it (the failure
    notice of patch 0016 carries the cause along the ring)."""
    size, missing, deadline = 6, 3, 3.0
    peers = loopback_peers(size)
    started = time.monotonic()
    workers = run_group(size, [{"op": "expect_connect_error", **LAZY}], peers=peers, skip=[missing],
                        connect_timeout=deadline, timeout=40)
    host, port = peers[missing]
    for w in workers:
        assert w.proc.returncode == 0, w.describe()
        ev = w.event("connect_error")
        assert ev["type"] == "ConnectTimeoutError", ev
        assert f"rank {missing} ({host}:{port})" in ev["message"], ev["message"]
        assert "timed out after 3000 ms" in ev["message"], ev["message"]
        assert ev["seconds"] < deadline + 4.0, ev
    assert time.monotonic() - started < deadline + 30


def test_a_stale_rank_learns_at_once_and_the_group_fails_naming_it():
    """Ranks at generation 2, one replacement started with generation 1: the stale
    one fails at once with StaleGenerationError naming generation 2; the others fail
    at the deadline with ConnectTimeoutError naming it, and one that met it says it
    had generation 1."""
    size, stale, deadline = 4, 2, 3.0
    peers = loopback_peers(size)
    workers = run_group(size, [{"op": "expect_connect_error", **LAZY}], peers=peers, generation=2,
                        per_rank={stale: {"generation": 1}}, connect_timeout=deadline, timeout=40)
    by_rank = {w.rank: w for w in workers}
    ev = by_rank[stale].event("connect_error")
    assert ev["type"] == "StaleGenerationError", ev
    assert ev["newer_generation"] == 2, ev
    assert "start it with generation 2" in ev["message"], ev
    assert ev["seconds"] < 1.5, ev
    others = [by_rank[r].event("connect_error") for r in by_rank if r != stale]
    host, port = peers[stale]
    for ev in others:
        assert ev["type"] == "ConnectTimeoutError", ev
        assert f"rank {stale} ({host}:{port})" in ev["message"], ev["message"]
    # Whoever met the stale rank says which generation it had (the others may only
    # have seen its port closed after it left).
    assert any("generation 1, expected 2" in ev["message"] for ev in others), others


def test_full_mesh_stays_available():
    """lazy=False (the raw context's default) still connects every pair at once."""
    size = 5
    workers = run_group(size, [{"op": "connect"}, {"op": "connections"}, {"op": "barrier"},
                               {"op": "close"}], timeout=60)
    for w in workers:
        assert w.proc.returncode == 0, w.describe()
        assert w.event("connections")["count"] == size - 1
