"""How long the round trips of each agent's asks to its peers take, and which node's links stand
out as slow.

Every heartbeat ask's round trip is the kernel's measure of its connection's handshake
(wire.ask_timed), not the ask's duration: an agent that a busy node schedules late answers late
over a healthy link.  An agent keeps the last ``WINDOW`` round trips per peer and tells its peers
the median of each: its pings and its answers to pings carry them (``links``).  A node is slow
when the links that touch it (asks from it and asks to it, as their askers reported them) have a
median above both the limit (``--slow-link-ms``) and ``SLOW_FACTOR`` times the median of the
links that do not touch it.  A node is judged only against links it has no part in, so a job with
two nodes never judges: either end of their one link could be the slow one.  A lossy or delayed
port lifts exactly the links through it.

Only asks that were answered are timed.  A peer that does not answer at all is the node grace's
case (membership.py), not this one: a paused agent must not lose its node sooner than the grace.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Mapping

WINDOW = 6                # answered asks per peer in a link's median: 3 s of heartbeats
MIN_SAMPLES = 3           # a link with fewer is not reported yet
SLOW_FACTOR = 4.0         # a slow node's links against the rest of the job's
SLOW_HOLD_S = 1.0         # how long a member stands out before its slot is given away


class LinkTimes:
    """This agent's answered asks, per peer."""

    def __init__(self) -> None:
        self.samples: dict[int, deque[float]] = {}

    def record(self, peer: int, seconds: float) -> None:
        self.samples.setdefault(peer, deque(maxlen=WINDOW)).append(seconds * 1e3)

    def medians(self, peers) -> dict[int, float]:
        """Milliseconds per peer still asked; a peer no longer asked is forgotten, so a node that
        comes back later is judged by new asks, not by the ones before it left."""
        peers = set(peers)
        for gone in [p for p in self.samples if p not in peers]:
            del self.samples[gone]
        return {p: round(statistics.median(s), 3) for p, s in self.samples.items() if len(s) >= MIN_SAMPLES}


def parse(raw) -> dict[int, float]:
    """A peer's ``links`` as it came over the wire (JSON makes the keys strings); junk is dropped."""
    if not isinstance(raw, dict):
        return {}
    out = {}
    for key, value in raw.items():
        try:
            node, ms = int(key), float(value)
        except (TypeError, ValueError):
            continue
        if ms >= 0:
            out[node] = ms
    return out


def slow_nodes(reports: Mapping[int, Mapping[int, float]], limit_ms: float) -> dict[int, tuple[float, float]]:
    """``reports``: asker -> {peer: median ms}.  Each node whose links stand out, with its links'
    median and the median of the links it has no part in."""
    if limit_ms <= 0:
        return {}
    links = [(a, b, ms) for a, row in reports.items() for b, ms in row.items() if a != b]
    mine: dict[int, list[float]] = {}
    for a, b, ms in links:
        mine.setdefault(a, []).append(ms)
        mine.setdefault(b, []).append(ms)
    slow = {}
    for n in sorted(mine):
        own = statistics.median(mine[n])
        if own <= limit_ms:
            continue            # the many healthy nodes: no pass over the whole job's links for them
        rest = [ms for a, b, ms in links if n not in (a, b)]
        if rest and own > SLOW_FACTOR * (others := statistics.median(rest)):
            slow[n] = (round(own, 1), round(others, 1))
    return slow
