"""Measuring one link, and the world's collectives, over a Gloo context of hpct's own.

Only the pair's lower rank (the leader) times anything, so one clock measures each number.
Every probe is bounded in time, not in bytes: a link far slower than the rest (a dying cable, a
misnegotiated port) is then a finding, "0.3 MB/s in 110 ms", instead of a transfer that outlasts
the run's deadline.  Latency is half the shortest round trip of at most ``pings`` small
ping-pongs within ``ping_window_s`` (a busy CPU only ever adds to a round trip).  A bandwidth run
streams chunks for ``window_s``: the first is ``first_chunk`` bytes and the next ones double (up
to ``message``) while a chunk takes under an eighth of the window; the receiver acknowledges
each chunk and at most two are unacknowledged, so no more than two chunks are in flight when the
window closes, whatever the socket buffers would hold.  a->b is the leader's time from its first
send to the last acknowledgement, b->a from its "go" to the last chunk it received, each less
the time either end's threads waited for a CPU (the kernel's schedstat): on a busy or shared
host a prober that is not running is not a slow link.  A short stream each way comes first
(TCP's slow start is not the link's speed).  Every wait is bounded by the deadline, and a wait
that ends otherwise is a DiagnoseTimeout naming what it waited for.
"""

from __future__ import annotations

import collections
import os
import struct
import time
from dataclasses import dataclass

import torch

from ..distributed.backend import ops
from ..errors import DiagnoseTimeout, TransportError
from .schedule import Link

PING, PONG, DATA, ACK, GO, HEAD, WAIT = 101, 102, 103, 104, 105, 106, 107   # tags, one per message kind


@dataclass(frozen=True)
class Sizes:
    """How long, and how much at most, each measurement moves."""

    pings: int = 20                    # round trips for the latency, at most
    ping_window_s: float = 0.03        # ... and at most this long (3 round trips at least)
    window_s: float = 0.1              # each bandwidth run streams this long
    first_chunk: int = 4 << 10         # a run's first chunk
    message: int = 1 << 20             # the largest chunk
    budget: int = 8 << 20              # a run ends after this many bytes even inside its window
    tries: int = 1                     # bandwidth runs per direction; the best one counts
    warm_s: float = 0.01               # the stream each way before anything is timed
    collective: int = 4 << 20          # bytes of the world's all_reduce and all_gather


def wait(req, deadline: float, what: str, peer: int) -> None:
    """Wait for ``req`` until ``deadline``; anything but its completion is a DiagnoseTimeout."""
    try:
        req.wait(max(deadline - time.monotonic(), 1e-3))
    except TimeoutError:
        raise DiagnoseTimeout(f"the --timeout ran out while {what} (waiting for rank {peer})",
                              fix="see rank 0's output; raise --timeout") from None
    except TransportError as err:
        raise DiagnoseTimeout(f"the connections broke while {what} (the transport said: {err})",
                              fix="a rank stopped or lost its network: its own output says why") from None


def _send(ctx, t, peer, tag, deadline, what):
    req, _ = ops.isend_(ctx, t, peer, tag)
    return lambda: wait(req, deadline, what, peer)


def _recv(ctx, t, peer, tag, deadline, what):
    req, _ = ops.irecv_(ctx, t, peer, tag)
    return lambda: wait(req, deadline, what, peer)


def cpu_waits() -> dict[str, int]:
    """Nanoseconds each of this process's threads has waited for a CPU (runnable, not running),
    by thread id; empty where the kernel does not say (no /proc/<pid>/task/*/schedstat)."""
    out = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass                               # a thread that just ended
    return out


def waited(since: dict[str, int], now: dict[str, int] | None = None) -> float:
    """Seconds the longest-waiting thread waited for a CPU from ``since`` to ``now`` (cpu_waits();
    ``now`` by default): the longest, not the sum, as threads that wait at once stall the process once."""
    now = cpu_waits() if now is None else now
    return max((n - since.get(tid, 0) for tid, n in now.items()), default=0) / 1e9


def _word(*values: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(struct.pack(f"<{len(values)}q", *values)), dtype=torch.uint8)


def raw(t: torch.Tensor) -> bytes:
    """A uint8 tensor's bytes without numpy (not a dependency of hpct)."""
    return bytes(t.tolist())


def _unword(t: torch.Tensor) -> tuple:
    return struct.unpack(f"<{t.numel() // 8}q", raw(t))


@dataclass(frozen=True)
class Run:
    """One direction's stream: what moved, in how long, and how long either end waited for a CPU."""

    moved: int
    seconds: float
    cpu_wait: float

    @property
    def rate(self) -> float:
        # The link can only be blamed for the time both ends could run: a prober that waited for
        # a CPU (a busy or shared host) would otherwise make a good link look slow.  The longer
        # of the two waits only: counting both would credit the link with time they overlapped.
        return self.moved / max(self.seconds - self.cpu_wait, 0.1 * self.seconds, 1e-9)


def _send_stream(ctx, buf, peer, window: float, sizes: Sizes, deadline, what) -> Run:
    """Chunks for ``window`` seconds (or ``sizes.budget`` bytes), each announced by a header
    and acknowledged by the receiver (with its CPU wait so far), then a closing header that
    carries this end's CPU wait; the run as this end saw it."""
    acks = [torch.zeros(8, dtype=torch.uint8) for _ in range(2)]
    pending: collections.deque = collections.deque()
    since = cpu_waits()
    t0 = last = time.perf_counter()
    sent = acked = 0
    size = sizes.first_chunk
    theirs = 0

    def settle() -> None:
        nonlocal acked, last, size, theirs
        done, chunk, ack = pending.popleft()
        done()
        now = time.perf_counter()
        if now - last < sizes.window_s / 8:
            size = min(2 * size, sizes.message)
        acked, last, theirs = acked + chunk, now, _unword(ack)[0]

    while time.perf_counter() - t0 < window and sent < sizes.budget:
        ack = acks[len(pending)]
        pending.append((_recv(ctx, ack, peer, ACK, deadline, what), size, ack))
        _send(ctx, _word(size, 0), peer, HEAD, deadline, what)()
        _send(ctx, buf[:size], peer, DATA, deadline, what)()
        sent += size
        if len(pending) == 2:
            settle()
            acks.reverse()                     # the pending one's tensor stays in place
    while pending:
        settle()
    mine = waited(since)
    _send(ctx, _word(0, int(mine * 1e9)), peer, HEAD, deadline, what)()
    return Run(acked, last - t0, max(mine, theirs / 1e9))


def _recv_stream(ctx, buf, peer, deadline, what, since: float | None = None) -> tuple[Run, float]:
    """The other end of _send_stream: (the run, with the longer CPU wait of the two ends, timed
    from ``since`` or the first header; time.perf_counter() of the last chunk)."""
    head = torch.zeros(16, dtype=torch.uint8)
    base = cpu_waits()
    got, first, last = 0, since, time.perf_counter()
    while True:
        _recv(ctx, head, peer, HEAD, deadline, what)()
        size, sender_wait = _unword(head)
        first = time.perf_counter() if first is None else first
        if size == 0:
            return Run(got, last - first, max(waited(base), sender_wait / 1e9)), last
        _recv(ctx, buf[:size], peer, DATA, deadline, what)()
        got, last = got + size, time.perf_counter()
        _send(ctx, _word(int(waited(base) * 1e9)), peer, ACK, deadline, what)()


def _latency(ctx, peer, leads: bool, sizes: Sizes, deadline, what) -> float | None:
    """Half the shortest round trip (the leader's), within the ping budget, each less the time
    either end waited for a CPU in it (a wake-up on a busy host is not the link's); the
    follower returns None.  The follower answers at once (it reads nothing in between), then
    says how long it waited for a CPU since its last answer (a word of nanoseconds, WAIT)."""
    ping = torch.zeros(8, dtype=torch.uint8)
    if not leads:
        since = cpu_waits()
        while True:
            _recv(ctx, ping, peer, PING, deadline, what)()
            if not _unword(ping)[0]:
                return None
            _send(ctx, ping, peer, PONG, deadline, what)()
            now = cpu_waits()                  # before the word: the next ping finds it waiting
            _send(ctx, _word(int(waited(since, now) * 1e9)), peer, WAIT, deadline, what)()
            since = now
    pong, theirs = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    go = _word(1)
    rtts, t_end = [], time.monotonic() + sizes.ping_window_s
    while len(rtts) < sizes.pings and (len(rtts) < 3 or time.monotonic() < t_end):
        since = cpu_waits()
        t0 = time.perf_counter()
        back = _recv(ctx, pong, peer, PONG, deadline, what)
        _send(ctx, go, peer, PING, deadline, what)()
        back()
        rtt = time.perf_counter() - t0
        mine = waited(since)
        _recv(ctx, theirs, peer, WAIT, deadline, what)()
        rtts.append(max(rtt - mine - _unword(theirs)[0] / 1e9, 0.1 * rtt))
    _send(ctx, _word(0), peer, PING, deadline, what)()
    return min(rtts) / 2


def measure(ctx, link: Link, leads: bool, sizes: Sizes, deadline: float, warm: bool = True) -> dict | None:
    """Measure ``link`` from one end; the leader returns its numbers, the follower None.
    ``warm``: stream a little each way first (not needed on a pair measured a moment ago)."""
    peer = link.b if leads else link.a
    what = f"measuring link {link.key}"
    buf = torch.zeros(sizes.message, dtype=torch.uint8)
    one = torch.zeros(1, dtype=torch.uint8)
    for sending in ((True, False) if leads else (False, True)) if warm else ():
        if sending:
            _send_stream(ctx, buf, peer, sizes.warm_s, sizes, deadline, what)
        else:
            _recv_stream(ctx, buf, peer, deadline, what)
    latency = _latency(ctx, peer, leads, sizes, deadline, what)
    forward = backward = None                     # the best try of each direction
    for _ in range(sizes.tries):      # the best try: a busy CPU only ever slows one down
        if leads:
            run = _send_stream(ctx, buf, peer, sizes.window_s, sizes, deadline, what)
            forward = run if forward is None or run.rate > forward.rate else forward
            t0 = time.perf_counter()
            _send(ctx, one, peer, GO, deadline, what)()
            run, _ = _recv_stream(ctx, buf, peer, deadline, what, since=t0)
            backward = run if backward is None or run.rate > backward.rate else backward
        else:
            _recv_stream(ctx, buf, peer, deadline, what)
            _recv(ctx, one, peer, GO, deadline, what)()
            _send_stream(ctx, buf, peer, sizes.window_s, sizes, deadline, what)
    if not leads:
        return None
    return {"a": link.a, "b": link.b, "kind": link.kind, "latency_us": round(latency * 1e6, 1),
            "bw_ab_MBps": round(forward.rate / 1e6, 2), "bw_ba_MBps": round(backward.rate / 1e6, 2),
            "window_ms": round(1e3 * max(forward.seconds, backward.seconds), 1),
            "cpu_wait_ms": round(1e3 * max(forward.cpu_wait, backward.cpu_wait), 1)}


def collective_bytes(sizes: Sizes, slowest_MBps: float | None) -> int:
    """The bytes of the world's collectives: ``sizes.collective``, or less where the slowest
    link measured would take longer than a window (a ring moves about twice the bytes over
    each link); every rank computes the same from the same links."""
    if not slowest_MBps:
        return sizes.collective
    fits = int(slowest_MBps * 1e6 * sizes.window_s / 2)
    return max(min(sizes.collective, fits), 16 << 10)


def collectives(ctx, nbytes: int, repeats: int = 3) -> dict:
    """This rank's all_reduce and all_gather bus bandwidth (MB/s) over the whole world."""
    n = ctx.size
    if n < 2:
        return {}
    t = torch.ones(max(nbytes // 4, n), dtype=torch.float32)
    part = torch.zeros(max(nbytes // n, 1), dtype=torch.uint8)
    out = {}
    for name, run, moved in (
            ("all_reduce", lambda: ops.allreduce_(ctx, t, torch.distributed.ReduceOp.SUM),
             2 * (n - 1) / n * t.numel() * 4),
            ("all_gather", lambda: ops.allgather_bytes(ctx, part), (n - 1) * part.numel())):
        run()                                            # warm-up
        ctx.barrier()
        t0 = time.perf_counter()
        for _ in range(repeats):
            run()
        out[name] = round(moved * repeats / (time.perf_counter() - t0) / 1e6, 1)
    return out
