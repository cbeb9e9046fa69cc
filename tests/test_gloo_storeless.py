"""Storeless Gloo (patches 0004-0008) across processes on loopback.

No store, no root: every rank gets the peer table from the port plan, binds its
own port and connects directly.  Each worker process is bounded by a timeout.
"""

from __future__ import annotations

import time

import pytest

from gloo_helpers import free_block, loopback_peers, run_group, start_worker

pytestmark = pytest.mark.multiprocess


def _ok(workers, event="collectives_ok"):
    for w in workers:
        assert w.proc.returncode == 0, w.describe()
        w.event(event)


@pytest.mark.parametrize("size", [2, 4, 8, 16])
def test_collectives_exact(size):
    """Storeless init, then allreduce (4 dtypes x 4 ops), broadcast, allgather,
    barrier and send/recv give exact results."""
    timeout = 60 + 6 * size
    workers = run_group(size, [{"op": "connect"}, {"op": "collectives"}, {"op": "close"}],
                        timeout=timeout, connect_timeout=timeout - 10)
    _ok(workers)
    for w in workers:
        assert w.event("connected")["generation"] == 1


def test_late_rank_is_waited_for():
    """A rank that starts 3 s late is waited for (the active side retries)."""
    size = 4
    workers = run_group(size, [{"op": "connect"}, {"op": "collectives", "elements": 10},
                               {"op": "close"}],
                        per_rank={3: {"script": [{"op": "sleep", "seconds": 3.0}, {"op": "connect"},
                                                 {"op": "collectives", "elements": 10},
                                                 {"op": "close"}]}},
                        connect_timeout=20, timeout=60)
    _ok(workers)
    # The punctual ranks waited for the late one.
    for w in workers[:3]:
        assert w.event("connected")["seconds"] >= 2.5, w.describe()


def test_missing_rank_fails_everyone_by_the_deadline_naming_it():
    """A rank that never starts: every other rank fails at the connect deadline
    with ConnectTimeoutError naming the missing rank (and its address)."""
    size, missing, deadline = 4, 2, 3.0
    peers = loopback_peers(size)
    started = time.monotonic()
    workers = run_group(size, [{"op": "expect_connect_error"}], peers=peers, skip=[missing],
                        connect_timeout=deadline, timeout=30)
    for w in workers:
        assert w.proc.returncode == 0, w.describe()
        ev = w.event("connect_error")
        assert ev["type"] == "ConnectTimeoutError", ev
        assert "TimeoutError" in ev["classes"]
        host, port = peers[missing]
        assert f"{missing} ({host}:{port}" in ev["message"], ev["message"]
        assert "still missing rank" in ev["message"]
        assert deadline - 0.2 <= ev["seconds"] <= deadline + 2.0, ev
    assert time.monotonic() - started < 20


def test_stale_generation_is_rejected_and_cannot_corrupt_the_new_group():
    """A straggler of generation 1 dials the ports of a live generation-2 group:
    its connections are refused, it fails at once (StaleGenerationError), and the
    new group's collectives stay exact throughout."""
    size = 3
    base = free_block(size + 1)
    peers = loopback_peers(size, base=base)
    # The straggler believes in an old membership of 4 in which it was rank 3
    # (port base+3, free): it actively dials ranks 0..2 on their reused ports.
    stale_peers = peers + [("127.0.0.1", base + size)]
    group = []
    for r in range(size):
        spec = {"rank": r, "size": size, "generation": 2, "peers": peers, "timeout": 30,
                "connect_timeout": 20,
                "script": [{"op": "connect"}, {"op": "allreduce_loop", "seconds": 4.0},
                           {"op": "collectives", "elements": 100}, {"op": "close"}]}
        group.append(start_worker(spec, timeout=60))
    stale = start_worker({"rank": size, "size": size + 1, "generation": 1, "peers": stale_peers,
                          "timeout": 5, "connect_timeout": 3.0,
                          "script": [{"op": "expect_connect_error"}]}, timeout=30)
    stale.wait()
    group = [w.wait() for w in group]
    _ok(group)
    for w in group:
        assert w.event("loop_done")["count"] > 0
    rejected = sum(w.event("closed")["rejected"] for w in group)
    assert rejected > 0, "no stale connection reached the new group"
    ev = stale.event("connect_error")
    # A member's refusal names generation 2: the straggler knows at once that it is
    # stale (Gloo patch 0014) instead of retrying until its deadline.
    assert ev["type"] == "StaleGenerationError", ev
    assert ev["seconds"] < 3.0, ev
    assert "expects generation 2, newer than this rank's 1" in ev["message"], ev["message"]


def test_rebuild_with_new_membership_on_the_same_ports():
    """Generation 1 of four processes; one is killed; the three survivors abort,
    then rebuild generation 2 in the same processes with a different rank order
    on the same ports (each process now binds a port another process held), and
    run collectives again."""
    size = 4
    peers = loopback_peers(size)
    survivors = [0, 1, 2]
    new_peers = peers[:3]
    workers = []
    for r in range(size):
        script = [{"op": "connect"}, {"op": "collectives", "elements": 50}, {"op": "ready"}]
        if r in survivors:
            new_rank = 2 - r          # reversed order: old rank 2 binds old rank 0's port
            script += [
                {"op": "expect_error", "elements": 1 << 18, "repeat": True},
                {"op": "abort", "reason": "rank 3 died"}, {"op": "close"},
                {"op": "connect", "rank": new_rank, "size": 3, "generation": 2, "peers": new_peers},
                {"op": "collectives", "elements": 50}, {"op": "close"},
            ]
        else:
            script += [{"op": "sleep", "seconds": 60}]
        spec = {"rank": r, "size": size, "generation": 1, "peers": peers, "timeout": 30,
                "connect_timeout": 20, "script": script}
        workers.append(start_worker(spec, timeout=90))
    victim = workers[3]
    for w in workers:
        w.read_event("ready", timeout=60)
    time.sleep(0.5)
    victim.proc.kill()
    for w in workers[:3]:
        w.wait()
    victim.wait()
    for w in workers[:3]:
        assert w.proc.returncode == 0, w.describe()
        err = w.event("op_error")
        assert err["type"] in ("PeerError", "AbortedError"), err
        assert err["after_start"] < 10, err
        done = [e for e in w.events if e["event"] == "collectives_ok"]
        assert [e["generation"] for e in done] == [1, 2], w.describe()
        assert done[-1]["rank"] == 2 - w.rank


@pytest.mark.parametrize("end", ["abort", "close"])
def test_200_init_abort_cycles_without_address_in_use(end):
    """200 cycles of storeless init, allreduce and abort (or graceful close) on
    the same ports, one generation per cycle: never an 'address in use' error,
    never a connect failure.  With graceful close every result is exact; with
    abort a rank may reset a slower peer's last read (counted, see the worker)."""
    size = 3
    workers = run_group(size, [{"op": "cycles", "count": 200, "end": end}], timeout=120,
                        connect_timeout=30)
    for w in workers:
        assert w.proc.returncode == 0, w.describe()
        ev = w.event("cycles_ok")
        assert "in use" not in w.out + w.err
        if end == "close":
            assert ev["raced"] == 0
        else:
            assert ev["raced"] < 100, ev
