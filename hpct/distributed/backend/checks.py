"""Argument checks of the hpct process group, made at the call (before anything is queued).

A call that ProcessGroupGloo refuses is refused here too, with an ``HpctArgumentError``
(hpct/errors.py: a RuntimeError, as torch's backends raise, and a ValueError) whose message starts with
the phrase Gloo uses for the same problem, so code and tests written against Gloo match
it, then says what was given and what is needed.  A form hpct does not implement is
refused the same way: never run with a different meaning.
"""

from __future__ import annotations

import torch

from ...errors import HpctArgumentError
from . import ops


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


def device(op: str, tensors, served) -> str:
    """The one device type of ``tensors`` (cpu when none), which the group must serve."""
    types = sorted({t.device.type for t in tensors})
    if len(types) > 1:
        fail(op, f"tensors on several device types ({', '.join(types)})",
             "pass the tensors of one call on one device type")
    kind = types[0] if types else "cpu"
    if kind not in served:
        fail(op, f"unsupported device type {kind}: this group serves {', '.join(sorted(served))} tensors",
             "move the tensor to a device the group serves; CUDA tensors need a torch with CUDA and a "
             "libnccl with ncclCommInitRankRootless (`hpct doctor` says which one hpct found)")
    return kind


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


def sparse(op: str, tensors, reduce_op) -> None:
    """An all_reduce of sparse COO tensors: all sparse, alike, and summed."""
    for i, t in enumerate(tensors):
        if t.layout != torch.sparse_coo:
            fail(op, f"invalid tensor layout at index {i} ({t.layout})",
                 "pass only sparse COO tensors, or only dense ones")
    like(op, tensors[1:], tensors[0], start=1)
    if ops.op_name(reduce_op) != "sum":
        fail(op, f"unsupported reduction operation {ops.op_label(reduce_op)} for sparse tensors",
             "reduce sparse tensors with ReduceOp.SUM")


def coalesced(op: str, tensors) -> None:
    """Tensors reduced as one: one layout, one dtype, dense."""
    for i, t in enumerate(tensors):
        if t.layout != tensors[0].layout:
            fail(op, f"invalid tensor layout at index {i} ({t.layout})", "pass tensors of one layout")
        if t.dtype != tensors[0].dtype:
            fail(op, f"tensors must all have the same type (index {i} is {t.dtype}, index 0 "
                 f"{tensors[0].dtype})", "coalesce tensors of one dtype")
    if tensors[0].layout != torch.strided:
        fail(op, f"unsupported layout {tensors[0].layout}",
             "coalesce dense tensors; reduce sparse ones with all_reduce")


def allgather_lists(op: str, output_lists, inputs, size: int) -> None:
    """One output list per input, each with inputs-per-rank x size tensors."""
    if len(output_lists) != len(inputs):
        fail(op, "requires input/output tensor lists to have the same length "
             f"({len(inputs)} input(s), {len(output_lists)} output list(s))",
             "pass one output list per input tensor")
    k = len(inputs)
    for i, outs in enumerate(output_lists):
        if len(outs) != k * size:
            fail(op, f"invalid output tensor list at index {i}: {len(outs)} tensors",
                 f"each output list needs {k * size} (inputs per rank x group size)")


def coalesced_outputs(op: str, output_lists, inputs) -> None:
    """allgather_coalesced: every rank's output list matches the inputs one for one."""
    for outs in output_lists:
        if len(outs) != len(inputs):
            fail(op, f"invalid output tensor list: {len(outs)} tensors for {len(inputs)} inputs",
                 "give every rank's output list one tensor per input")
        for i, (dst, src) in enumerate(zip(outs, inputs)):
            if dst.dtype != src.dtype:
                fail(op, f"invalid tensor type at index {i}: output {dst.dtype}, input {src.dtype}",
                     "match the output's dtype to the input's")
            if dst.numel() != src.numel():
                fail(op, f"invalid size of output tensor at index {i}: {dst.numel()} elements, input "
                     f"{src.numel()}", "match the output's size to the input's")


def root_list(op: str, lists, rank: int, root: int, size: int, ref, which: str):
    """gather's outputs / scatter's inputs: one list of size tensors on the root, none elsewhere.

    Returns the root's list, or None on every other rank.
    """
    if rank == root:
        single(op, lists, f"{which} list")
        tensors = lists[0]
        list_size(op, len(tensors), size, which)
        like(op, tensors, ref)
        return tensors
    if len(lists) != 0:
        fail(op, f"requires empty {which} on non-root (rank {rank}, root {root})",
             f"pass [] as the {which} list on every rank but the root")
    return None
