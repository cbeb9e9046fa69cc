"""Stripe a large collective over k connections per peer pair (a long fat pipe's remedy).

One TCP connection moves at most its window per round trip: on a link with a large
bandwidth-delay product (a WAN, a congested or lossy path) a single stream cannot fill it,
whatever the bandwidth.  PCCL stripes each transfer over several connections; hpct does it
with k groups over the same ranks, each with its own connections and its own worker thread,
so k stripes of one tensor travel at once.

    sg = StripedGroup(k=4)                   # k hpct groups over the default group's ranks
    sg.all_reduce(tensor)                    # k concurrent all_reduces of 1/k of the bytes
    sg.broadcast(tensor, src=0)

Every member must create the StripedGroup at the same point (it calls ``new_group`` k
times).  The result is identical on every member; it can differ in the last bits from an
unstriped all_reduce of a floating tensor (another summation split), as two world sizes do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import HpctArgumentError

MAX_STRIPES = 64


class StripedGroup:
    def __init__(self, k: int, ranks: list[int] | None = None, backend: str | None = None):
        if not isinstance(k, int) or not 1 <= k <= MAX_STRIPES:
            raise HpctArgumentError(f"StripedGroup: k={k!r} must be an integer from 1 to {MAX_STRIPES}",
                                    fix="pass the number of connections per peer pair, e.g. k=4")
        self.k = k
        self.groups = [dist.new_group(ranks, backend=backend) for _ in range(k)]

    def _stripes(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if not tensor.is_contiguous():
            raise HpctArgumentError("StripedGroup: the tensor must be contiguous (stripes are views of it)",
                                    fix="pass tensor.contiguous() and copy the result back")
        flat = tensor.view(-1)
        step = -(-flat.numel() // self.k)
        return [flat[i:i + step] for i in range(0, flat.numel(), step)] or [flat]

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        works = [dist.all_reduce(s, op=op, group=g, async_op=True)
                 for s, g in zip(self._stripes(tensor), self.groups)]
        for w in works:
            w.wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        works = [dist.broadcast(s, src=src, group=g, async_op=True)
                 for s, g in zip(self._stripes(tensor), self.groups)]
        for w in works:
            w.wait()
        return tensor

    def destroy(self) -> None:
        for g in self.groups:
            dist.destroy_process_group(g)
        self.groups = []
