"""Argument checks of the hpct process group, made at the call (before anything is queued).

A call that ProcessGroupGloo refuses is refused here too, with an ``HpctArgumentError``
(a RuntimeError, as torch's backends raise, and a ValueError) whose message starts with
the phrase Gloo uses for the same problem, so code and tests written against Gloo match
it, then says what was given and what is needed.  A form hpct does not implement is
refused the same way: never run with a different meaning.
"""

from __future__ import annotations

import torch


class HpctArgumentError(RuntimeError, ValueError):
    """A collective was called with arguments the hpct backend refuses; nothing was sent."""


def fail(op: str, problem: str, fix: str) -> None:
    raise HpctArgumentError(f"hpct {op}: {problem}; {fix}")


def root_rank(op: str, root: int, size: int) -> None:
    if not 0 <= root < size:
        fail(op, f"invalid root rank {root}", f"pass a rank from 0 to {size - 1} (the group has {size})")


def root_tensor(op: str, index: int, count: int) -> None:
    if not 0 <= index < count:
        fail(op, f"invalid root tensor {index}",
             f"the tensor list has {count} tensor(s): pass an index from 0 to {max(count - 1, 0)}")


def nonempty(op: str, tensors, what: str = "tensor list") -> None:
    if len(tensors) == 0:
        fail(op, f"requires non-empty {what}", "pass at least one tensor")


def single(op: str, items, what: str) -> None:
    if len(items) != 1:
        fail(op, f"requires a single-element {what}",
             f"got {len(items)} element(s); pass a list holding exactly one")


def dense(op: str, tensors) -> None:
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            fail(op, f"invalid tensor layout at index {i} ({t.layout})",
                 "pass dense (strided) tensors; only all_reduce with SUM takes sparse COO tensors")


def cpu(op: str, tensors) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            fail(op, f"unsupported device type {t.device.type}",
                 "the hpct backend handles CPU tensors only: move the tensor to the CPU, or use NCCL "
                 "for GPU tensors")


def like(op: str, tensors, ref: torch.Tensor, start: int = 0) -> None:
    """Every tensor has ``ref``'s dtype and shape (Gloo's 'invalid tensor type/size')."""
    for i, t in enumerate(tensors, start):
        if t.dtype != ref.dtype:
            fail(op, f"invalid tensor type at index {i}: {t.dtype}, expected {ref.dtype}",
                 "pass tensors of one dtype")
        if t.shape != ref.shape:
            fail(op, f"invalid tensor size at index {i}: {tuple(t.shape)}, expected {tuple(ref.shape)}",
                 "pass tensors of one shape")


def list_size(op: str, got: int, want: int, which: str) -> None:
    if got != want:
        fail(op, f"Incorrect {which} list size {got}. {which.capitalize()} list size should be {want}",
             f"pass one tensor per rank of the group ({want})")
