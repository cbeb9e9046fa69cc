"""The agents' one message shape: a JSON line asked over TCP, a JSON line answered.

Agents ask each other (hello, events, membership) and workers ask their node's agent (the
new world in ``hd.recover()``) the same way, at addresses every process derives from the
port plan: node ``n``'s agent is ``hosts[n]:HPCT_AGENT_PORT``.  One request per connection
keeps both sides stateless; every call has a deadline.  Imports nothing heavy: a worker
asks before and after torch.  It sits beside the port plan, below both of its speakers: the
launcher (hpct/launch) and the library's agent link (hpct/distributed) import it, and
neither imports the other for it.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from typing import Callable

MAX_LINE = 1 << 20          # a membership of 10^5 ranks fits; anything longer is not ours


class WireError(OSError):
    """The peer could not be reached, or answered something that is not one JSON object.
    ``refused``: its host answered that nothing listens at the port (ECONNREFUSED), which a
    paused or slow agent never causes: the kernel accepts for a listener that stands still."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def ask(host: str, port: int, message: dict, timeout: float) -> dict:
    """Send ``message`` to the agent at ``host:port`` and return its answer (WireError if none)."""
    return ask_timed(host, port, message, timeout)[0]


def ask_timed(host: str, port: int, message: dict, timeout: float) -> tuple[dict, float]:
    """``ask``, and the link's round trip in seconds: the kernel's own measure of the connection's
    handshake (TCP_INFO), which neither side's load lengthens.  An agent descheduled on a busy
    node answers late, and timing the whole ask took that for a slow link: in a fault-free 4x4
    soak a node's slot moved to the spare twice ("an ask takes 23.2 ms against 5.4 ms").  Where
    the kernel tells no round trip, the whole ask's duration stands in."""
    t0 = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            rtt = _handshake_rtt(s)
            s.settimeout(timeout)
            s.sendall(json.dumps(message).encode() + b"\n")
            s.shutdown(socket.SHUT_WR)
            data = _read_line(s)
    except OSError as err:
        raise WireError(f"agent {host}:{port}: {err}", isinstance(err, ConnectionRefusedError)) from None
    try:
        reply = json.loads(data)
    except ValueError:
        raise WireError(f"agent {host}:{port} answered {data[:80]!r}, not JSON") from None
    if not isinstance(reply, dict):
        raise WireError(f"agent {host}:{port} answered {reply!r}, not an object")
    return reply, time.monotonic() - t0 if rtt is None else rtt


# struct tcp_info (linux/tcp.h) up to tcpi_rtt: 8 one-byte fields, then 16 u32s, the last tcpi_rtt (us)
_TCP_INFO_TO_RTT = struct.Struct("<8B16I")


def _handshake_rtt(s: socket.socket) -> float | None:
    """Seconds: the client's only round-trip sample just after connect() is SYN to SYN-ACK, which
    the peer's kernel answers whatever its process is doing."""
    try:
        raw = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_TO_RTT.size)
    except (AttributeError, OSError):        # no TCP_INFO on this platform
        return None
    if len(raw) < _TCP_INFO_TO_RTT.size:
        return None
    rtt_us = _TCP_INFO_TO_RTT.unpack(raw)[-1]
    return rtt_us / 1e6 if rtt_us else None


def _read_line(s: socket.socket) -> bytes:
    chunks, size = [], 0
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if b"\n" in chunk or size > MAX_LINE:
            break
    return b"".join(chunks).split(b"\n", 1)[0]


class Server:
    """Answers each connection's one request with ``handler(request) -> reply`` on its own thread
    (a worker's question may wait for the membership to change; a ping must not wait behind it)."""

    def __init__(self, host: str, port: int, handler: Callable[[dict], dict]) -> None:
        self.handler = handler
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))          # OSError: the caller names the address and the fix
        self.sock.listen(128)
        self.sock.settimeout(0.2)
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._accept, name="hpct-agent-server", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(10.0)
                request = json.loads(_read_line(conn))
                reply = self.handler(request) if isinstance(request, dict) else {"error": "not an object"}
            except (OSError, ValueError) as err:
                reply = {"error": f"bad request: {err}"}
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass              # the asker gave up (its deadline); nothing to tell

    def close(self) -> None:
        self.closed.set()
        self.sock.close()
        self.thread.join(timeout=2.0)
