"""The Gloo engine: CPU tensors on one storeless, abortable Gloo context.

The group facade (group.py) checks each call's arguments and hands it here with plain
arguments.  Every collective goes to the engine's Runner (runner.py): one at a time, in
issue order, on the worker thread or, when the caller blocks on it anyway, on the caller's
thread; it returns a Work.  A send or recv is posted at once on the caller's thread and
completed by its Work's wait() (HpctP2PWork), so any order of sends and receives
completes.  A transport error (peer lost, abort, timeout) fails the engine: every op
queued after it fails at once with the same cause, so nothing waits for a dead group; a
local error (bad argument, unsupported dtype) fails only its op.
"""

from __future__ import annotations

import torch

from ... import _gloo
from . import ops
from .runner import Runner, failed_work
from .work import HpctP2PWork


class GlooEngine:
    """The CPU half of an hpct group; ``describe(what)`` words its errors."""

    device_type = "cpu"

    def __init__(self, ctx, *, rank: int, describe, thread_name: str):
        self.ctx = ctx
        self._rank = rank
        self._describe = describe
        self._runner = Runner(describe, thread_name)
        self.submit = self._runner.submit
        self.blocking = self._runner.blocking
        self._note_failure = self._runner.note_failure

    @property
    def failure(self) -> BaseException | None:
        return self._runner.failure

    @property
    def on_failure(self):
        return self._runner.on_failure

    @on_failure.setter
    def on_failure(self, callback) -> None:
        """Called once, with the engine's first failure (group.py's abort hooks)."""
        self._runner.on_failure = callback

    @property
    def timeout(self) -> float:
        return self.ctx.timeout

    def set_timeout(self, seconds: float) -> None:
        self.ctx.set_timeout(seconds)     # ops queued before keep theirs only if already running

    def abort(self, reason: str) -> None:
        """Wake the op in flight and fail every queued op; bounded; any thread."""
        self._runner.fail(RuntimeError(f"aborted: {reason}"))
        self.ctx.abort(reason)

    def shutdown(self, timeout: float) -> bool:
        """Stop the worker and release the context; False if it was already shut down.

        An idle engine closes gracefully: peers first read everything this rank sent (the
        end of a barrier they are still finishing), then its goodbye, and fail nothing.
        With an op running or queued the context is aborted instead.
        """
        first, busy = self._runner.start_close()
        if not first:
            return False
        if busy:
            self.abort("process group shut down")
        self._runner.finish_close(timeout)
        self.ctx.close()
        return True

    # ---- collectives (arguments already checked by the facade) -----------------------------
    def allreduce(self, tensors, op):
        def run():
            if len(tensors) == 1:
                ops.allreduce_(self.ctx, tensors[0], op)
                return
            acc = tensors[0].clone()   # several local tensors: reduce them first (as Gloo)
            for t in tensors[1:]:
                acc = ops.local_reduce(acc, t, op)
            ops.allreduce_(self.ctx, acc, op)
            for t in tensors:
                t.copy_(acc)
        return self.submit("allreduce", run, tensors)

    def sparse_allreduce(self, tensors, op):
        def run():
            total = ops.sparse_allreduce(self.ctx, tensors)
            for t in tensors:
                t.copy_(total)
        return self.submit("allreduce (sparse)", run, tensors)

    def allreduce_coalesced(self, tensors, op):
        return self.submit("allreduce_coalesced", lambda: ops.allreduce_coalesced_(self.ctx, tensors, op),
                           tensors)

    def broadcast(self, tensors, root, root_tensor):
        tensor = tensors[root_tensor]

        def run():
            ops.broadcast_(self.ctx, tensor, root)
            for t in tensors:          # every local tensor ends up as the root's tensor (as Gloo)
                if t is not tensor:
                    t.copy_(tensor)
        return self.submit("broadcast", run, tensors)

    def reduce(self, tensor, root, op):
        def run():
            work = tensor.clone()
            ops.allreduce_(self.ctx, work, op)
            if self._rank == root:
                tensor.copy_(work)
        return self.submit("reduce", run, [tensor])

    def allgather(self, output_lists, inputs):
        def run():
            rows = ops.allgather_many(self.ctx, inputs)
            flat = [t for row in rows for t in row]        # [rank * k + i]
            for outs in output_lists:
                for dst, src in zip(outs, flat):
                    dst.copy_(src)
        # The future's value as Gloo gives it: the output list itself for one input per rank.
        return self.submit("allgather", run, output_lists[0] if len(inputs) == 1 else output_lists)

    def allgather_coalesced(self, output_lists, input_list):
        def run():
            rows = ops.allgather_many(self.ctx, input_list)     # [rank][input], as torch's API
            for outs, row in zip(output_lists, rows):
                for dst, src in zip(outs, row):
                    dst.copy_(src.reshape(dst.shape))
        return self.submit("allgather_coalesced", run, output_lists)

    def all_gather_single(self, output, input):
        def run():
            if output.is_contiguous():
                src = input if input.is_contiguous() else input.contiguous()
                if src.numel():       # straight into the output: no staging copy
                    self.ctx.allgather(ops.as_bytes(src), ops.as_bytes(output))
                return
            output.copy_(torch.stack(ops.allgather_tensor(self.ctx, input)).reshape(output.shape))
        return self.submit("all_gather_into_tensor", run, [output])

    def all_gather_single_coalesced(self, outputs, inputs):
        def run():
            rows = ops.allgather_many(self.ctx, inputs)
            for j, output in enumerate(outputs):
                output.copy_(torch.stack([row[j] for row in rows]).reshape(output.shape))
        return self.submit("all_gather_into_tensor_coalesced", run, outputs)

    def reduce_scatter(self, out, ins, op):
        return self.submit("reduce_scatter", lambda: ops.reduce_scatter_(self.ctx, out, ins, op), [out])

    def _reduce_scatter_flat(self, output, input, op) -> None:
        flat = input.reshape(-1).clone()
        ops.allreduce_(self.ctx, flat, op)
        n = output.numel()
        output.copy_(flat[self._rank * n:(self._rank + 1) * n].reshape(output.shape))

    def reduce_scatter_single(self, output, input, op):
        return self.submit("reduce_scatter_tensor", lambda: self._reduce_scatter_flat(output, input, op),
                           [output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, op):
        def run():
            for output, input in zip(outputs, inputs):
                self._reduce_scatter_flat(output, input, op)
        return self.submit("reduce_scatter_tensor_coalesced", run, outputs)

    def all_to_all_single(self, output, input, out_splits, in_splits):
        return self.submit("all_to_all_single",
                           lambda: ops.all_to_all_single_(self.ctx, output, input, out_splits, in_splits),
                           [output])

    def alltoall(self, outs, ins):
        return self.submit("all_to_all", lambda: ops.alltoall_(self.ctx, outs, ins), outs)

    def gather(self, outs, inp, root):
        return self.submit("gather", lambda: ops.gather_(self.ctx, outs, inp, root),
                           outs if outs is not None else [])

    def scatter(self, out, ins, root):
        return self.submit("scatter", lambda: ops.scatter_(self.ctx, out, ins, root), [out])

    def barrier(self):
        return self.submit("barrier", self.ctx.barrier, [])

    # ---- point to point --------------------------------------------------------------------
    # Posted at once on the caller's thread (never queued behind the worker, which runs one
    # collective at a time) and completed by the Work's wait(), as ProcessGroupGloo does:
    # sends and receives may be posted in any order on both ranks.
    def send(self, tensors, dst, tag):
        return self._p2p(f"send to rank {dst}", tensors, dst, tag, ops.isend_)

    def recv(self, tensors, src, tag):
        return self._p2p(f"recv from rank {src}", tensors, src, tag, ops.irecv_)

    def recv_anysource(self, tensors, tag):
        return self._p2p("recv from any source", tensors, -1, tag, ops.irecv_any_)

    def _p2p(self, what, tensors, peer, tag, post):
        closed, failure = self._runner.closed, self._runner.failure
        if closed or failure is not None:
            cause = "the group is shut down" if closed else f"the group already failed: {failure}"
            return failed_work(f"{self._describe(what)}: {cause}")
        requests = []
        try:
            for t in tensors:
                requests.append(post(self.ctx, t, peer, tag))
        except _gloo.GlooError as err:      # the group failed meanwhile (peer lost, aborted)
            self._note_failure(err)
            return failed_work(f"{self._describe(what)}: {type(err).__name__}: {err}")
        return HpctP2PWork(requests, self._describe(what), self._note_failure, tensors)
