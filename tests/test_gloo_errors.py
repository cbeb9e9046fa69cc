"""hpct._gloo's exceptions: one hierarchy with hpct.errors, and each typed condition
provoked for real on loopback (kernel-chosen ports) and checked by its Python type.

The extension classifies Gloo's C++ exceptions by type and errno only (Gloo patch 0017:
TimeoutException, BindException), never by message text; these tests fail if a
condition reaches Python as another type.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from pathlib import Path

import pytest

import hpct._gloo as gloo
from hpct.errors import EXIT_CODES, HpctError, TransportError
from gloo_helpers import loopback_peers

LIMIT_S = 20.0     # every thread below is joined within this; every expected failure is far quicker


# --- the hierarchy -----------------------------------------------------------------------------

# Each extension type and its direct bases, as the backend and training code catch them.
BASES = {
    "GlooError": (TransportError,),
    "AbortedError": ("GlooError",),
    "ConnectTimeoutError": ("GlooError", TimeoutError),
    "PeerError": ("GlooError", ConnectionError),
    "OpTimeoutError": ("PeerError", TimeoutError),
    "AddressInUseError": ("GlooError", OSError),
    "StaleGenerationError": ("GlooError",),
    "PeerLeftError": ("PeerError",),
}


@pytest.mark.unit
def test_the_extension_carries_no_build_machine_path():
    # -ffile-prefix-map at Gloo's build: a build path in the binary leaks into every message
    # and makes two builds of the same series differ.
    blob = Path(gloo.__file__).read_bytes()
    assert b"third_party/patched/gloo-" not in blob
    assert b"gloo-5354032/gloo/transport/tcp/" in blob


@pytest.mark.unit
def test_the_extension_root_is_an_hpct_transport_error():
    assert issubclass(gloo.GlooError, HpctError)
    assert issubclass(gloo.GlooError, TransportError)
    assert issubclass(gloo.GlooError, RuntimeError)     # torch's backends raise RuntimeError
    assert gloo.GlooError.exit_code == TransportError.exit_code == EXIT_CODES["TransportError"]
    assert gloo.IoError is gloo.PeerError


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(BASES))
def test_each_type_keeps_its_builtin_bases(name):
    cls = getattr(gloo, name)
    want = tuple(getattr(gloo, b) if isinstance(b, str) else b for b in BASES[name])
    assert cls.__bases__ == want
    assert cls.__module__ == "hpct._gloo" and cls.__name__ == name
    assert issubclass(cls, HpctError)
    # An instance made as the translator makes it (one message) reads as that message.
    err = cls("the message")
    assert str(err) == "the message" and err.problem == "the message" and err.fix is None


# --- each condition, provoked -----------------------------------------------------------------


def _connected_pair(*, lazy: bool, timeout: float):
    peers = loopback_peers(2)
    out: list = [None, None]
    errors: list = []

    def make(r):
        try:
            out[r] = gloo.Context(r, 2, 1, peers, timeout=timeout, connect_timeout=10.0, lazy=lazy)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in range(2)]
    [t.start() for t in threads]
    [t.join(LIMIT_S) for t in threads]
    assert not errors and all(out), errors
    return out


def _close(*ctxs):
    for c in ctxs:
        if c is not None:
            c.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("lazy", [False, True], ids=["mesh", "lazy"])
def test_op_timeout_is_op_timeout_error_for_this_op_and_the_next(lazy):
    a, b = _connected_pair(lazy=lazy, timeout=0.5)
    try:
        if lazy:   # connect the pair first, so that the wait below is the op's alone
            got = bytearray(4)
            t = threading.Thread(target=lambda: b.recv(got, 0), daemon=True)
            t.start()
            a.send(bytearray(b"ping"), 1)
            t.join(LIMIT_S)
            assert got == b"ping"
        started = time.monotonic()
        with pytest.raises(gloo.OpTimeoutError) as first:
            a.recv(bytearray(4), 1)       # rank 1 never sends
        assert 0.4 < time.monotonic() - started < 5.0
        assert isinstance(first.value, TimeoutError) and isinstance(first.value, TransportError)
        assert "500ms for recv operation" in str(first.value)
        # Gloo's source location names the tree by version, not the build machine's path.
        assert "[gloo-5354032/gloo/transport/tcp/" in str(first.value)
        assert "third_party/patched" not in str(first.value)
        # The op timeout closed every pair of the context: the next op fails at once, with the
        # same type (the pair's failure keeps its kind), not as a lost peer.
        started = time.monotonic()
        with pytest.raises(gloo.OpTimeoutError) as later:
            a.allreduce(bytearray(4), dtype="float32")
        assert time.monotonic() - started < 2.0
        assert "peer rank 1" in str(later.value)
        # The peer saw a connection closed under it: a lost peer, not a timeout of its own.
        with pytest.raises(gloo.PeerError) as peer:
            b.recv(bytearray(4), 0)
        assert not isinstance(peer.value, gloo.OpTimeoutError)
        assert "peer rank 0" in str(peer.value)
    finally:
        _close(a, b)


@pytest.mark.multiprocess
def test_a_p2p_wait_that_times_out_is_op_timeout_error():
    a, b = _connected_pair(lazy=False, timeout=30.0)
    try:
        req = a.irecv(bytearray(4), 1)
        started = time.monotonic()
        with pytest.raises(gloo.OpTimeoutError) as err:
            req.wait(timeout=0.3)
        assert time.monotonic() - started < 5.0
        assert "300ms" in str(err.value)
    finally:
        _close(a, b)


@pytest.mark.unit
@pytest.mark.parametrize("retry", [0.2, 0.0], ids=["retried", "no-retry"])
def test_a_port_held_by_another_socket_is_address_in_use_error(retry):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        other = loopback_peers(1)[0]
        started = time.monotonic()
        with pytest.raises(gloo.AddressInUseError) as err:
            gloo.Context(0, 2, 1, [("127.0.0.1", port), other], connect=False,
                         bind_retry_timeout=retry)
        assert time.monotonic() - started < retry + 5.0
    e = err.value
    assert isinstance(e, OSError) and e.errno == errno.EADDRINUSE
    assert isinstance(e, TransportError)
    message = str(e)
    assert f"127.0.0.1]:{port} (port {port})" in message
    assert ("retried for 200 ms" in message) == (retry > 0)


@pytest.mark.unit
def test_a_listen_address_not_on_this_machine_is_gloo_error_not_address_in_use():
    other = loopback_peers(1)[0]
    with pytest.raises(gloo.GlooError) as err:   # 192.0.2.0/24 is TEST-NET-1: never local
        gloo.Context(0, 2, 1, [("192.0.2.1", other[1]), other], connect=False)
    assert not isinstance(err.value, gloo.AddressInUseError)
    assert "192.0.2.1" in str(err.value)


@pytest.mark.multiprocess
def test_abort_is_aborted_error_with_its_reason():
    a, b = _connected_pair(lazy=False, timeout=30.0)
    try:
        box: dict = {}

        def wait():
            try:
                a.recv(bytearray(4), 1)
            except BaseException as err:  # noqa: BLE001
                box["error"] = err
        t = threading.Thread(target=wait, daemon=True)
        t.start()
        time.sleep(0.3)
        a.abort("membership changed")
        t.join(LIMIT_S)
        assert not t.is_alive()
        err = box.get("error")
        assert type(err) is gloo.AbortedError, box
        assert "Gloo context aborted: membership changed" in str(err)
        with pytest.raises(TransportError, match="membership changed"):
            a.allreduce(bytearray(4), dtype="float32")
    finally:
        _close(a, b)


@pytest.mark.unit
def test_a_missing_peer_is_connect_timeout_error_naming_it():
    peers = loopback_peers(2)
    started = time.monotonic()
    with pytest.raises(gloo.ConnectTimeoutError) as err:
        gloo.Context(0, 2, 1, peers, connect_timeout=0.5)
    assert time.monotonic() - started < 5.0
    assert isinstance(err.value, TimeoutError) and isinstance(err.value, TransportError)
    assert "still missing rank 1" in str(err.value)


@pytest.mark.multiprocess
def test_a_peer_that_leaves_a_forming_group_is_peer_left_error_at_once_not_the_deadline():
    """Rank 1 gave its count to rank 0 and waits for the total; rank 2 never comes; rank 0 is
    aborted (it died, or gave the generation up).  Before: rank 1 raised ConnectTimeoutError
    saying the group did not form within the deadline, and hpct run's worker took it for a rank
    that never came.  A peer that left is PeerLeftError, before the deadline, naming the rank."""
    peers = loopback_peers(3)
    ctxs = [gloo.Context(r, 3, 4, peers, connect_timeout=30.0, connect=False, lazy=True) for r in (0, 1)]
    box: dict = {}

    def connect(r):
        try:
            ctxs[r].connect()
        except BaseException as err:  # noqa: BLE001
            box[r] = (err, time.monotonic())
    threads = [threading.Thread(target=connect, args=(r,), daemon=True) for r in (0, 1)]
    try:
        [t.start() for t in threads]
        time.sleep(1.0)           # rank 1's count is with rank 0, which waits for rank 2's
        assert not box, box
        left = time.monotonic()
        ctxs[0].abort("gave generation 4 up")
        [t.join(LIMIT_S) for t in threads]
        assert not any(t.is_alive() for t in threads)
        err, at = box[1]
        assert type(err) is gloo.PeerLeftError, err
        assert isinstance(err, gloo.PeerError) and not isinstance(err, TimeoutError)
        assert at - left < 5.0                      # the deadline was 30 s away
        message = str(err)
        assert "Storeless connect of rank 1 (of 3, generation 4) failed before the group formed" in message
        assert f"waiting for rank 0 (127.0.0.1:{peers[0][1]}, the group's total)" in message
        assert "a peer left" in message and "within the connect deadline" not in message
        assert type(box[0][0]) is gloo.AbortedError
    finally:
        _close(*ctxs)


@pytest.mark.unit
def test_a_forming_group_whose_member_never_comes_is_still_connect_timeout_error():
    # The deadline case keeps its type: rank 0 waits in the count for rank 1, which never listens.
    peers = loopback_peers(2)
    started = time.monotonic()
    with pytest.raises(gloo.ConnectTimeoutError) as err:
        gloo.Context(0, 2, 1, peers, connect_timeout=0.5, lazy=True)
    assert time.monotonic() - started < 5.0
    assert not isinstance(err.value, gloo.PeerLeftError)


@pytest.mark.multiprocess
def test_set_timeout_changes_the_timeout_of_later_ops():
    # torch's _set_default_timeout / _set_pg_timeout: ops issued afterwards use the new timeout.
    a, b = _connected_pair(lazy=False, timeout=30.0)
    try:
        assert a.timeout == 30.0
        a.set_timeout(0.3)
        assert a.timeout == pytest.approx(0.3)
        started = time.monotonic()
        with pytest.raises(gloo.OpTimeoutError, match="300ms for recv operation"):
            a.recv(bytearray(4), 1)       # rank 1 never sends: 0.3 s, not the 30 s of creation
        assert time.monotonic() - started < 5.0
        with pytest.raises(ValueError, match="timeout"):
            b.set_timeout(-1.0)
    finally:
        _close(a, b)
