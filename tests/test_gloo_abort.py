"""abort() and failure detection of storeless Gloo contexts (patches 0003, 0007, 0008).

Multi-process cases run every rank as its own process, bounded by a timeout;
the in-process cases use threads to play the other side.
"""

from __future__ import annotations

import array
import os
import signal
import socket
import threading
import time

import pytest

import hpct._gloo as gloo
from gloo_helpers import kill_all, loopback_peers, start_worker

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("connect_mode"), pytest.mark.serial]

OP_TIMEOUT = 60.0     # every "prompt" bound below is far below this


def _group(size, script_for, *, generation=1, timeout=60.0):
    peers = loopback_peers(size)
    workers = []
    for r in range(size):
        workers.append(start_worker({"rank": r, "size": size, "generation": generation,
                                     "peers": peers, "timeout": OP_TIMEOUT, "connect_timeout": 30,
                                     "script": script_for(r)}, timeout=timeout))
    return peers, workers


def test_sigkill_during_allreduce_fails_every_survivor_promptly():
    """SIGKILL one of 4 ranks while all loop over large allreduces: every survivor
    gets a PeerError within seconds (the op timeout is 60 s) and none hangs."""
    size, victim = 4, 2
    _, workers = _group(size, lambda r: [{"op": "connect"}, {"op": "ready"},
                                         {"op": "expect_error", "elements": 1 << 18,
                                          "repeat": True}])
    try:
        for w in workers:
            w.read_event("ready", timeout=30)
        time.sleep(0.5)
        killed = time.monotonic()
        os.kill(workers[victim].proc.pid, signal.SIGKILL)
        for w in workers:
            w.wait()
        elapsed = time.monotonic() - killed
    finally:
        kill_all(workers)
    assert elapsed < 10, f"survivors took {elapsed:.1f} s to finish"
    for w in workers:
        if w.rank == victim:
            assert w.proc.returncode == -signal.SIGKILL
            continue
        assert w.proc.returncode == 0, w.describe()
        err = w.event("op_error")
        assert err["type"] == "PeerError", err
        assert "peer rank" in err["message"], err


def test_sigstopped_peer_abort_from_another_thread_unblocks_within_a_second():
    """A peer that is alive but stopped (SIGSTOP) during a collective: abort()
    from another thread returns, and the waiting op raises AbortedError, in
    under 1 s. The other survivor learns of it promptly as well."""
    size, stopped = 3, 2
    script = {0: [{"op": "connect"}, {"op": "collectives", "elements": 10}, {"op": "ready"},
                  {"op": "wait_stdin"}, {"op": "abort_after", "seconds": 1.5},
                  {"op": "expect_error", "elements": 1 << 16}, {"op": "close"}],
              1: [{"op": "connect"}, {"op": "collectives", "elements": 10}, {"op": "ready"},
                  {"op": "wait_stdin"}, {"op": "expect_error", "elements": 1 << 16},
                  {"op": "close"}],
              2: [{"op": "connect"}, {"op": "collectives", "elements": 10}, {"op": "ready"},
                  {"op": "sleep", "seconds": 120}]}
    peers = loopback_peers(size)
    workers = [start_worker({"rank": r, "size": size, "generation": 5, "peers": peers,
                             "timeout": OP_TIMEOUT, "connect_timeout": 30, "script": script[r]},
                            timeout=60, stdin=True) for r in range(size)]
    try:
        for w in workers:
            w.read_event("ready", timeout=30)
        os.kill(workers[stopped].proc.pid, signal.SIGSTOP)
        for w in workers[:2]:
            w.proc.stdin.write("go\n")
            w.proc.stdin.flush()
        for w in workers[:2]:
            w.wait()
    finally:
        kill_all(workers)
    aborting, other = workers[0], workers[1]
    for w in (aborting, other):
        assert w.proc.returncode == 0, w.describe()
    err = aborting.event("op_error")
    assert err["type"] == "AbortedError", err
    assert "test abort" in err["message"]
    assert err["after_abort_call"] < 1.0, err
    assert err["abort_call_seconds"] < 1.0, err
    assert err["after_start"] >= 1.0, err       # it really was blocked until the abort
    err = other.event("op_error")
    assert err["type"] in ("PeerError", "AbortedError"), err
    assert err["after_start"] < 10, err


# --- in-process: the other ranks are threads --------------------------------------------------


def _connect_all(size, generation=1, **kw):
    peers = loopback_peers(size)
    out = [None] * size

    def make(r):
        out[r] = gloo.Context(r, size, generation, peers, timeout=kw.get("timeout", 30.0),
                              connect_timeout=kw.get("connect_timeout", 20.0))
    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert all(out), "connect failed"
    return peers, out


def _in_thread(fn):
    box = {}

    def run():
        started = time.monotonic()
        try:
            box["result"] = fn()
        except BaseException as err:  # noqa: BLE001
            box["error"] = err
        box["seconds"] = time.monotonic() - started
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_abort_wakes_a_blocked_recv_and_is_idempotent():
    peers, (a, b) = _connect_all(2)
    try:
        t, box = _in_thread(lambda: a.recv(bytearray(16), 1, tag=3))
        time.sleep(0.3)
        started = time.monotonic()
        a.abort("stop now")
        a.abort("second call is a no-op")
        assert time.monotonic() - started < 1.0
        t.join(5)
        assert not t.is_alive()
        assert isinstance(box.get("error"), gloo.AbortedError), box
        assert "stop now" in str(box["error"])
        assert a.aborted
        # Every later operation fails at once with the same distinct error.
        with pytest.raises(gloo.AbortedError):
            a.allreduce(array.array("f", [1.0]))
        # The peer sees the reset at once and fails its next op instead of waiting.
        started = time.monotonic()
        with pytest.raises(gloo.GlooError):
            b.recv(bytearray(16), 0, tag=3)
        assert time.monotonic() - started < 5.0
    finally:
        a.close()
        b.close()


def test_abort_frees_the_listening_port_at_once():
    peers, ctxs = _connect_all(2)
    for c in ctxs:
        c.abort("free the port")
    # Both fixed ports can be bound right away (no lingering listener, no TIME_WAIT block).
    for host, port in peers:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.listen()
    for c in ctxs:
        c.close()


def test_abort_interrupts_a_connect_that_waits_for_a_missing_peer():
    peers = loopback_peers(3)
    ctx = gloo.Context(0, 3, 9, peers, connect=False, connect_timeout=60.0)
    t, box = _in_thread(ctx.connect)
    time.sleep(0.5)
    started = time.monotonic()
    ctx.abort("membership changed")
    t.join(5)
    assert not t.is_alive()
    assert time.monotonic() - started < 1.0
    assert isinstance(box.get("error"), gloo.AbortedError), box
    ctx.close()
    with socket.socket() as s:   # port released
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(peers[0])


def test_op_timeout_is_reported_as_op_timeout_error_naming_nothing_hidden():
    peers, (a, b) = _connect_all(2, timeout=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(gloo.OpTimeoutError):
            a.recv(bytearray(4), 1)
        assert time.monotonic() - started < 5.0
    finally:
        a.close()
        b.close()


def test_bad_arguments_are_value_errors():
    peers = loopback_peers(2)
    with pytest.raises(ValueError):
        gloo.Context(2, 2, 0, peers)
    with pytest.raises(ValueError):
        gloo.Context(0, 2, 0, peers[:1])
    with pytest.raises(ValueError):
        gloo.Context(0, 2, 2 ** 31, peers)
    assert issubclass(gloo.AbortedError, gloo.GlooError)
    assert issubclass(gloo.ConnectTimeoutError, TimeoutError)
    assert issubclass(gloo.PeerError, ConnectionError)
    assert gloo.IoError is gloo.PeerError
