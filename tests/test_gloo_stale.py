"""A process of an older generation meets a newer group (issue 13, item 6; Gloo patch 0014).

Before: the listener of a newer group closed an old-generation connection with a
bare reset.  The stale process saw "handshake read: Connection reset by peer", kept
retrying and failed only at its connect deadline; the group waiting for that rank
reported "missing rank 3 (no connection received)", however many of its connections
it had refused.  Now the listener answers with a refusal that carries its
generation: the older side fails at once with StaleGenerationError, naming the peer
and both generations, and the newer side's deadline error says which rank connected
with which generation and how many connections it refused (also
``Context.refusals``).
"""

from __future__ import annotations

import pytest

from gloo_helpers import kill_all, loopback_peers, start_worker, wait_all_succeeded

pytestmark = pytest.mark.multiprocess

NEW, OLD = 2, 1
GROUP_DEADLINE_S = 6.0      # the newer group gives up on the stale rank after this
STALE_DEADLINE_S = 25.0     # the stale rank's own deadline: it must not need it
PROMPT_S = 4.0


def _start(rank, size, peers, generation, connect_timeout):
    spec = {"rank": rank, "size": size, "generation": generation, "peers": peers, "timeout": 10,
            "connect_timeout": connect_timeout, "script": [{"op": "expect_connect_error"}]}
    return start_worker(spec, timeout=STALE_DEADLINE_S + 20)


def _run(stale_rank, size=4):
    peers = loopback_peers(size)
    workers = [_start(r, size, peers, OLD if r == stale_rank else NEW,
                      STALE_DEADLINE_S if r == stale_rank else GROUP_DEADLINE_S)
               for r in range(size)]
    wait_all_succeeded(workers)
    return peers, {w.rank: w.event("connect_error") for w in workers}


def test_stale_replacement_learns_at_once_and_the_group_names_it():
    """Ranks 0..2 at generation 2; a replacement rank 3 started with generation 1.
    Rank 3 dials ranks 0..2 and is refused: it fails at once, saying rank 0, 1 or 2
    expects generation 2.  The group's deadline error says rank 3 connected with
    generation 1, expected 2, and counts the refused connections."""
    peers, errors = _run(stale_rank=3)
    stale = errors[3]
    assert stale["type"] == "StaleGenerationError", stale
    assert stale["seconds"] < PROMPT_S, stale
    assert "expects generation 2, newer than this rank's 1" in stale["message"], stale
    assert "start it with generation 2" in stale["message"], stale
    assert stale["newer_generation"] == NEW, stale
    for r in range(3):
        err = errors[r]
        assert err["type"] == "ConnectTimeoutError", err
        msg = err["message"]
        assert f"still missing rank 3 (127.0.0.1:{peers[3][1]}" in msg, msg
        assert "rank 3 (from 127.0.0.1) connected with generation 1, expected 2 (" in msg, msg
        assert "connection refused)" in msg or "connections refused)" in msg, msg
        assert "of other generations in all" in msg, msg
        assert "no connection received" not in msg, msg


def test_stale_listener_learns_from_a_newer_connection():
    """Rank 0 (which only listens: every other rank dials it) has generation 1; ranks
    1..3 have generation 2.  Their connections tell rank 0 the group moved on: it
    fails at once.  Each of them reports at its deadline that rank 0's listener
    refused its attempts with generation 1."""
    peers, errors = _run(stale_rank=0)
    stale = errors[0]
    assert stale["type"] == "StaleGenerationError", stale
    assert stale["seconds"] < PROMPT_S, stale
    assert "connected with generation 2, newer than this rank's 1" in stale["message"], stale
    assert stale["newer_generation"] == NEW, stale
    for r in range(1, 4):
        err = errors[r]
        assert err["type"] == "ConnectTimeoutError", err
        msg = err["message"]
        assert f"still missing rank 0 (127.0.0.1:{peers[0][1]}" in msg, msg
        assert "with generation 1, expected 2" in msg, msg
        assert "its listener refused" in msg, msg


def test_refusals_are_counted_on_a_group_that_forms():
    """A group of generation 2 forms while a stale rank 3 (generation 1) dials it:
    the group's collectives are unaffected and ``Context.refusals`` records rank 3,
    its generation and how often."""
    size = 3
    peers = loopback_peers(size + 1)
    group = [start_worker({"rank": r, "size": size, "generation": NEW, "peers": peers[:size],
                           "timeout": 20, "connect_timeout": 20,
                           "script": [{"op": "connect"}, {"op": "allreduce"},
                                      {"op": "sleep", "seconds": 1.5}, {"op": "close"}]},
                          timeout=60) for r in range(size)]
    stale = start_worker({"rank": size, "size": size + 1, "generation": OLD, "peers": peers,
                          "timeout": 5, "connect_timeout": 20,
                          "script": [{"op": "expect_connect_error"}]}, timeout=60)
    try:
        for w in group + [stale]:
            w.wait()
    finally:
        kill_all(group + [stale])
    for w in group:
        assert w.proc.returncode == 0, w.describe()
        w.event("allreduce_ok")
    assert stale.event("connect_error")["type"] == "StaleGenerationError", stale.describe()
    seen = [w.event("closed") for w in group]
    hit = [c for c in seen if c["rejected"] > 0]
    assert hit, seen
    for c in hit:
        generation, count, host = c["refusals"]["3"]
        assert (generation, host) == (OLD, "127.0.0.1") and count >= 1, c
        assert count <= c["rejected"], c
