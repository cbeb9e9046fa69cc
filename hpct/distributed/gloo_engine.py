"""The Gloo engine: CPU tensors on one storeless, abortable Gloo context.

The group facade (group.py) checks each call's arguments and hands it here with plain
arguments.  Every collective is queued, in issue order, to this engine's worker thread (the
context runs one at a time) and returns a Work wrapping a torch Future.  A send or recv is
posted at once on the caller's thread and completed by its Work's wait() (HpctP2PWork), so
any order of sends and receives completes.  A transport error (peer lost, abort, timeout)
fails the engine: every op queued after it fails at once with the same cause, so nothing
waits for a dead group; a local error (bad argument, unsupported dtype) fails only its op.
"""

from __future__ import annotations

import queue
import threading

import torch
from torch.futures import Future

from .. import _gloo
from . import ops
from .work import HpctP2PWork, HpctWork, _unpack


def _failed_work(message: str) -> HpctWork:
    raw = Future()
    raw.set_result((False, message))
    return HpctWork(raw, raw.then(_unpack))


class GlooEngine:
    """The CPU half of an hpct group; ``describe(what)`` words its errors."""

    device_type = "cpu"

    def __init__(self, ctx, *, rank: int, describe, thread_name: str):
        self.ctx = ctx
        self._rank = rank
        self._describe = describe
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._busy = False               # the worker is inside an op
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._thread.start()

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    @property
    def timeout(self) -> float:
        return self.ctx.timeout

    def set_timeout(self, seconds: float) -> None:
        self.ctx.set_timeout(seconds)     # ops queued before keep theirs only if already running

    # ---- the worker -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            what, fn, raw, result, inference = item
            if self._failure is not None:
                raw.set_result((False, f"{self._describe(what)}: the group already failed: {self._failure}"))
                continue
            try:
                with self._lock:
                    self._busy = True
                # The caller's inference mode travels with the op: outputs made under
                # torch.inference_mode() may only be written in that mode.
                with torch.inference_mode(inference):
                    fn()
            except BaseException as err:   # noqa: BLE001 -- every error goes to the future
                self._note_failure(err)
                raw.set_result((False, f"{self._describe(what)}: {type(err).__name__}: {err}"))
                continue
            finally:
                with self._lock:
                    self._busy = False
            raw.set_result((True, result))

    def submit(self, what: str, fn, result):
        # The worker completes ``raw`` with (ok, value); the Work's future is raw.then(_unpack),
        # so a failure becomes a real C++ error of the future (an exception raised in a
        # then-callback is stored as such) that C++ consumers such as DDP's reducer see.
        # Future.set_exception would store the exception object as a *value*.
        with self._lock:
            closed = self._closed
        if closed:
            return _failed_work(f"{self._describe(what)}: the group is shut down")
        raw = Future()
        self._queue.put((what, fn, raw, result, torch.is_inference_mode_enabled()))
        return HpctWork(raw, raw.then(_unpack))

    def _note_failure(self, err) -> None:
        # Only a transport error ends the group.
        if isinstance(err, _gloo.GlooError):
            with self._lock:
                if self._failure is None:
                    self._failure = err

    def abort(self, reason: str) -> None:
        """Wake the op in flight and fail every queued op; bounded; any thread."""
        with self._lock:
            if self._failure is None:
                self._failure = RuntimeError(f"aborted: {reason}")
        self.ctx.abort(reason)

    def shutdown(self, timeout: float) -> bool:
        """Stop the worker and release the context; False if it was already shut down.

        An idle engine closes gracefully: peers first read everything this rank sent (the
        end of a barrier they are still finishing), then its goodbye, and fail nothing.
        With an op running or queued the context is aborted instead.
        """
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            busy = self._busy or not self._queue.empty()
        if busy:
            self.abort("process group shut down")
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
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
        with self._lock:
            closed, failure = self._closed, self._failure
        if closed or failure is not None:
            cause = "the group is shut down" if closed else f"the group already failed: {failure}"
            return _failed_work(f"{self._describe(what)}: {cause}")
        requests = []
        try:
            for t in tensors:
                requests.append(post(self.ctx, t, peer, tag))
        except _gloo.GlooError as err:      # the group failed meanwhile (peer lost, aborted)
            self._note_failure(err)
            return _failed_work(f"{self._describe(what)}: {type(err).__name__}: {err}")
        return HpctP2PWork(requests, self._describe(what), self._note_failure, tensors)
