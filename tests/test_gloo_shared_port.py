"""Many storeless contexts of one process on one listening port (patch 0018).

Each rank listens on one port for every group; the group key in the handshake routes a
connection to its group.  Both ranks run in this process (one thread each), each on its
own port, so every context of a rank shares that rank's device.
"""

from __future__ import annotations

import array
import socket
import threading

import pytest

import hpct._gloo as gloo
from gloo_helpers import loopback_peers

pytestmark = pytest.mark.multiprocess

LIMIT_S = 60.0


def _both(fn, size=2):
    """Run fn(rank) for every rank on its own thread; re-raise the first failure."""
    out, errors = [None] * size, []

    def body(r):
        try:
            out[r] = fn(r)
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            errors.append(err)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LIMIT_S)
    assert not any(t.is_alive() for t in threads), "a rank did not finish in time"
    if errors:
        raise errors[0]
    return out


def _contexts(peers, keys, lazy=True):
    """{key: context} per rank, connected in the same key order on every rank."""
    def make(r):
        return {k: gloo.Context(r, len(peers), 1, peers, timeout=30, connect_timeout=30,
                                lazy=lazy, group_key=k) for k in keys}
    return _both(make, len(peers))


def _bound(port: int) -> bool:
    """Whether something listens on the port (connections in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.mark.parametrize("lazy", [True, False])
def test_64_groups_share_one_port_per_rank(lazy):
    peers = loopback_peers(2)
    keys = list(range(64))
    ctxs = _contexts(peers, keys, lazy=lazy)

    def reduce_all(r):
        sums = []
        for k in keys:
            buf = array.array("d", [float(k + r)])
            ctxs[r][k].allreduce(buf)
            sums.append(buf[0])
        return sums

    sums = _both(reduce_all)
    assert sums[0] == sums[1] == [2.0 * k + 1 for k in keys]
    assert all(_bound(p) for _, p in peers)
    for r in range(2):
        for k in keys:
            ctxs[r][k].close()
    # The last group on a port gives it back.
    assert not any(_bound(p) for _, p in peers)


def test_abort_of_one_group_leaves_the_other_on_the_same_port_working():
    peers = loopback_peers(2)
    ctxs = _contexts(peers, [1, 2])
    ctxs[0][1].abort("test abort of group 1")
    with pytest.raises(gloo.AbortedError, match="test abort of group 1"):
        ctxs[0][1].allreduce(array.array("d", [1.0]))
    # The peer's group 1 learns it at its next op; group 2 on the same ports goes on.
    with pytest.raises(gloo.GlooError):
        ctxs[1][1].allreduce(array.array("d", [1.0]))
    for _ in range(3):
        bufs = _both(lambda r: (ctxs[r][2].allreduce(b := array.array("d", [r + 1.0])), b)[1])
        assert [b[0] for b in bufs] == [3.0, 3.0]
    assert all(_bound(p) for _, p in peers)          # group 2 still listens
    for r in range(2):
        ctxs[r][1].close()
        ctxs[r][2].close()
    assert not any(_bound(p) for _, p in peers)


def test_a_group_rebuilt_under_a_closed_key_connects_again():
    peers = loopback_peers(2)
    keep = _contexts(peers, [5])
    first = _contexts(peers, [7])
    for r in range(2):
        first[r][7].close()
    again = _contexts(peers, [7])
    bufs = _both(lambda r: (again[r][7].allreduce(b := array.array("d", [2.0])), b)[1])
    assert [b[0] for b in bufs] == [4.0, 4.0]
    for r in range(2):
        again[r][7].close()
        keep[r][5].close()


def test_same_key_twice_on_one_port_is_refused():
    peers = loopback_peers(2)
    first = gloo.Context(0, 2, 1, peers, connect=False, group_key=3)
    try:
        with pytest.raises(ValueError, match=r"group key 3 is already used by a live group listening "
                                             r"on 127\.0\.0\.1:\d+ .*destroy that group first"):
            gloo.Context(0, 2, 1, peers, connect=False, group_key=3 + gloo.GROUP_KEYS)
        # Another key on the same port is fine.
        gloo.Context(0, 2, 1, peers, connect=False, group_key=4).close()
    finally:
        first.close()
    assert not _bound(peers[0][1])


def test_more_ranks_than_the_sequence_number_holds_are_refused():
    big = 2 ** 20 + 1
    with pytest.raises(ValueError, match=r"size 1048577 is above the most ranks a storeless group supports"):
        gloo.Context(0, big, 1, [("127.0.0.1", 1)] * big, connect=False)
