"""Shared-state parity: find the members whose training state drifted and repair them.

``sync_state(model, optimizer)`` is a collective of the group.  Every member hashes each
tensor of its state (parameters, buffers, optimizer tensors) to 64 bits; the digests, not the
tensors, are all-gathered, so a healthy group moves 8 bytes per tensor per member.  For each
tensor the version a strict majority of members holds is the truth; a member holding another
version receives the majority's bytes point to point from one majority member (sources taken
in turn, so repairs spread), and checks them against the majority's digest.  Every member
returns the same report of what moved.

A tensor without a majority version (two members of two, or a three-way split), or members
whose state has different tensors, cannot be repaired by vote: every member raises
ParityError naming the tensor and each version's ranks, before anything moves.
Only tensors are compared; plain numbers in an optimizer's state are not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import Counter

import torch
import torch.distributed as dist

from ...errors import ParityError
from ..backend.ops import as_bytes

# torch 2.13 renamed all_gather_into_tensor (the old name warns); older torch has only that
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
DIGEST = "sha1"          # with SHA extensions ~1.5 GB/s; truncated to 64 bits per tensor
REPAIR_TAG = 0x5A17      # the repair messages' tag (pairs exchange them in one agreed order)
REPAIR_FIX = ("re-synchronise from a rank you trust: hd.broadcast_state(model, optimizer, src=RANK), "
              "or reload a checkpoint on every rank")


@dataclasses.dataclass(frozen=True)
class Move:
    """One repair: tensor ``name`` (``nbytes``) went from group rank ``src`` to ``dst``."""
    name: str
    nbytes: int
    src: int
    dst: int


@dataclasses.dataclass
class ParityReport:
    """What sync_state found and moved (the same on every member)."""
    tensors: int
    bytes_hashed: int                 # per member
    moves: list[Move]
    seconds: float

    @property
    def bytes_moved(self) -> int:
        return sum(m.nbytes for m in self.moves)

    @property
    def repaired_ranks(self) -> list[int]:
        return sorted({m.dst for m in self.moves})

    def __str__(self) -> str:
        if not self.moves:
            return (f"sync_state: {self.tensors} tensors ({self.bytes_hashed} bytes) identical on every "
                    f"member ({self.seconds:.3f} s)")
        lines = [f"sync_state: repaired {len(self.moves)} tensor copies ({self.bytes_moved} bytes) on ranks "
                 f"{self.repaired_ranks} ({self.seconds:.3f} s)"]
        lines += [f"  {m.name}: {m.nbytes} bytes, rank {m.src} -> rank {m.dst}" for m in self.moves]
        return "\n".join(lines)


def named_state(model: torch.nn.Module, optimizer=None) -> list[tuple[str, torch.Tensor]]:
    """The tensors sync_state compares, named and in one order on every member."""
    out = list(model.state_dict(keep_vars=True).items())
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                pname = names.get(id(p), f"param_groups.{gi}.{pi}")
                for key, value in sorted(optimizer.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        out.append((f"optimizer.{pname}.{key}", value))
    return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t if t.device.type == "cpu" and t.is_contiguous() else t.cpu().contiguous()


def digest(t: torch.Tensor) -> int:
    """A 64-bit digest of a tensor's bytes (bit parity: -0.0 and 0.0 differ, as they should)."""
    plain = _plain(t)
    raw = as_bytes(plain) if plain.numel() else b""
    return int.from_bytes(hashlib.new(DIGEST, raw).digest()[:8], "little", signed=True)


def _manifest(state) -> int:
    text = ";".join(f"{n}|{t.dtype}|{tuple(t.shape)}" for n, t in state).encode()
    return int.from_bytes(hashlib.new(DIGEST, text).digest()[:8], "little", signed=True)


def _gather(values: list[int], group) -> list[list[int]]:
    """Every member's ``values`` (one list per group rank)."""
    n = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.int64)
    table = torch.empty(n * len(values), dtype=torch.int64)
    _ALL_GATHER(table, mine, group=group)
    return table.view(n, len(values)).tolist()


def _versions(column: list[int]) -> str:
    by_value: dict[int, list[int]] = {}
    for rank, v in enumerate(column):
        by_value.setdefault(v, []).append(rank)
    return "; ".join(f"ranks {ranks} hold digest {v & (2**64 - 1):016x}" for v, ranks in by_value.items())


def _majority(column: list[int]) -> int | None:
    value, count = Counter(column).most_common(1)[0]
    return value if 2 * count > len(column) else None


def _plan(state, table: list[list[int]]) -> tuple[list[Move], dict[int, int]]:
    """The repairs every member computes alike from the gathered digests; raises without a majority."""
    moves, expected, hopeless = [], {}, []
    for i, (name, t) in enumerate(state):
        column = [row[i] for row in table]
        if len(set(column)) == 1:
            continue
        truth = _majority(column)
        if truth is None:
            hopeless.append(f"{name!r}: {_versions(column)}")
            continue
        good = [r for r, v in enumerate(column) if v == truth]
        bad = [r for r, v in enumerate(column) if v != truth]
        nbytes = t.numel() * t.element_size()
        for j, dst in enumerate(bad):
            moves.append(Move(name, nbytes, good[(i + j) % len(good)], dst))
        expected[i] = truth
    if hopeless:
        raise ParityError(
            f"sync_state: no majority version of {len(hopeless)} tensor(s) across {len(table)} members, "
            f"so the members holding them cannot be repaired (nothing was changed): " + " | ".join(hopeless),
            fix=REPAIR_FIX)
    return moves, expected


def _repair(state, moves: list[Move], expected: dict[int, int], group) -> None:
    rank = dist.get_rank(group)
    index = {name: i for i, (name, _) in enumerate(state)}

    def peer(r):
        return dist.get_global_rank(group, r) if group is not None else r

    works, landed = [], []
    for m in moves:          # one agreed order: each pair's messages match in turn
        i = index[m.name]
        t = state[i][1]
        if m.src == rank:
            works.append(dist.isend(_plain(t), peer(m.dst), group=group, tag=REPAIR_TAG))
        elif m.dst == rank:
            buf = t.detach()
            if not (buf.device.type == "cpu" and buf.is_contiguous()):
                buf = torch.empty(t.shape, dtype=t.dtype)
            works.append(dist.irecv(buf, peer(m.src), group=group, tag=REPAIR_TAG))
            landed.append((i, m, t, buf))
    for w in works:
        w.wait()
    for i, m, t, buf in landed:
        if buf.data_ptr() != t.data_ptr():        # received beside the tensor: load it in place
            with torch.no_grad():
                t.copy_(buf)
        if digest(t) != expected[i]:
            raise ParityError(f"sync_state: tensor {m.name!r} received from rank {m.src} does not match the "
                              "majority's digest (corrupted in transit, or changed meanwhile)",
                              fix="call sync_state again with no other thread writing the state")


def sync_state(model: torch.nn.Module, optimizer=None, group=None) -> ParityReport:
    """Make every member's state bit-identical to the majority's; returns what moved.

    A collective of ``group`` (default: the world): every member calls it at the same step.
    Raises ParityError, on every member and before anything moves, when a tensor has no
    majority version or members hold different tensors (names, dtypes, shapes).
    """
    t0 = time.perf_counter()
    state = named_state(model, optimizer)
    heads = _gather([_manifest(state), len(state)], group)
    if len({tuple(h) for h in heads}) > 1:
        raise ParityError(
            "sync_state: members hold different tensors (names, dtypes or shapes differ): "
            + _versions([h[0] for h in heads]) + "; nothing was changed",
            fix="give every member the same model and optimizer (an optimizer that has not stepped yet "
                "has no state) or " + REPAIR_FIX)
    digests = [digest(t) for _, t in state]
    table = _gather(digests, group) if state else [[] for _ in heads]
    moves, expected = _plan(state, table)
    if moves:
        _repair(state, moves, expected, group)
    return ParityReport(tensors=len(state), bytes_hashed=sum(t.numel() * t.element_size() for _, t in state),
                        moves=moves, seconds=time.perf_counter() - t0)
