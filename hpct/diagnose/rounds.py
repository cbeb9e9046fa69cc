"""Rounds of links measured at once, and what rank 0 knows when one of them never ends.

After each round every rank reports its measured links to rank 0, and rank 0 lets the next
round start only when all have reported: a barrier that knows who it waits for.  So rank 0
holds the matrix measured so far, and when the deadline passes (a link slower than the
probes' bounds assume, a rank stopped or gone) it names the ranks that never reported and the
links they were measuring, and still has every earlier round's numbers to print.
"""

from __future__ import annotations

import json
import struct

import torch

from ..distributed.backend import ops
from ..errors import DiagnoseTimeout
from . import links as measuring
from .schedule import Link, partner

REPORT_LEN, REPORT, RELEASE = 111, 112, 113       # tags of the round reports


class Partial:
    """What rank 0 has measured so far, for the report a timeout still prints."""

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}
        self.rounds: list[str] = []          # the rounds that ended, by label
        self.doing = "connecting"
        self.settings: list = []             # every rank's settings, once gathered
        self.matrix_s = 0.0                  # the node-to-node rounds' time
        self.planned: dict[str, int] = {}    # rounds planned, by kind of link


def _bytes(value) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _report(ctx, rows: dict, deadline: float, what: str) -> None:
    data = _bytes(rows)
    size = torch.frombuffer(bytearray(struct.pack("<q", data.numel())), dtype=torch.uint8)
    for t, tag in ((size, REPORT_LEN), (data, REPORT)):
        measuring.wait(ops.isend_(ctx, t, 0, tag)[0], deadline, what, 0)
    go = torch.zeros(1, dtype=torch.uint8)
    measuring.wait(ops.irecv_(ctx, go, 0, RELEASE)[0], deadline, f"waiting for rank 0 to end {what}", 0)


def _collect(ctx, rows: dict, deadline: float, what: str, links: list[Link], partial: Partial) -> None:
    """Rank 0: every rank's rows of the round into ``partial``, then the release; a
    DiagnoseTimeout naming the ranks that never reported (and their links) when the deadline
    passes first (the rows of those that did report are kept)."""
    others = range(1, ctx.size)
    sizes = {q: torch.zeros(8, dtype=torch.uint8) for q in others}
    posted = {q: ops.irecv_(ctx, sizes[q], q, REPORT_LEN)[0] for q in others}
    missing = []
    partial.rows |= rows
    for q in others:
        try:
            measuring.wait(posted[q], deadline, what, q)
            data = torch.zeros(struct.unpack("<q", measuring.raw(sizes[q]))[0], dtype=torch.uint8)
            measuring.wait(ops.irecv_(ctx, data, q, REPORT)[0], deadline, what, q)
            partial.rows |= json.loads(measuring.raw(data).decode())
        except DiagnoseTimeout:
            missing.append(q)
    if missing:
        busy = [f"link {l.key}" for l in links if l.a in missing or l.b in missing]
        raise DiagnoseTimeout(
            f"{what} did not end: rank{'s' * (len(missing) != 1)} {', '.join(map(str, missing))} never "
            f"reported" + (f" ({', '.join(busy)} still being measured)" if busy else ""),
            fix="raise --timeout, or look at those ranks' hosts and their link")
    one = torch.zeros(1, dtype=torch.uint8)
    for req in [ops.isend_(ctx, one, q, RELEASE)[0] for q in others]:
        measuring.wait(req, deadline, f"releasing the ranks after {what}", 0)


def run_rounds(ctx, rank: int, rounds: list[list[Link]], sizes: measuring.Sizes, deadline: float,
               partial: Partial, progress=None, label: str = "round", warm: bool = True) -> dict[str, dict]:
    """Every round's links at once, one round after the other; what this rank measured, by key
    (rank 0 adds every rank's rows to ``partial`` as each round ends).  ``warm``: see measure."""
    mine = {}
    for i, links in enumerate(rounds):
        what = f"{label} {i + 1}/{len(rounds)}"
        if progress:
            progress(f"{what}: {len(links)} link{'s' * (len(links) != 1)}")
        role = partner(links, rank)
        now = {}
        if role is not None:
            partial.doing = f"{what}, measuring link {role[0].key}"
            got = measuring.measure(ctx, role[0], role[1], sizes, deadline, warm)
            if got is not None:
                now[role[0].key] = got
        mine |= now
        partial.doing = f"{what}, waiting for the other links"
        if rank == 0:
            _collect(ctx, now, deadline, what, links, partial)
        else:
            _report(ctx, now, deadline, what)
        partial.rounds.append(what)
    return mine


def gather_json(ctx, value) -> list:
    """Every rank's JSON-able ``value``, in rank order."""
    return [json.loads(bytes(row.tolist()).decode()) for row in ops.allgather_varlen(ctx, _bytes(value))]
