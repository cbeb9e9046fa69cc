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
  allreduce (the context runs one collective at a time);
- send and recv only post the message (``isend_``/``irecv_``) and return its request:
  the group waits on it outside the one-collective-at-a-time worker.

Every function runs on the group's worker thread with the GIL released inside the
context, so ``abort()`` from another thread wakes it.
"""

from __future__ import annotations

import ctypes

import torch
from torch.distributed import ReduceOp

from ...errors import HpctArgumentError

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
    raise HpctArgumentError(f"hpct: ReduceOp.{op_label(op)} is not supported by the hpct backend; "
                            "use SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR or BXOR")


def op_label(op) -> str:
    """A reduce op's name (a PREMUL_SUM op prints as an object address otherwise)."""
    kind = getattr(op, "op", op)          # ReduceOp objects carry their RedOpType in .op
    return getattr(kind, "name", None) or str(kind).rsplit(".", 1)[-1]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over a contiguous tensor's storage (any dtype, any shape)."""
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def as_bytes(t: torch.Tensor):
    """A writable byte buffer over a contiguous tensor's storage, for the context's ops.

    The extension takes anything with the buffer protocol.  Tensors lack it, and a numpy
    view would make numpy a dependency (torch does not require it); a ctypes array over
    the same memory has it, and keeps the tensor alive for as long as the buffer lives.
    """
    if not t.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return bytearray()
    buf = (ctypes.c_ubyte * nbytes).from_address(t.data_ptr())
    buf.owner = t
    return buf


def to_bytes(t: torch.Tensor) -> bytes:
    """A copy of a contiguous tensor's storage as ``bytes``."""
    return bytes(as_bytes(t))


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
            ctx.allreduce(as_bytes(work), op=name, dtype=NATIVE[work.dtype])
        _write_back(t, work)
        return
    if t.dtype in WIDEN_INT:
        work = t.to(torch.int64)
        if work.numel():
            ctx.allreduce(as_bytes(work), op=name, dtype=NATIVE[work.dtype])
        t.copy_(work != 0 if t.dtype == torch.bool else work.to(t.dtype))
        return
    if t.dtype in HALF:
        work = t.to(torch.float32)
        if work.numel():
            ctx.allreduce(as_bytes(work), op=name, dtype=NATIVE[work.dtype])
        t.copy_(work.to(t.dtype))
        return
    raise TypeError(f"the hpct backend cannot reduce tensors of dtype {t.dtype}")


def broadcast_(ctx, t: torch.Tensor, root: int) -> None:
    work = _contig(t)
    if work.numel():
        ctx.broadcast(as_bytes(work), root)
    _write_back(t, work)


def allgather_bytes(ctx, data: torch.Tensor) -> torch.Tensor:
    """Every rank's flat uint8 tensor (all of one length), as a (size, len) uint8 tensor."""
    n = ctx.size
    out = torch.empty((n, data.numel()), dtype=torch.uint8)
    if data.numel():
        ctx.allgather(as_bytes(_contig(data)), as_bytes(out))
    return out


def allgather_tensor(ctx, t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``t`` (same shape and dtype on every rank), in rank order."""
    src = _contig(t)
    rows = allgather_bytes(ctx, byte_view(src))
    return [row.view(t.dtype).reshape(t.shape) if t.numel() else torch.empty_like(t) for row in rows]


def allgather_varlen(ctx, data: torch.Tensor) -> list:
    """Every rank's flat uint8 tensor of any length: lengths first, then the padded buffers."""
    lengths = torch.tensor([data.numel()], dtype=torch.int64)
    all_len = allgather_tensor(ctx, lengths)
    sizes = [int(x.item()) for x in all_len]
    width = max(sizes) if sizes else 0
    padded = torch.zeros(width, dtype=torch.uint8)
    if data.numel():
        padded[:data.numel()] = data
    rows = allgather_bytes(ctx, padded)
    return [rows[i, :sizes[i]] for i in range(len(sizes))]


def reduce_scatter_(ctx, out: torch.Tensor, inputs: list[torch.Tensor], op) -> None:
    """out = reduce(inputs[rank] over ranks); inputs[i] has out's shape."""
    flat = torch.cat([_contig(x).reshape(-1) for x in inputs])
    allreduce_(ctx, flat, op)
    n = out.numel()
    out.copy_(flat[ctx.rank * n:(ctx.rank + 1) * n].reshape(out.shape))


def _parts(tensors: list) -> tuple[list[int], list[int]]:
    """Addresses and byte sizes of contiguous tensors (size -1 where None)."""
    addrs, sizes = [0] * len(tensors), [-1] * len(tensors)
    for j, t in enumerate(tensors):
        if t is not None:
            addrs[j], sizes[j] = t.data_ptr(), t.nbytes
    return addrs, sizes


def _row_parts(t: torch.Tensor, splits, n: int) -> tuple[list[int], list[int]]:
    """Addresses and byte sizes of a contiguous tensor's n blocks of rows along dim 0
    (``splits`` rows each; equal blocks when it is empty), without slicing the tensor."""
    rows = t.shape[0]
    if not splits:
        if rows % n:
            raise ValueError(f"dimension 0 of size {rows} is not divisible by the group size {n}")
        splits = [rows // n] * n
    elif len(splits) != n or sum(splits) != rows:
        raise ValueError(f"split sizes {list(splits)} do not match dimension 0 ({rows}) "
                         f"and the group size {n}")
    row = t.nbytes // rows if rows else 0
    addr, addrs, sizes = t.data_ptr(), [], []
    for k in splits:
        addrs.append(addr)
        sizes.append(k * row)
        addr += k * row
    return addrs, sizes


def exchange(ctx, send_parts: tuple, recv_parts: tuple) -> dict[int, int]:
    """Send part j of ``send_parts`` to rank j and receive part j of ``recv_parts`` from rank
    j, every pair at once; this rank's own part is a local copy.  Parts are (addresses, byte
    sizes) as _parts and _row_parts give them, over tensors the caller holds.

    One message per pair and direction in the extension (``Context.exchange``), as in Gloo's
    alltoall: each receive is posted at once with the size this rank expects.  A message of
    another size is dropped there (Gloo patch 0020), so a size two ranks disagree on fails
    this op on the receiving rank alone, never the group.  Returns those receives:
    {source rank: bytes it sent}, for the caller to report.
    """
    sent = ctx.exchange(*send_parts, *recv_parts)
    return {j: n for j, n in enumerate(sent) if n >= 0}


def _staged(t: torch.Tensor | None) -> torch.Tensor | None:
    """A contiguous tensor to receive into in place of ``t`` (``t`` itself when it is one)."""
    return t if t is None or t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)


def _copy_back(targets: list, staged: list) -> None:
    for t, s in zip(targets, staged):
        if s is not t:
            t.copy_(s)


def _size_error(what: str, sizes: list[int], wrong: dict[int, int]) -> ValueError:
    j = min(wrong)
    return ValueError(f"{what} holds {sizes[j]} bytes, received {wrong[j]}")


def all_to_all_single_(ctx, out, inp, out_splits, in_splits) -> None:
    n = ctx.size
    staged, source = _staged(out), _contig(inp)     # held: the extension reads their addresses
    recvs = _row_parts(staged, out_splits, n)
    wrong = exchange(ctx, _row_parts(source, in_splits, n), recvs)
    _copy_back([out], [staged])
    if wrong:
        raise _size_error("all_to_all_single: an output split", recvs[1], wrong)


def alltoall_(ctx, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
    staged, sources = [_staged(t) for t in outs], [_contig(x) for x in ins]   # held, as above
    recvs = _parts(staged)
    wrong = exchange(ctx, _parts(sources), recvs)
    _copy_back(outs, staged)
    if wrong:
        raise _size_error("all_to_all: an output tensor", recvs[1], wrong)


def gather_(ctx, outs: list[torch.Tensor] | None, inp: torch.Tensor, root: int) -> None:
    """Every rank's ``inp`` into the root's ``outs``: only the root receives."""
    n = ctx.size
    sends = [None] * n
    sends[root] = _contig(inp)
    staged = [_staged(t) for t in outs] if ctx.rank == root else [None] * n
    recvs = _parts(staged)
    wrong = exchange(ctx, _parts(sends), recvs)
    if ctx.rank == root:
        _copy_back(outs, staged)
    if wrong:
        raise _size_error("gather: an output tensor", recvs[1], wrong)


def scatter_(ctx, out: torch.Tensor, ins: list[torch.Tensor] | None, root: int) -> None:
    """The root's ``ins[j]`` into rank j's ``out``: each rank receives its part only."""
    n = ctx.size
    if ctx.rank == root and len(ins) != n:
        raise ValueError(f"scatter: root needs {n} input tensors, got {len(ins)}")
    sends = [_contig(x) for x in ins] if ctx.rank == root else [None] * n
    recvs = [None] * n
    recvs[root] = staged = _staged(out)
    recv_parts = _parts(recvs)
    wrong = exchange(ctx, _parts(sends), recv_parts)
    _copy_back([out], [staged])
    if ctx.rank == root and wrong:
        raise ValueError("scatter: input sizes at the root do not match the output sizes")
    if wrong:
        raise _size_error("scatter: the output tensor", recv_parts[1], wrong)


def isend_(ctx, t: torch.Tensor, dst: int, tag: int):
    """Post a send of ``t`` (a contiguous copy if needed); returns (request, None).

    The request holds the bytes it sends (the ctypes buffer keeps its tensor alive)."""
    return ctx.isend(as_bytes(_contig(t)), dst, tag), None


def irecv_(ctx, t: torch.Tensor, src: int, tag: int):
    """Post a receive into ``t``; returns (request, finish): call finish() once the
    request completed (it copies a non-contiguous target's staging buffer back)."""
    work = _contig(t)
    return ctx.irecv(as_bytes(work), src, tag), (None if work is t else lambda: t.copy_(work))


def irecv_any_(ctx, t: torch.Tensor, src: int, tag: int):
    """Post a receive into ``t`` from whichever rank sends first (``src`` is ignored); as irecv_."""
    work = _contig(t)
    return ctx.irecv_any(as_bytes(work), tag), (None if work is t else lambda: t.copy_(work))


def allgather_many(ctx, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Every rank's copies of ``tensors`` as ``[rank][i]``, in one allgather.

    The tensors are packed as bytes, so one call carries any mix of dtypes and shapes
    (the same list on every rank), and a tensor listed twice is simply sent twice.
    """
    views = [byte_view(_contig(t)) for t in tensors]
    packed = torch.cat(views) if views else torch.empty(0, dtype=torch.uint8)
    rows = allgather_bytes(ctx, packed)
    out = []
    for r in range(ctx.size):
        row, start, mine = rows[r], 0, []
        for t, v in zip(tensors, views):
            n = v.numel()
            mine.append(row[start:start + n].view(t.dtype).reshape(t.shape) if n else torch.empty_like(t))
            start += n
        out.append(mine)
    return out


def allreduce_coalesced_(ctx, tensors: list[torch.Tensor], op) -> None:
    """One allreduce over the tensors packed end to end, written back to each.

    A tensor listed twice contributes once per listing to the packed buffer, and every
    listing receives the same reduced value (as ProcessGroupGloo): never reduced twice.
    """
    flat = torch.cat([_contig(t).reshape(-1) for t in tensors])
    allreduce_(ctx, flat, op)
    start = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[start:start + n].reshape(t.shape))
        start += n


def sparse_allreduce(ctx, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The SUM of sparse COO tensors over the local list and every rank, coalesced."""
    local = tensors[0]
    for t in tensors[1:]:
        local = local + t
    local = local.coalesce()
    idx, vals = local.indices().contiguous(), local.values().contiguous()
    all_idx = allgather_varlen(ctx, byte_view(idx))
    all_vals = allgather_varlen(ctx, byte_view(vals))
    dims, dense_shape = idx.shape[0], tuple(vals.shape[1:])
    idx_parts, val_parts = [], []
    for raw_i, raw_v in zip(all_idx, all_vals):
        nnz = raw_i.numel() // (8 * dims) if dims else 0
        idx_parts.append(raw_i.view(torch.int64).reshape(dims, nnz) if nnz else
                         torch.empty((dims, 0), dtype=torch.int64))
        val_parts.append(raw_v.view(vals.dtype).reshape((nnz,) + dense_shape) if nnz else
                         torch.empty((0,) + dense_shape, dtype=vals.dtype))
    return torch.sparse_coo_tensor(torch.cat(idx_parts, 1), torch.cat(val_parts, 0),
                                   local.shape).coalesce()


def local_reduce(a: torch.Tensor, b: torch.Tensor, op) -> torch.Tensor:
    """Reduce two local tensors (several tensors per rank are reduced before the wire)."""
    name = op_name(op)
    if name == "sum":
        return a + b
    if name == "product":
        return a * b
    if name == "min":
        return torch.minimum(a, b)
    if name == "max":
        return torch.maximum(a, b)
    if name == "avg":
        raise ValueError("ReduceOp.AVG over several local tensors is not supported")
    return BITWISE[name](a, b)
