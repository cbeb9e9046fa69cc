"""Collectives on one ``hpct._gloo.Context``, for CPU tensors of every dtype.

The context moves float32/float64/int32/int64 for reductions and raw bytes for
everything else.  The rest is done here, exactly where possible:

- integer types narrower than 64 bits and ``bool`` are reduced in int64 and cast back;
  sum/product wrap modulo 2**n exactly as in the narrow type, min/max are exact, and
  ``bool`` sum/max is logical or, product/min logical and (Gloo's semantics);
- float16/bfloat16 are reduced in float32 and rounded once at the end (Gloo reduces in
  the half type step by step: results can differ in the last bit; documented);
- complex tensors are reduced as (real, imag) pairs (sum only, as ProcessGroupGloo);
- AVG (floating point and complex types) is SUM divided by the group size;
- BAND/BOR/BXOR (integer and bool types) are an allgather followed by a local reduction;
- gather, scatter, all-to-all and reduce-scatter are built on allgather, broadcast and
  allreduce (the context runs one op at a time, and its send blocks until the receiver
  posts the matching recv, so a schedule of pairwise send/recv could deadlock).

Every function runs on the group's worker thread with the GIL released inside the
context, so ``abort()`` from another thread wakes it.
"""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp

NATIVE = {torch.float32: "float32", torch.float64: "float64",
          torch.int32: "int32", torch.int64: "int64"}
WIDEN_INT = (torch.int8, torch.uint8, torch.int16, torch.uint16, torch.uint32, torch.bool)
HALF = (torch.float16, torch.bfloat16)
ARITH = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "product", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}
BITWISE = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
BITWISE_OPS = {ReduceOp.BAND: "band", ReduceOp.BOR: "bor", ReduceOp.BXOR: "bxor"}


def op_name(op) -> str:
    for known, name in ARITH.items():
        if op == known:
            return name
    for known, name in BITWISE_OPS.items():
        if op == known:
            return name
    if op == ReduceOp.AVG:
        return "avg"
    raise ValueError(f"ReduceOp {op} is not supported by the hpct backend; "
                     "use SUM, PRODUCT, MIN, MAX, BAND, BOR or BXOR")


def as_bytes(t: torch.Tensor):
    """A uint8 numpy view of a contiguous tensor's storage (any dtype, any shape)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return flat.view(torch.uint8).numpy() if flat.element_size() == 1 else \
            torch.empty(0, dtype=torch.uint8).numpy()
    return flat.view(torch.uint8).numpy()


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _write_back(dst: torch.Tensor, src: torch.Tensor) -> None:
    if src is not dst:
        dst.copy_(src)


def allreduce_(ctx, t: torch.Tensor, op) -> None:
    """In-place allreduce of one tensor."""
    name = op_name(op)
    if name == "avg":      # as ProcessGroupGloo: the sum divided by the group size
        if not (t.is_floating_point() or t.is_complex()):
            raise ValueError(f"ReduceOp.AVG needs a floating point or complex tensor, not {t.dtype}")
        work = t.to(torch.float32) if t.dtype in HALF else t
        allreduce_(ctx, work, ReduceOp.SUM)
        work.div_(ctx.size)
        _write_back(t, work.to(t.dtype) if work is not t else work)
        return
    if name in ("band", "bor", "bxor"):
        if t.is_floating_point() or t.is_complex():
            raise ValueError(f"ReduceOp.{name.upper()} needs an integer or bool tensor, not {t.dtype}")
        gathered = allgather_tensor(ctx, t)
        out = gathered[0].clone()
        for other in gathered[1:]:
            out = BITWISE[name](out, other)
        t.copy_(out)
        return
    if t.is_complex():
        if name != "sum":
            raise ValueError(f"ReduceOp.{name.upper()} is not defined for complex tensors; use SUM")
        work = _contig(t)
        allreduce_(ctx, torch.view_as_real(work), op)
        _write_back(t, work)
        return
    if t.dtype in NATIVE:
        work = _contig(t)
        if work.numel():
            ctx.allreduce(work.detach().reshape(-1).numpy(), op=name)
        _write_back(t, work)
        return
    if t.dtype in WIDEN_INT:
        work = t.to(torch.int64)
        if work.numel():
            ctx.allreduce(work.reshape(-1).numpy(), op=name)
        t.copy_(work != 0 if t.dtype == torch.bool else work.to(t.dtype))
        return
    if t.dtype in HALF:
        work = t.to(torch.float32)
        if work.numel():
            ctx.allreduce(work.reshape(-1).numpy(), op=name)
        t.copy_(work.to(t.dtype))
        return
    raise TypeError(f"the hpct backend cannot reduce tensors of dtype {t.dtype}")


def broadcast_(ctx, t: torch.Tensor, root: int) -> None:
    work = _contig(t)
    if work.numel():
        ctx.broadcast(as_bytes(work), root)
    _write_back(t, work)


def allgather_bytes(ctx, data) -> "torch.Tensor":
    """Every rank's uint8 buffer (all of one length), as a (size, len) uint8 tensor."""
    n = ctx.size
    out = torch.empty((n, len(data)), dtype=torch.uint8)
    if len(data):
        ctx.allgather(data, out.reshape(-1).numpy())
    return out


def allgather_tensor(ctx, t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``t`` (same shape and dtype on every rank), in rank order."""
    src = _contig(t)
    rows = allgather_bytes(ctx, as_bytes(src))
    return [row.view(t.dtype).reshape(t.shape) if t.numel() else torch.empty_like(t) for row in rows]


def allgather_varlen(ctx, data) -> list:
    """Every rank's uint8 buffer of any length: lengths first, then the padded buffers."""
    lengths = torch.tensor([len(data)], dtype=torch.int64)
    all_len = allgather_tensor(ctx, lengths)
    sizes = [int(x.item()) for x in all_len]
    width = max(sizes) if sizes else 0
    padded = torch.zeros(width, dtype=torch.uint8)
    if len(data):
        padded[:len(data)] = torch.from_numpy(data)
    rows = allgather_bytes(ctx, padded.numpy())
    return [rows[i, :sizes[i]] for i in range(len(sizes))]


def reduce_scatter_(ctx, out: torch.Tensor, inputs: list[torch.Tensor], op) -> None:
    """out = reduce(inputs[rank] over ranks); inputs[i] has out's shape."""
    flat = torch.cat([_contig(x).reshape(-1) for x in inputs])
    allreduce_(ctx, flat, op)
    n = out.numel()
    out.copy_(flat[ctx.rank * n:(ctx.rank + 1) * n].reshape(out.shape))


def alltoall_bytes(ctx, chunks: list) -> list:
    """chunks[j] (uint8 tensors) goes to rank j; returns what each rank sent here."""
    n = ctx.size
    lens = torch.tensor([c.numel() for c in chunks], dtype=torch.int64)
    table = torch.stack(allgather_tensor(ctx, lens))            # table[src][dst]
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    rows = allgather_varlen(ctx, payload.numpy())
    me = ctx.rank
    got = []
    for src in range(n):
        start = int(table[src, :me].sum())
        got.append(rows[src][start:start + int(table[src, me])])
    return got


def split_rows(t: torch.Tensor, sizes, n: int) -> list[torch.Tensor]:
    """Split ``t`` along dim 0 into ``sizes`` rows (equal parts when sizes is empty)."""
    if not sizes:
        if t.shape[0] % n:
            raise ValueError(f"dimension 0 of size {t.shape[0]} is not divisible by the group size {n}")
        sizes = [t.shape[0] // n] * n
    if len(sizes) != n or sum(sizes) != t.shape[0]:
        raise ValueError(f"split sizes {list(sizes)} do not match dimension 0 ({t.shape[0]}) "
                         f"and the group size {n}")
    return list(torch.split(t, list(sizes), dim=0))


def _copy_received(targets: list[torch.Tensor], got: list[torch.Tensor], what: str) -> None:
    """Copy each peer's bytes into its target tensor; a size mismatch is the caller's error."""
    for dst, data in zip(targets, got):
        if dst.numel() * dst.element_size() != data.numel():
            raise ValueError(f"{what} holds {dst.numel() * dst.element_size()} bytes, "
                             f"received {data.numel()}")
        if data.numel():
            dst.copy_(data.view(dst.dtype).reshape(dst.shape))


def all_to_all_single_(ctx, out, inp, out_splits, in_splits) -> None:
    n = ctx.size
    sends = [as_bytes(_contig(c)) for c in split_rows(inp, in_splits, n)]
    got = alltoall_bytes(ctx, [torch.from_numpy(s) for s in sends])
    _copy_received(split_rows(out, out_splits, n), got, "all_to_all_single: an output split")


def alltoall_(ctx, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
    got = alltoall_bytes(ctx, [torch.from_numpy(as_bytes(_contig(x))) for x in ins])
    _copy_received(outs, got, "all_to_all: an output tensor")


def gather_(ctx, outs: list[torch.Tensor] | None, inp: torch.Tensor, root: int) -> None:
    rows = allgather_varlen(ctx, as_bytes(_contig(inp)))
    if ctx.rank == root:
        for dst, data in zip(outs, rows):
            if data.numel():
                dst.copy_(data.view(dst.dtype).reshape(dst.shape))


def scatter_(ctx, out: torch.Tensor, ins: list[torch.Tensor] | None, root: int) -> None:
    n = ctx.size
    nbytes = out.numel() * out.element_size()
    sizes = [int(x.item()) for x in allgather_tensor(ctx, torch.tensor([nbytes], dtype=torch.int64))]
    total = sum(sizes)
    buf = torch.empty(total, dtype=torch.uint8)
    if ctx.rank == root:
        if len(ins) != n:
            raise ValueError(f"scatter: root needs {n} input tensors, got {len(ins)}")
        parts = [torch.from_numpy(as_bytes(_contig(x))) for x in ins]
        if [p.numel() for p in parts] != sizes:
            raise ValueError("scatter: input sizes at the root do not match the output sizes")
        if total:
            buf.copy_(torch.cat(parts))
    if total:
        ctx.broadcast(buf.numpy(), root)
    start = sum(sizes[:ctx.rank])
    if nbytes:
        out.copy_(buf[start:start + nbytes].view(out.dtype).reshape(out.shape))


def send_(ctx, t: torch.Tensor, dst: int, tag: int) -> None:
    ctx.send(as_bytes(_contig(t)), dst, tag)


def recv_(ctx, t: torch.Tensor, src: int, tag: int) -> None:
    work = _contig(t)
    ctx.recv(as_bytes(work), src, tag)
    _write_back(t, work)
