"""The simulated rootless ring: every rank learns every rank's address from its own and its next's.

As the patched NCCL forms a comm (nccl_rootless.h): listen on this rank's address, connect to
the next rank's (retrying until the connect deadline), then pass the addresses round the ring
(N - 1 steps) so every rank knows all of them.  The hello carries the job key and the
generation: a connection of another job or generation is refused, as the real ring refuses it.
"""

from __future__ import annotations

import json
import socket
import struct
import time


class RingError(Exception):
    """The ring could not be formed (deadline, refused peer, closed connection)."""


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def _send(sock: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise RingError("the previous rank closed the ring connection")
        buf += chunk
    return buf


def _recv(sock: socket.socket):
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    return json.loads(_recv_exact(sock, n))


def listen(addr: str) -> socket.socket:
    """The fixed-port listener of a rank (its owner closes it)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind(split_addr(addr))
        srv.listen(4)
    except OSError as err:
        srv.close()
        raise RingError(f"cannot listen on {addr}: {err}") from None
    srv.settimeout(0.05)
    return srv


def ring_addresses(rank: int, nranks: int, listen: str, nxt: str, srv, *, job_key: int, generation: int,
                   deadline: float, retry_s: float, aborted) -> list[str]:
    """Every rank's address in rank order, over ``srv`` (listening on ``listen``; the caller
    owns it); RingError at the deadline or when ``aborted()``."""
    if nranks == 1:
        return [listen]
    try:
        out = _connect(split_addr(nxt), deadline, retry_s, aborted)
        with out:
            _send(out, {"job": job_key, "gen": generation, "rank": rank})
            prev = _accept(srv, job_key, generation, (rank - 1) % nranks, deadline, aborted)
            with prev:
                prev.settimeout(max(0.1, deadline - time.monotonic()))
                book = {rank: listen}
                carry = (rank, listen)
                for _ in range(nranks - 1):
                    _send(out, carry)
                    r, addr = _recv(prev)
                    book[int(r)] = addr
                    carry = (r, addr)
                _send(out, "done")            # the next rank may close once it has read everything
                if _recv(prev) != "done":
                    raise RingError("the ring's last word was not 'done'")
    except OSError as err:
        raise RingError(f"{type(err).__name__}: {err}") from None
    return [book[r] for r in range(nranks)]


def _connect(addr, deadline: float, retry_s: float, aborted) -> socket.socket:
    while True:
        if aborted():
            raise RingError("aborted while connecting to the next rank")
        try:
            return socket.create_connection(addr, timeout=max(0.05, min(1.0, deadline - time.monotonic())))
        except OSError as err:
            if time.monotonic() + retry_s > deadline:
                raise RingError(f"could not connect to the next rank at {addr[0]}:{addr[1]} before the "
                                f"connect deadline: {err}") from None
            time.sleep(retry_s)


def _accept(srv: socket.socket, job_key: int, generation: int, want: int, deadline: float, aborted):
    while True:
        if aborted():
            raise RingError("aborted while waiting for the previous rank")
        if time.monotonic() > deadline:
            raise RingError(f"rank {want} (the previous rank) did not connect before the connect deadline")
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            hello = _recv(conn)
        except (OSError, RingError, ValueError):
            conn.close()
            continue
        if hello.get("job") != job_key or hello.get("gen") != generation or hello.get("rank") != want:
            conn.close()              # another job's, generation's or a stale rank's: refused
            continue
        return conn
