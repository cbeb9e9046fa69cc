"""What a simulated NCCL kernel does: one launched group of one comm, run on its stream.

Data moves between ranks over the comm's hpct storeless Gloo context, read from and written
to the raw pointers the engine passed (as NCCL reads device pointers), so the engine's own
pointer arithmetic (offsets of all_to_all parts, staging buffers) is what gets tested.  The
sends and receives of a group are posted first, then its collectives run in order, then the
transfers are waited for: every rank's group may list its ops in any order, as NCCL allows.
"""

from __future__ import annotations

import ctypes
import threading
import time

import torch

from hpct.distributed.nccl import library as nccl_lib

from .runtime import HANG_S

_TORCH = {1: torch.uint8, 0: torch.int8, 2: torch.int32, 3: torch.int32, 4: torch.int64, 5: torch.int64,
          6: torch.float16, 7: torch.float32, 8: torch.float64, 9: torch.bfloat16,
          10: torch.float8_e4m3fn, 11: torch.float8_e5m2}
_GLOO = {torch.float32: "float32", torch.float64: "float64", torch.int32: "int32", torch.int64: "int64"}
_OPS = {nccl_lib.NCCL_SUM: "sum", nccl_lib.NCCL_PROD: "product", nccl_lib.NCCL_MAX: "max",
        nccl_lib.NCCL_MIN: "min", nccl_lib.NCCL_AVG: "sum"}
REMOTE_ERROR = 6


def raw(ptr: int, nbytes: int):
    return (ctypes.c_char * nbytes).from_address(ptr)


def view(ptr: int, count: int, dtype: int) -> torch.Tensor:
    t = _TORCH[dtype]
    return torch.frombuffer(raw(ptr, count * t.itemsize), dtype=t, count=count)


def nbytes(count: int, dtype: int) -> int:
    return count * _TORCH[dtype].itemsize


def reduce_in_place(ctx, t: torch.Tensor, op: int, nranks: int) -> None:
    """All-reduce a contiguous tensor that owns its memory, in place (NCCL's op on t's dtype)."""
    wide = t if t.dtype in _GLOO else t.to(torch.float64 if t.dtype.is_floating_point else torch.int64)
    ctx.allreduce(raw(wide.data_ptr(), wide.numel() * wide.element_size()), op=_OPS[op], dtype=_GLOO[wide.dtype])
    if op == nccl_lib.NCCL_AVG:
        if wide.dtype.is_floating_point:
            wide /= nranks
        else:
            wide.div_(nranks, rounding_mode="trunc")
    if wide is not t:
        t.copy_(wide)


class Kernel:
    def __init__(self, comm, ops, *, hang: bool, linger_s: float = 0.0):
        self.comm, self.ops, self.hang, self.linger_s = comm, ops, hang, linger_s
        self.finished = threading.Event()

    def run(self) -> None:
        comm = self.comm
        try:
            if self.hang:                      # an op that never completes: ends at the abort only
                comm.aborted.wait(HANG_S)
                time.sleep(self.linger_s)      # a real kernel notices the abort flag a little later
                comm.lib.kernel_gate.wait(HANG_S)
                return
            if comm.aborted.is_set():          # an aborted comm's kernels exit at once
                return
            self._execute(comm.ctx, comm.rank, comm.nranks)
        except Exception as err:   # noqa: BLE001 -- a transfer failed: a peer is gone
            if not comm.aborted.is_set():
                comm.fail(REMOTE_ERROR, f"{type(err).__name__}: {err}")
                comm.aborted.wait(HANG_S)      # an NCCL kernel spins until the abort ends it
        finally:
            self.finished.set()
            if self in comm.kernels:
                comm.kernels.remove(self)

    def _execute(self, ctx, rank: int, n: int) -> None:
        requests, mine_sent, mine_recv = [], [], []
        for name, args in self.ops:
            if name not in ("send", "recv"):
                continue
            buf, count, dtype, peer = args
            size = nbytes(count, dtype)
            if peer == rank:
                (mine_sent if name == "send" else mine_recv).append((buf, size))
            elif size:
                post = ctx.isend if name == "send" else ctx.irecv
                requests.append(post(raw(buf, size), peer))
        for (dst, a), (src, b) in zip(mine_recv, mine_sent):
            ctypes.memmove(dst, src, min(a, b))
        for name, args in self.ops:
            if name not in ("send", "recv"):
                getattr(self, name)(ctx, rank, n, *args)
        for r in requests:
            r.wait()

    @staticmethod
    def all_reduce(ctx, rank, n, send, recv, count, dtype, op):
        if count:
            dst = view(recv, count, dtype)
            if send != recv:
                dst.copy_(view(send, count, dtype))
            acc = dst if dst.dtype in _GLOO else dst.clone()
            reduce_in_place(ctx, acc, op, n)
            if acc is not dst:
                dst.copy_(acc)

    @staticmethod
    def broadcast(ctx, rank, n, send, recv, count, dtype, root):
        if count:
            if rank == root and send != recv:
                ctypes.memmove(recv, send, nbytes(count, dtype))
            ctx.broadcast(raw(recv, nbytes(count, dtype)), root)

    @staticmethod
    def reduce(ctx, rank, n, send, recv, count, dtype, op, root):
        if count:
            acc = view(send, count, dtype).clone()
            reduce_in_place(ctx, acc, op, n)
            if rank == root:
                view(recv, count, dtype).copy_(acc)

    @staticmethod
    def all_gather(ctx, rank, n, send, recv, count, dtype):
        if count:
            size = nbytes(count, dtype)
            mine = bytearray(raw(send, size))          # send may lie inside recv (in place)
            ctx.allgather(mine, raw(recv, size * n))

    @staticmethod
    def reduce_scatter(ctx, rank, n, send, recv, count, dtype, op):
        if count:
            acc = view(send, count * n, dtype).clone()
            reduce_in_place(ctx, acc, op, n)
            view(recv, count, dtype).copy_(acc[rank * count:(rank + 1) * count])
