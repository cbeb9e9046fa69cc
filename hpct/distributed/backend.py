"""The ``hpct`` c10d process group: a Python ProcessGroup over one storeless Gloo context.

Every op is queued, in issue order, to the group's worker thread (the context runs one op
at a time) and returns a Work wrapping a torch Future; ``async_op=True`` and
``Work.wait()`` work as with any backend.  An op that fails completes its future with an
exception naming the group, this rank, the generation and (from Gloo) the peer; every op
queued after a failure fails at once with the same cause, so nothing waits for a dead
group.  ``abort()`` is bounded and may be called from any thread: the context wakes the op
in flight (AbortedError) and frees the listening port.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions,
                                        BarrierOptions, BroadcastOptions, GatherOptions,
                                        ReduceOptions, ReduceScatterOptions, ScatterOptions)
from torch.futures import Future

from .. import _gloo
from . import ops
from .work import HpctWork, _unpack

BACKEND_NAME = "hpct"


def _check_cpu(tensors) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"the hpct backend handles CPU tensors only, got a tensor on {t.device}")


class HpctProcessGroup(dist.ProcessGroup):
    """A process group whose collectives run on hpct's patched, storeless Gloo."""

    def __init__(self, ctx, *, group_name: str, group_index: int, global_ranks: list[int]):
        super().__init__(ctx.rank, ctx.size)
        self._ctx = ctx
        self._rank = ctx.rank
        self._size = ctx.size
        self.hpct_group_name = group_name
        self.group_index = group_index
        self.global_ranks = list(global_ranks)
        self.generation = ctx.generation
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"hpct-pg-{group_name}", daemon=True)
        self._thread.start()
        self.on_shutdown = None          # set by the world registry

    # ---- identity -------------------------------------------------------------------------
    def size(self):
        return self._size

    def rank(self):
        return self._rank

    def getBackendName(self):
        return BACKEND_NAME

    def name(self):
        return BACKEND_NAME

    def __repr__(self):
        return (f"HpctProcessGroup(group={self.hpct_group_name}, index={self.group_index}, "
                f"rank={self._rank}/{self._size}, generation={self.generation})")

    # torch keeps a group's name in its C++ backends; this group has none, so it keeps its own.
    @property
    def group_name(self):
        return self.hpct_group_name

    def _set_group_name(self, name):
        self.hpct_group_name = str(name)

    @property
    def group_desc(self):
        return getattr(self, "_hpct_group_desc", "undefined")

    def _set_group_desc(self, desc):
        self._hpct_group_desc = desc

    @property
    def context(self):
        return self._ctx

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    # ---- the worker -----------------------------------------------------------------------
    def _describe(self, what: str) -> str:
        return (f"hpct {what} failed on group {self.hpct_group_name} (rank {self._rank} of {self._size}, "
                f"global rank {self.global_ranks[self._rank]}, generation {self.generation})")

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            what, fn, raw, result = item
            if self._failure is not None:
                raw.set_result((False, f"{self._describe(what)}: the group already failed: {self._failure}"))
                continue
            try:
                fn()
            except BaseException as err:   # noqa: BLE001 -- every error goes to the future
                # A transport error (peer lost, abort, timeout) ends the group; a local one
                # (bad argument, unsupported dtype) fails only this op.
                if isinstance(err, _gloo.GlooError):
                    with self._lock:
                        if self._failure is None:
                            self._failure = err
                raw.set_result((False, f"{self._describe(what)}: {type(err).__name__}: {err}"))
                continue
            raw.set_result((True, result))

    def _submit(self, what: str, fn, result):
        # The worker completes ``raw`` with (ok, value); the Work's future is raw.then(_unpack),
        # so a failure becomes a real C++ error of the future (an exception raised in a
        # then-callback is stored as such) that C++ consumers such as DDP's reducer see.
        # Future.set_exception would store the exception object as a *value*.
        raw = Future()
        with self._lock:
            closed = self._closed
        if closed:
            raw.set_result((False, f"{self._describe(what)}: the group is shut down"))
        else:
            self._queue.put((what, fn, raw, result))
        return HpctWork(raw, raw.then(_unpack))

    def abort(self, reason: str = "aborted by the application") -> None:
        """Wake the op in flight and fail every queued op; bounded; any thread."""
        with self._lock:
            if self._failure is None:
                self._failure = RuntimeError(f"aborted: {reason}")
        self._ctx.abort(reason)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort, stop the worker and release the context (port, sockets, loop thread)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.abort("process group shut down")
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._ctx.close()
        if self.on_shutdown is not None:
            self.on_shutdown(self)

    # ---- collectives ----------------------------------------------------------------------
    def allreduce(self, tensors, opts=AllreduceOptions()):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        _check_cpu(tensors)
        op = opts.reduceOp if hasattr(opts, "reduceOp") else opts
        ops.op_name(op)   # reject AVG & co. at the call, as ProcessGroupGloo does

        def run():
            if len(tensors) == 1:
                ops.allreduce_(self._ctx, tensors[0], op)
                return
            acc = tensors[0].clone()   # several local tensors: reduce them first (as Gloo)
            for t in tensors[1:]:
                acc = _local_reduce(acc, t, op)
            ops.allreduce_(self._ctx, acc, op)
            for t in tensors:
                t.copy_(acc)
        return self._submit("allreduce", run, tensors)

    def allreduce_coalesced(self, tensors, opts=AllreduceOptions()):
        _check_cpu(tensors)
        op = opts.reduceOp
        ops.op_name(op)

        def run():
            for t in tensors:
                ops.allreduce_(self._ctx, t, op)
        return self._submit("allreduce_coalesced", run, tensors)

    def broadcast(self, tensors, opts=BroadcastOptions()):
        _check_cpu(tensors)
        root = opts.rootRank
        tensor = tensors[opts.rootTensor]
        return self._submit("broadcast", lambda: ops.broadcast_(self._ctx, tensor, root), tensors)

    def reduce(self, tensors, opts=ReduceOptions()):
        _check_cpu(tensors)
        op, root = opts.reduceOp, opts.rootRank
        ops.op_name(op)
        tensor = tensors[opts.rootTensor]

        def run():
            work = tensor.clone()
            ops.allreduce_(self._ctx, work, op)
            if self._rank == root:
                tensor.copy_(work)
        return self._submit("reduce", run, tensors)

    def allgather(self, output_tensors, input_tensors, opts=AllgatherOptions()):
        _check_cpu(input_tensors)
        outs, inp = output_tensors[0], input_tensors[0]
        if len(outs) != self._size:
            raise ValueError(f"all_gather needs {self._size} output tensors, got {len(outs)}")

        def run():
            for dst, src in zip(outs, ops.allgather_tensor(self._ctx, inp)):
                dst.copy_(src)
        return self._submit("allgather", run, output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=AllgatherOptions()):
        def run():
            for outs, inp in zip(output_lists, input_list):
                for dst, src in zip(outs, ops.allgather_tensor(self._ctx, inp)):
                    dst.copy_(src)
        return self._submit("allgather_coalesced", run, output_lists)

    def all_gather_single(self, output, input, opts=AllgatherOptions()):
        _check_cpu([output, input])
        if output.numel() != input.numel() * self._size:
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, "
                             f"expected {self._size} x {input.numel()}")

        def run():
            if output.is_contiguous() and output.dtype == input.dtype:
                src = input if input.is_contiguous() else input.contiguous()
                if src.numel():       # straight into the output: no staging copy
                    self._ctx.allgather(ops.as_bytes(src), ops.as_bytes(output))
                return
            output.copy_(torch.stack(ops.allgather_tensor(self._ctx, input)).reshape(output.shape))
        return self._submit("all_gather_into_tensor", run, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=AllgatherOptions()):
        def run():
            for output, input in zip(outputs, inputs):
                output.copy_(torch.stack(ops.allgather_tensor(self._ctx, input)).reshape(output.shape))
        return self._submit("all_gather_into_tensor_coalesced", run, outputs)

    def reduce_scatter(self, output_tensors, input_lists, opts=ReduceScatterOptions()):
        op = opts.reduceOp
        ops.op_name(op)
        out, ins = output_tensors[0], input_lists[0]
        if len(ins) != self._size:
            raise ValueError(f"reduce_scatter needs {self._size} input tensors, got {len(ins)}")
        return self._submit("reduce_scatter", lambda: ops.reduce_scatter_(self._ctx, out, ins, op),
                            output_tensors)

    def reduce_scatter_single(self, output, input, opts=ReduceScatterOptions()):
        op = opts.reduceOp
        ops.op_name(op)
        if input.numel() != output.numel() * self._size:
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, "
                             f"expected {self._size} x {output.numel()}")

        def run():
            flat = input.reshape(-1).clone()
            ops.allreduce_(self._ctx, flat, op)
            n = output.numel()
            output.copy_(flat[self._rank * n:(self._rank + 1) * n].reshape(output.shape))
        return self._submit("reduce_scatter_tensor", run, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=ReduceScatterOptions()):
        op = opts.reduceOp
        ops.op_name(op)

        def run():
            for output, input in zip(outputs, inputs):
                flat = input.reshape(-1).clone()
                ops.allreduce_(self._ctx, flat, op)
                n = output.numel()
                output.copy_(flat[self._rank * n:(self._rank + 1) * n].reshape(output.shape))
        return self._submit("reduce_scatter_tensor_coalesced", run, outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=AllToAllOptions()):
        _check_cpu([output, input])
        return self._submit(
            "all_to_all_single",
            lambda: ops.all_to_all_single_(self._ctx, output, input, output_split_sizes,
                                           input_split_sizes), [output])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=AllToAllOptions()):
        if len(output_tensors) != self._size or len(input_tensors) != self._size:
            raise ValueError(f"all_to_all needs {self._size} input and output tensors")
        return self._submit("all_to_all", lambda: ops.alltoall_(self._ctx, output_tensors, input_tensors),
                            output_tensors)

    def gather(self, output_tensors, input_tensors, opts=GatherOptions()):
        root = opts.rootRank
        outs = output_tensors[0] if self._rank == root else None
        if self._rank == root and len(outs) != self._size:
            raise ValueError(f"gather needs {self._size} output tensors at the root, got {len(outs)}")
        return self._submit("gather", lambda: ops.gather_(self._ctx, outs, input_tensors[0], root),
                            output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=ScatterOptions()):
        root = opts.rootRank
        ins = input_tensors[0] if self._rank == root else None
        return self._submit("scatter", lambda: ops.scatter_(self._ctx, output_tensors[0], ins, root),
                            output_tensors)

    def barrier(self, opts=BarrierOptions()):
        return self._submit("barrier", self._ctx.barrier, [])

    def send(self, tensors, dst, tag=0):
        _check_cpu(tensors)
        return self._submit(f"send to rank {dst}",
                            lambda: [ops.send_(self._ctx, t, dst, tag) for t in tensors], tensors)

    def recv(self, tensors, src, tag=0):
        _check_cpu(tensors)
        return self._submit(f"recv from rank {src}",
                            lambda: [ops.recv_(self._ctx, t, src, tag) for t in tensors], tensors)

    def recv_anysource(self, tensors, tag=0):
        raise NotImplementedError("the hpct backend has no recv from any source; pass src=")


def _local_reduce(a: torch.Tensor, b: torch.Tensor, op) -> torch.Tensor:
    name = ops.op_name(op)
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
    return ops.BITWISE[name](a, b)
