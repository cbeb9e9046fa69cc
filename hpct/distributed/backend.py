"""The ``hpct`` c10d process group: a Python ProcessGroup over one storeless Gloo context.

Every collective is queued, in issue order, to the group's worker thread (the context runs
one at a time) and returns a Work wrapping a torch Future; ``async_op=True`` and
``Work.wait()`` work as with any backend.  A send or recv is posted at once on the caller's
thread and completed by its Work's wait() (HpctP2PWork), so any order of sends and receives
completes.  An op that fails completes its future with an
exception naming the group, this rank, the generation and (from Gloo) the peer; every op
queued after a failure fails at once with the same cause, so nothing waits for a dead
group.  ``abort()`` is bounded and may be called from any thread: the context wakes the op
in flight (AbortedError) and frees the listening port.
"""

from __future__ import annotations

import atexit
import datetime
import queue
import sys
import threading
import weakref

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import BroadcastOptions, GatherOptions, ReduceOptions, ScatterOptions
from torch.futures import Future

from .. import _gloo
from . import checks, ops
from .work import HpctP2PWork, HpctWork, _unpack

BACKEND_NAME = "hpct"

# Groups whose worker may still run; shut down at interpreter exit (see _shutdown_at_exit).
_LIVE: "weakref.WeakSet[HpctProcessGroup]" = weakref.WeakSet()
EXIT_SHUTDOWN_S = 5.0   # per group: the abort wakes the op in flight, so this is a bound only


def _shutdown_at_exit() -> None:
    """Fail queued ops and stop every worker before the interpreter finalizes.

    A worker still inside an op when finalization begins would be ended by the
    interpreter while it takes the GIL back; shutting the groups down here (atexit runs
    before that) lets every op end with an error and every worker return.
    """
    for pg in list(_LIVE):
        try:
            pg.shutdown(EXIT_SHUTDOWN_S)
        except Exception as err:   # noqa: BLE001 -- exit goes on; say what was left
            print(f"hpct: shutting down {pg!r} at exit failed: {type(err).__name__}: {err}",
                  file=sys.stderr)


atexit.register(_shutdown_at_exit)


def _check_cpu(tensors) -> None:
    checks.cpu("point-to-point", tensors)


def _as_list(tensors) -> list:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _reduce_op(opts):
    """The ReduceOp of an options object, of a bare op (torch's short forms) or SUM."""
    if opts is None:
        return dist.ReduceOp.SUM
    return opts.reduceOp if hasattr(opts, "reduceOp") else opts


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
        self._busy = False               # the worker is inside an op
        self._thread = threading.Thread(target=self._loop, name=f"hpct-pg-{group_name}", daemon=True)
        self._thread.start()
        self.on_shutdown = None          # set by the world registry
        _LIVE.add(self)

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

    @property
    def options(self):
        """What torch reads from a backend's options (timeout, ranks, name); read-only here."""
        return _Options(self)

    def _set_default_timeout(self, timeout):
        checks.fail("_set_default_timeout", "the op timeout of an hpct group is fixed when the group is "
                    f"created ({self._ctx.timeout:g} s)",
                    "pass timeout= to init_process_group or new_group")

    # ---- the worker -----------------------------------------------------------------------
    def _describe(self, what: str) -> str:
        return (f"hpct {what} failed on group {self.hpct_group_name} (rank {self._rank} of {self._size}, "
                f"global rank {self.global_ranks[self._rank]}, generation {self.generation})")

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
                # A transport error (peer lost, abort, timeout) ends the group; a local one
                # (bad argument, unsupported dtype) fails only this op.
                if isinstance(err, _gloo.GlooError):
                    with self._lock:
                        if self._failure is None:
                            self._failure = err
                raw.set_result((False, f"{self._describe(what)}: {type(err).__name__}: {err}"))
                continue
            finally:
                with self._lock:
                    self._busy = False
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
            self._queue.put((what, fn, raw, result, torch.is_inference_mode_enabled()))
        return HpctWork(raw, raw.then(_unpack))

    def abort(self, reason: str = "aborted by the application") -> None:
        """Wake the op in flight and fail every queued op; bounded; any thread."""
        with self._lock:
            if self._failure is None:
                self._failure = RuntimeError(f"aborted: {reason}")
        self._ctx.abort(reason)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the worker and release the context (port, sockets, loop thread).

        An idle group closes gracefully: peers first read everything this rank sent (the
        end of a barrier they are still finishing), then its goodbye, and fail nothing.
        With an op running or queued (or a send/recv not yet waited for) the group is
        aborted instead: the op fails at once and peers see a reset.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            busy = self._busy or not self._queue.empty()
        if busy:
            self.abort("process group shut down")
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._ctx.close()
        _LIVE.discard(self)
        if self.on_shutdown is not None:
            self.on_shutdown(self)

    # ---- collectives ----------------------------------------------------------------------
    # Each method takes the list forms torch passes (``[tensor]``, ``[[outputs]]``) and the
    # short forms that torch's own ProcessGroup binds (``broadcast(tensor, root=0)``,
    # ``allreduce(tensor, op)``, ...), checks its arguments at the call as Gloo does
    # (checks.py) and queues the op.  Several tensors per rank mean what they mean for Gloo.
    def allreduce(self, tensors, opts=None):
        tensors = _as_list(tensors)
        op = _reduce_op(opts)
        checks.nonempty("allreduce", tensors)
        checks.cpu("allreduce", tensors)
        if tensors[0].layout == torch.sparse_coo:
            return self._sparse_allreduce(tensors, op)
        checks.dense("allreduce", tensors)
        checks.like("allreduce", tensors[1:], tensors[0], start=1)
        ops.op_name(op)   # reject PREMUL_SUM & co. at the call, as ProcessGroupGloo does

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

    def _sparse_allreduce(self, tensors, op):
        for i, t in enumerate(tensors):
            if t.layout != torch.sparse_coo:
                checks.fail("allreduce", f"invalid tensor layout at index {i} ({t.layout})",
                            "pass only sparse COO tensors, or only dense ones")
        checks.like("allreduce", tensors[1:], tensors[0], start=1)
        if ops.op_name(op) != "sum":
            checks.fail("allreduce", f"unsupported reduction operation {ops.op_label(op)} for sparse "
                        "tensors", "reduce sparse tensors with ReduceOp.SUM")

        def run():
            total = ops.sparse_allreduce(self._ctx, tensors)
            for t in tensors:
                t.copy_(total)
        return self._submit("allreduce (sparse)", run, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        tensors = _as_list(tensors)
        op = _reduce_op(opts)
        checks.nonempty("allreduce_coalesced", tensors)
        checks.cpu("allreduce_coalesced", tensors)
        for i, t in enumerate(tensors):
            if t.layout != tensors[0].layout:
                checks.fail("allreduce_coalesced", f"invalid tensor layout at index {i} ({t.layout})",
                            "pass tensors of one layout")
            if t.dtype != tensors[0].dtype:
                checks.fail("allreduce_coalesced", f"tensors must all have the same type (index {i} is "
                            f"{t.dtype}, index 0 {tensors[0].dtype})", "coalesce tensors of one dtype")
        if tensors[0].layout != torch.strided:
            checks.fail("allreduce_coalesced", f"unsupported layout {tensors[0].layout}",
                        "coalesce dense tensors; reduce sparse ones with all_reduce")
        ops.op_name(op)
        return self._submit("allreduce_coalesced",
                            lambda: ops.allreduce_coalesced_(self._ctx, tensors, op), tensors)

    def broadcast(self, tensors, opts=None, root=None):
        tensors = _as_list(tensors)
        opts = opts if opts is not None else BroadcastOptions()
        if root is not None:
            opts.rootRank = root
        root = opts.rootRank
        checks.root_rank("broadcast", root, self._size)
        checks.root_tensor("broadcast", opts.rootTensor, len(tensors))
        checks.cpu("broadcast", tensors)
        checks.dense("broadcast", tensors)
        checks.like("broadcast", tensors, tensors[0])
        tensor = tensors[opts.rootTensor]

        def run():
            ops.broadcast_(self._ctx, tensor, root)
            for t in tensors:          # every local tensor ends up as the root's tensor (as Gloo)
                if t is not tensor:
                    t.copy_(tensor)
        return self._submit("broadcast", run, tensors)

    def reduce(self, tensors, opts=None, op=None, root=None):
        tensors = _as_list(tensors)
        if not isinstance(opts, ReduceOptions):        # reduce(tensor, root, op)
            root = opts if root is None else root
            opts = ReduceOptions()
            if root is not None:
                opts.rootRank = root
            if op is not None:
                opts.reduceOp = op
        op, root = opts.reduceOp, opts.rootRank
        checks.root_rank("reduce", root, self._size)
        checks.root_tensor("reduce", opts.rootTensor, len(tensors))
        checks.single("reduce", tensors, "tensor list")
        checks.cpu("reduce", tensors)
        checks.dense("reduce", tensors)
        ops.op_name(op)
        tensor = tensors[0]

        def run():
            work = tensor.clone()
            ops.allreduce_(self._ctx, work, op)
            if self._rank == root:
                tensor.copy_(work)
        return self._submit("reduce", run, tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        if isinstance(input_tensors, torch.Tensor):        # allgather([outputs], tensor)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        checks.nonempty("allgather", input_tensors, "input tensor list")
        if len(output_tensors) != len(input_tensors):
            checks.fail("allgather", "requires input/output tensor lists to have the same length "
                        f"({len(input_tensors)} input(s), {len(output_tensors)} output list(s))",
                        "pass one output list per input tensor")
        k = len(input_tensors)
        for i, outs in enumerate(output_tensors):
            if len(outs) != k * self._size:
                checks.fail("allgather", f"invalid output tensor list at index {i}: {len(outs)} tensors",
                            f"each output list needs {k * self._size} (inputs per rank x group size)")
        checks.cpu("allgather", input_tensors)
        checks.dense("allgather", input_tensors)
        checks.like("allgather", input_tensors[1:], input_tensors[0], start=1)
        for outs in output_tensors:
            checks.like("allgather", outs, input_tensors[0])

        def run():
            rows = ops.allgather_many(self._ctx, input_tensors)
            flat = [t for row in rows for t in row]        # [rank * k + i]
            for outs in output_tensors:
                for dst, src in zip(outs, flat):
                    dst.copy_(src)
        # The future's value as Gloo gives it: the output list itself for one input per rank.
        return self._submit("allgather", run, output_tensors[0] if k == 1 else output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        checks.nonempty("allgather_coalesced", input_list, "input tensor list")
        if len(output_lists) != self._size:
            checks.fail("allgather_coalesced", f"output lists should be equal to world size "
                        f"({len(output_lists)} given, the group has {self._size})",
                        "pass one output list per rank: output_lists[rank][i] receives rank's input i")
        checks.cpu("allgather_coalesced", input_list)
        checks.dense("allgather_coalesced", input_list)
        for outs in output_lists:
            if len(outs) != len(input_list):
                checks.fail("allgather_coalesced", f"invalid output tensor list: {len(outs)} tensors for "
                            f"{len(input_list)} inputs", "give every rank's output list one tensor per input")
            for i, (dst, src) in enumerate(zip(outs, input_list)):
                if dst.dtype != src.dtype:
                    checks.fail("allgather_coalesced", f"invalid tensor type at index {i}: output "
                                f"{dst.dtype}, input {src.dtype}", "match the output's dtype to the input's")
                if dst.numel() != src.numel():
                    checks.fail("allgather_coalesced", f"invalid size of output tensor at index {i}: "
                                f"{dst.numel()} elements, input {src.numel()}",
                                "match the output's size to the input's")

        def run():
            rows = ops.allgather_many(self._ctx, input_list)     # [rank][input], as torch's API
            for outs, row in zip(output_lists, rows):
                for dst, src in zip(outs, row):
                    dst.copy_(src.reshape(dst.shape))
        return self._submit("allgather_coalesced", run, output_lists)

    def all_gather_single(self, output, input, opts=None):
        checks.cpu("all_gather_into_tensor", [output, input])
        if output.dtype != input.dtype:
            checks.fail("all_gather_into_tensor", f"invalid tensor type: output {output.dtype}, input "
                        f"{input.dtype}", "pass an output of the input's dtype")
        if output.numel() != input.numel() * self._size:
            checks.fail("all_gather_into_tensor", f"invalid tensor size: output has {output.numel()} "
                        f"elements, expected {self._size} x {input.numel()}",
                        "size the output as group size x input")

        def run():
            if output.is_contiguous():
                src = input if input.is_contiguous() else input.contiguous()
                if src.numel():       # straight into the output: no staging copy
                    self._ctx.allgather(ops.as_bytes(src), ops.as_bytes(output))
                return
            output.copy_(torch.stack(ops.allgather_tensor(self._ctx, input)).reshape(output.shape))
        return self._submit("all_gather_into_tensor", run, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        if len(outputs) != len(inputs):
            checks.fail("all_gather_into_tensor_coalesced", "requires input/output tensor lists to have "
                        "the same length", "pass one output per input")
        for o, i in zip(outputs, inputs):
            if o.dtype != i.dtype or o.numel() != i.numel() * self._size:
                checks.fail("all_gather_into_tensor_coalesced", "invalid tensor size or type: each output "
                            "needs its input's dtype and group size x its elements", "size the outputs so")

        def run():
            rows = ops.allgather_many(self._ctx, inputs)
            for j, output in enumerate(outputs):
                output.copy_(torch.stack([row[j] for row in rows]).reshape(output.shape))
        return self._submit("all_gather_into_tensor_coalesced", run, outputs)

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        if isinstance(output_tensors, torch.Tensor):      # reduce_scatter(out, [ins], op)
            output_tensors, input_lists = [output_tensors], [input_lists]
        op = _reduce_op(opts)
        ops.op_name(op)
        checks.single("reduce_scatter", output_tensors, "output tensor list")
        checks.single("reduce_scatter", input_lists, "input list")
        out, ins = output_tensors[0], input_lists[0]
        checks.list_size("reduce_scatter", len(ins), self._size, "input")
        checks.like("reduce_scatter", ins, out)
        return self._submit("reduce_scatter", lambda: ops.reduce_scatter_(self._ctx, out, ins, op),
                            output_tensors)

    def reduce_scatter_single(self, output, input, opts=None):
        op = _reduce_op(opts)
        ops.op_name(op)
        if input.numel() != output.numel() * self._size:
            checks.fail("reduce_scatter_tensor", f"invalid tensor size: input has {input.numel()} "
                        f"elements, expected {self._size} x {output.numel()}",
                        "size the input as group size x output")

        def run():
            flat = input.reshape(-1).clone()
            ops.allreduce_(self._ctx, flat, op)
            n = output.numel()
            output.copy_(flat[self._rank * n:(self._rank + 1) * n].reshape(output.shape))
        return self._submit("reduce_scatter_tensor", run, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = _reduce_op(opts)
        ops.op_name(op)
        for o, i in zip(outputs, inputs):
            if i.numel() != o.numel() * self._size:
                checks.fail("reduce_scatter_tensor_coalesced", "invalid tensor size: each input needs "
                            "group size x its output's elements", "size the inputs so")

        def run():
            for output, input in zip(outputs, inputs):
                flat = input.reshape(-1).clone()
                ops.allreduce_(self._ctx, flat, op)
                n = output.numel()
                output.copy_(flat[self._rank * n:(self._rank + 1) * n].reshape(output.shape))
        return self._submit("reduce_scatter_tensor_coalesced", run, outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        checks.cpu("all_to_all_single", [output, input])
        return self._submit(
            "all_to_all_single",
            lambda: ops.all_to_all_single_(self._ctx, output, input, output_split_sizes,
                                           input_split_sizes), [output])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        checks.list_size("all_to_all", len(input_tensors), self._size, "input")
        checks.list_size("all_to_all", len(output_tensors), self._size, "output")
        return self._submit("all_to_all", lambda: ops.alltoall_(self._ctx, output_tensors, input_tensors),
                            output_tensors)

    def gather(self, output_tensors, input_tensors, opts=None, root=None):
        if isinstance(input_tensors, torch.Tensor):        # gather([outputs], tensor, root)
            input_tensors = [input_tensors]
            output_tensors = [output_tensors] if output_tensors else []
            opts, root = None, (opts if root is None else root)
        opts = opts if opts is not None else GatherOptions()
        if root is not None:
            opts.rootRank = root
        root = opts.rootRank
        checks.root_rank("gather", root, self._size)
        checks.single("gather", input_tensors, "input tensor list")
        checks.cpu("gather", input_tensors)
        checks.dense("gather", input_tensors)
        inp = input_tensors[0]
        outs = None
        if self._rank == root:
            checks.single("gather", output_tensors, "output list")
            outs = output_tensors[0]
            checks.list_size("gather", len(outs), self._size, "output")
            checks.like("gather", outs, inp)
        elif len(output_tensors) != 0:
            checks.fail("gather", f"requires empty output on non-root (rank {self._rank}, root {root})",
                        "pass [] as the output list on every rank but the root")
        return self._submit("gather", lambda: ops.gather_(self._ctx, outs, inp, root),
                            outs if outs is not None else [])

    def scatter(self, output_tensors, input_tensors, opts=None, root=None):
        if isinstance(output_tensors, torch.Tensor):       # scatter(out, [inputs], root)
            output_tensors = [output_tensors]
            input_tensors = [input_tensors] if input_tensors else []
            opts, root = None, (opts if root is None else root)
        opts = opts if opts is not None else ScatterOptions()
        if root is not None:
            opts.rootRank = root
        root = opts.rootRank
        checks.root_rank("scatter", root, self._size)
        checks.single("scatter", output_tensors, "output tensor list")
        checks.cpu("scatter", output_tensors)
        checks.dense("scatter", output_tensors)
        out = output_tensors[0]
        ins = None
        if self._rank == root:
            checks.single("scatter", input_tensors, "input list")
            ins = input_tensors[0]
            checks.list_size("scatter", len(ins), self._size, "input")
            checks.like("scatter", ins, out)
        elif len(input_tensors) != 0:
            checks.fail("scatter", f"requires empty input on non-root (rank {self._rank}, root {root})",
                        "pass [] as the input list on every rank but the root")
        return self._submit("scatter", lambda: ops.scatter_(self._ctx, out, ins, root), output_tensors)

    def barrier(self, opts=None):
        return self._submit("barrier", self._ctx.barrier, [])

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        """Gloo's monitored barrier on this group (``hpct.distributed.monitored_barrier``)."""
        from .monitor import monitored_barrier
        return monitored_barrier(self, timeout, wait_all_ranks)

    # ---- point to point --------------------------------------------------------------------
    # A send or recv is posted at once on the caller's thread (never queued behind the
    # worker, which runs one collective at a time) and completed by its Work's wait(), as
    # ProcessGroupGloo does: sends and receives may be posted in any order on both ranks.
    def send(self, tensors, dst, tag=0):
        return self._p2p(f"send to rank {dst}", tensors, dst, tag, ops.isend_)

    def recv(self, tensors, src, tag=0):
        return self._p2p(f"recv from rank {src}", tensors, src, tag, ops.irecv_)

    def _p2p(self, what, tensors, peer, tag, post):
        _check_cpu(tensors)
        if tag < 0:
            raise ValueError(f"hpct {what}: tag must be non-negative, got {tag}")
        with self._lock:
            closed, failure = self._closed, self._failure
        if closed or failure is not None:
            cause = "the group is shut down" if closed else f"the group already failed: {failure}"
            raw = Future()
            raw.set_result((False, f"{self._describe(what)}: {cause}"))
            return HpctWork(raw, raw.then(_unpack))
        requests = []
        try:
            for t in tensors:
                requests.append(post(self._ctx, t, peer, tag))
        except _gloo.GlooError as err:      # the group failed meanwhile (peer lost, aborted)
            self._note_failure(err)
            raw = Future()
            raw.set_result((False, f"{self._describe(what)}: {type(err).__name__}: {err}"))
            return HpctWork(raw, raw.then(_unpack))
        return HpctP2PWork(requests, self._describe(what), self._note_failure, tensors)

    def _note_failure(self, err) -> None:
        if isinstance(err, _gloo.GlooError):
            with self._lock:
                if self._failure is None:
                    self._failure = err

    def recv_anysource(self, tensors, tag=0):
        raise NotImplementedError("the hpct backend has no recv from any source; pass src=")


class _Options:
    """A snapshot of the group's settings in the shape of ProcessGroupGloo.Options."""

    backend = BACKEND_NAME

    def __init__(self, pg: "HpctProcessGroup"):
        self._timeout = datetime.timedelta(seconds=pg.context.timeout)
        self.global_ranks_in_group = list(pg.global_ranks)
        self.group_name = pg.group_name
        self.generation = pg.generation


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
