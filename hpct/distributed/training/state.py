"""Re-synchronising training state after a recovery: pick a healthy rank, broadcast from it."""

from __future__ import annotations

import io

import torch
import torch.distributed as dist

from ..backend.ops import to_bytes

# Steps a state may have reached: key * world size stays far inside int64 up to 2**20 ranks.
_PROGRESS_LIMIT = 1 << 40


def healthy_source(healthy: bool, group=None, progress: int | None = None) -> int:
    """The lowest rank that calls with ``healthy=True`` (every rank of ``group`` must call).

    ``progress`` (the step a rank's state has reached) picks, among the healthy ranks, the lowest
    of those furthest on.  A peer lost at the end of a collective can let some ranks finish the
    step while others fail it: taking the furthest state means nobody redoes a step it already
    took (the members' states are equal at equal steps, so any of them is as good).
    """
    n = dist.get_world_size(group)
    if progress is not None and not 0 <= progress < _PROGRESS_LIMIT:
        raise ValueError(f"healthy_source: progress {progress} is outside [0, {_PROGRESS_LIMIT}): "
                         "pass the step count of this rank's state")
    # One MIN all-reduce orders by (furthest progress, lowest rank); a key past every healthy one
    # marks "not healthy".
    ahead = _PROGRESS_LIMIT - 1 - (progress or 0)
    mine = torch.tensor([ahead * n + dist.get_rank(group) if healthy else _PROGRESS_LIMIT * n],
                        dtype=torch.int64)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=group)
    key = int(mine.item())
    if key >= _PROGRESS_LIMIT * n:
        raise RuntimeError("no rank of the group holds a healthy state to re-synchronise from")
    return key % n


def broadcast_object(obj, src: int, group=None):
    """``obj`` from group rank ``src`` on every rank (torch.save bytes: tensors keep their bits)."""
    rank = dist.get_rank(group)
    if rank == src:
        buf = io.BytesIO()
        torch.save(obj, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    global_src = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast(size, global_src, group=group)
    if rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, global_src, group=group)
    if rank == src:
        return obj
    return torch.load(io.BytesIO(to_bytes(payload)), weights_only=False)


def broadcast_state(module: torch.nn.Module, optimizer=None, src: int = 0, extra=None, group=None):
    """Load ``module`` (and ``optimizer``) state from rank ``src`` on every rank; returns src's ``extra``.

    Parameters and buffers are loaded in place, so references held elsewhere (an optimizer,
    a DDP wrapper built later) stay valid; the values are bit-identical to the source's.
    """
    rank = dist.get_rank(group)
    obj = None
    if rank == src:
        obj = {"model": module.state_dict(),
               "optimizer": optimizer.state_dict() if optimizer is not None else None,
               "extra": extra}
    obj = broadcast_object(obj, src, group)
    if rank != src:
        with torch.no_grad():
            module.load_state_dict(obj["model"])
        if optimizer is not None and obj["optimizer"] is not None:
            optimizer.load_state_dict(obj["optimizer"])
    return obj["extra"]
