"""Which pairs of ranks measure their link, and in which round.

A round holds disjoint pairs only, so every pair of a round runs at once and no rank serves
two links at the same time.  The circle method gives N-1 rounds for N members (N rounds for
odd N, one member resting in each): a 64-node matrix is 63 rounds of 32 pairs.

Ranks are placed as the port plan places them: global rank r is local rank r % P of node
r // P.  By default the inter-node matrix pairs each node's local rank 0; ``all_local``
pairs every local rank with its counterpart on the other node (a NIC per GPU is used that
way).  Within each node every pair of local ranks is measured too, all nodes at once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """One measured link: global ranks ``a`` < ``b``; ``kind`` is "inter" or "intra"."""

    a: int
    b: int
    kind: str

    @property
    def key(self) -> str:
        return f"{self.a}-{self.b}"


def tournament(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs covering every pair of 0..n-1 exactly once (circle method)."""
    if n < 2:
        return []
    ring = list(range(n)) + ([None] if n % 2 else [])
    m = len(ring)
    rounds = []
    for _ in range(m - 1):
        pairs = [(ring[i], ring[m - 1 - i]) for i in range(m // 2)]
        rounds.append([tuple(sorted(p)) for p in pairs if None not in p])
        ring = [ring[0], ring[-1], *ring[1:-1]]       # keep the first, turn the rest
    return rounds


def inter_rounds(nodes: int, nproc: int, all_local: bool = False) -> list[list[Link]]:
    """Rounds of node-to-node links: local rank 0 of each node, or every local rank with its
    counterpart (``all_local``: the pairs of one node pair share a round)."""
    locals_ = range(nproc) if all_local else range(1)
    return [[Link(x * nproc + l, y * nproc + l, "inter") for x, y in pairs for l in locals_]
            for pairs in tournament(nodes)]


def intra_rounds(nodes: int, nproc: int) -> list[list[Link]]:
    """Rounds of links between the local ranks of a node, every node in the same rounds."""
    return [[Link(n * nproc + x, n * nproc + y, "intra") for n in range(nodes) for x, y in pairs]
            for pairs in tournament(nproc)]


def serial(rounds: list[list[Link]]) -> list[list[Link]]:
    """The same links, one per round (``--serial``, and suspects measured again alone)."""
    return [[link] for links in rounds for link in links]


def partner(links: list[Link], rank: int) -> tuple[Link, bool] | None:
    """This rank's link in a round and whether it leads (the lower rank), or None."""
    for link in links:
        if rank in (link.a, link.b):
            return link, rank == link.a
    return None
