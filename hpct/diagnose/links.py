"""Measuring links and the world's collectives over a Gloo context of hpct's own.

Only the pair's lower rank (the leader) times anything, so one clock measures each number:
latency is half the shortest round trip of small ping-pongs (a busy CPU only ever adds
to a round trip, so the shortest is the link's); bandwidth a->b is the leader's
time from posting its sends to the follower's acknowledgement; b->a is the time from the
leader's "go" to its last receive (one latency more, nothing for large transfers).  A warm-up
exchange in each direction comes first (TCP's slow start is not the link's speed).
Every wait is bounded by the run's deadline.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from ..distributed import ops
from ..errors import DiagnoseTimeout
from .schedule import Link, partner

PING, PONG, DATA, ACK, GO = 101, 102, 103, 104, 105      # tags, one per message kind


@dataclass(frozen=True)
class Sizes:
    """How much each measurement moves."""

    pings: int = 20                    # round trips for the latency
    message: int = 1 << 20             # bytes per message of a bandwidth run
    messages: int = 8                  # messages per direction
    tries: int = 3                     # bandwidth runs per direction; the best one counts
    collective: int = 4 << 20          # bytes of the world's all_reduce and all_gather


def _wait(req, deadline: float, what: str) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DiagnoseTimeout(f"{what}: the --timeout ran out while measuring it (a very slow or dead link?)",
                              fix="raise --timeout, or move fewer bytes (--bytes)")
    req.wait(left)


def _send(ctx, t, peer, tag, deadline, what):
    req, _ = ops.isend_(ctx, t, peer, tag)
    return lambda: _wait(req, deadline, what)


def _recv(ctx, t, peer, tag, deadline, what):
    req, _ = ops.irecv_(ctx, t, peer, tag)
    return lambda: _wait(req, deadline, what)


def _stream(ctx, buf, peer, n, sending, deadline, what) -> None:
    post = _send if sending else _recv
    waits = [post(ctx, buf, peer, DATA, deadline, what) for _ in range(n)]
    for w in waits:
        w()


def measure(ctx, link: Link, leads: bool, sizes: Sizes, deadline: float) -> dict | None:
    """Measure ``link`` from one end; the leader returns its numbers, the follower None."""
    peer = link.b if leads else link.a
    what = f"link {link.key}"
    small = torch.zeros(8, dtype=torch.uint8)
    buf = torch.zeros(sizes.message, dtype=torch.uint8)
    one = torch.zeros(1, dtype=torch.uint8)
    # warm-up: a ping and one message each way
    for sending in ((True, False) if leads else (False, True)):
        _stream(ctx, buf, peer, 1, sending, deadline, what)
    rtts = []
    for _ in range(sizes.pings):
        if leads:
            t0 = time.perf_counter()
            back = _recv(ctx, small, peer, PONG, deadline, what)
            _send(ctx, small, peer, PING, deadline, what)()
            back()
            rtts.append(time.perf_counter() - t0)
        else:
            _recv(ctx, small, peer, PING, deadline, what)()
            _send(ctx, small, peer, PONG, deadline, what)()
    total = sizes.message * sizes.messages
    forward = backward = float("inf")
    for _ in range(sizes.tries):      # the best try: a busy CPU only ever slows one down
        if leads:
            ack = _recv(ctx, one, peer, ACK, deadline, what)
            t0 = time.perf_counter()
            _stream(ctx, buf, peer, sizes.messages, True, deadline, what)
            ack()
            forward = min(forward, time.perf_counter() - t0)
            waits = [_recv(ctx, buf, peer, DATA, deadline, what) for _ in range(sizes.messages)]
            t0 = time.perf_counter()
            _send(ctx, one, peer, GO, deadline, what)()
            for w in waits:
                w()
            backward = min(backward, time.perf_counter() - t0)
        else:
            _stream(ctx, buf, peer, sizes.messages, False, deadline, what)
            _send(ctx, one, peer, ACK, deadline, what)()
            _recv(ctx, one, peer, GO, deadline, what)()
            _stream(ctx, buf, peer, sizes.messages, True, deadline, what)
    if not leads:
        return None
    return {"a": link.a, "b": link.b, "kind": link.kind, "latency_us": round(min(rtts) / 2 * 1e6, 1),
            "bw_ab_MBps": round(total / forward / 1e6, 1), "bw_ba_MBps": round(total / backward / 1e6, 1)}


def run_rounds(ctx, rank: int, rounds: list[list[Link]], sizes: Sizes, deadline: float,
               progress=None, label: str = "round") -> dict[str, dict]:
    """Every round's links at once, a barrier between rounds; what this rank measured, by key."""
    mine = {}
    for i, links in enumerate(rounds):
        if progress:
            progress(f"{label} {i + 1}/{len(rounds)}: {len(links)} link{'s' * (len(links) != 1)}")
        role = partner(links, rank)
        if role is not None:
            got = measure(ctx, role[0], role[1], sizes, deadline)
            if got is not None:
                mine[role[0].key] = got
        ctx.barrier()
    return mine


def gather_json(ctx, value) -> list:
    """Every rank's JSON-able ``value``, in rank order."""
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    return [json.loads(bytes(row.tolist()).decode()) for row in ops.allgather_varlen(ctx, data)]


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
