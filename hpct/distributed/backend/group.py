"""The ``hpct`` c10d process group: the one object torch sees, over one engine per device type.

torch calls each collective with the list forms (``[tensor]``, ``[[outputs]]``) or the short
forms its own ProcessGroup binds (``broadcast(tensor, root=0)``, ``allreduce(tensor, op)``,
...).  The facade normalises the call, checks its arguments as ProcessGroupGloo does
(checks.py: refused at the call, nothing sent), picks the engine of the tensors' device
type and hands it plain arguments; the engine returns the Work: ``cpu`` → the Gloo
engine (gloo_engine.py), ``cuda`` → the NCCL engine (nccl_engine.py, attached by world.py
when torch sees a CUDA device).  Lifecycle (abort, shutdown, exit) is written once here, for
every engine; creation lives in world.py, recovery in recovery.py.  docs/architecture.md draws it.
"""

from __future__ import annotations

import atexit
import datetime
import sys
import weakref

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import BroadcastOptions, GatherOptions, ReduceOptions, ScatterOptions

from . import checks, ops
from .gloo_engine import GlooEngine
from .monitor import monitored_barrier

BACKEND_NAME = "hpct"

# Groups whose engines may still run; shut down at interpreter exit (see _shutdown_at_exit).
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


def _as_list(tensors) -> list:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _reduce_op(opts):
    """The ReduceOp of an options object, of a bare op (torch's short forms) or SUM."""
    if opts is None:
        return dist.ReduceOp.SUM
    return opts.reduceOp if hasattr(opts, "reduceOp") else opts


class HpctProcessGroup(dist.ProcessGroup):
    """A rootless, abortable process group; its CPU tensors run on hpct's storeless Gloo."""

    def __init__(self, ctx, *, group_name: str, group_index: int, global_ranks: list[int]):
        super().__init__(ctx.rank, ctx.size)
        self._rank = ctx.rank
        self._size = ctx.size
        self.hpct_group_name = group_name
        self.group_index = group_index
        self.global_ranks = list(global_ranks)
        self.generation = ctx.generation
        self._closed = False
        self.awaiting_reconfigure = False    # made with enable_reconfigure: no membership yet
        self.abort_hooks: dict = {}          # hook id -> callable(), torch's register_abort_hook
        self.aborted_by_caller = False       # abort() was called (torch's get_error: no comm error)
        self.used_uuids: set = set()         # reconfigure uuids this group has taken
        self._use(ctx)
        self.on_shutdown = None          # set by the world registry
        _LIVE.add(self)

    def _use(self, ctx) -> None:
        """Serve CPU tensors on ``ctx`` (a fresh engine); other engines are attached after."""
        self._gloo = GlooEngine(ctx, rank=ctx.rank, describe=self._describe,
                                thread_name=f"hpct-pg-{self.hpct_group_name}")
        self._all = [self._gloo]                 # every engine, for the lifecycle
        self._engines = {"cpu": self._gloo}      # the engine that serves each device type
        self._gloo.on_failure = self._engine_failed

    def stop_engines(self, timeout: float) -> None:
        """Stop every engine (an op in flight is aborted); until serve(), ops are refused
        (reconfigure.py: the group object stays, torch holds it)."""
        self.awaiting_reconfigure = True
        for engine in self._all:
            engine.shutdown(timeout)

    def serve(self, ctx, *, global_ranks: list[int], generation: int) -> None:
        """Go on over ``ctx``, a new membership, on a fresh engine; attach device engines after."""
        self._rank, self._size = ctx.rank, ctx.size
        self.global_ranks, self.generation = list(global_ranks), generation
        self.aborted_by_caller = False
        self._use(ctx)
        self.awaiting_reconfigure = False

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
        """The Gloo context of the CPU engine."""
        return self._gloo.ctx

    @property
    def failure(self) -> BaseException | None:
        """What failed the group (the first engine's failure), or None."""
        return next((e.failure for e in self._all if e.failure is not None), None)

    @property
    def options(self):
        """What torch reads from a backend's options (timeout, ranks, name); read-only here."""
        return _Options(self)

    def _set_default_timeout(self, timeout):
        """The op timeout of every op issued from now on, on every engine (as ProcessGroupGloo)."""
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        if not seconds > 0:
            checks.fail("_set_default_timeout", f"invalid timeout {timeout!r}", "pass a positive timedelta")
        for engine in self._all:
            engine.set_timeout(seconds)

    def _describe(self, what: str) -> str:
        return (f"hpct {what} failed on group {self.hpct_group_name} (rank {self._rank} of {self._size}, "
                f"global rank {self.global_ranks[self._rank]}, generation {self.generation})")

    def _engine(self, op: str, tensors, *, one_tensor: bool = False):
        if self.awaiting_reconfigure:
            checks.fail(op, "this group has no members: its last reconfigure failed, or it was made with "
                            "enable_reconfigure=True and has had none yet",
                        "call torch.distributed._reconfigure(uuid, handles) with a fresh uuid on every member")
        engine = self._engines[checks.device(op, tensors, self._engines)]
        if one_tensor and engine is not self._gloo:
            # Several tensors per rank are a Gloo form; ProcessGroupNCCL refuses them too.
            checks.single(op, tensors, f"tensor list on {engine.device_type}")
        return engine

    @staticmethod
    def _go(engine, opts, method: str, *args):
        """``engine.method(*args)``.  A blocking call (torch sets ``asyncOp=False`` when the caller
        waits at once) may run on this thread: no handoff to the worker (runner.py)."""
        if getattr(opts, "asyncOp", True) is False and hasattr(engine, "blocking"):
            return engine.blocking(getattr(engine, method), *args)
        return getattr(engine, method)(*args)

    # torch's shrink_group asks the group's backend for the device (this object: the group is
    # its own backend) whether it can shrink, then calls its shrink(); elastic.py sets `shrinker`.
    supports_shrinking = True
    shrinker = None

    def _get_backend(self, device):
        if torch.device(device).type not in self._engines:
            raise RuntimeError(f"{self!r} has no backend for device type {torch.device(device).type}")
        return self

    def shrink(self, ranks_to_exclude, shrink_flags=0, pg_options=None):
        return type(self).shrinker(self, list(ranks_to_exclude), shrink_flags, pg_options)

    def attach(self, engine, device_type: str | None = None) -> None:
        """Serve ``device_type`` (default: the engine's own) with ``engine``; world.py attaches the
        CUDA engine.  The group's lifecycle (abort, shutdown) covers every engine attached."""
        self._all.append(engine)
        self._engines[device_type or engine.device_type] = engine
        engine.on_failure = self._engine_failed

    # torch's _coalescing_manager(device=...) brackets ops this way; an engine that batches
    # (NCCL: one group) takes the bracket, any other device keeps torch's own behaviour.
    def _batching(self, device):
        engine = self._engines.get(torch.device(device).type)
        return engine if hasattr(engine, "start_coalescing") else None

    def _start_coalescing(self, device):
        engine = self._batching(device)
        return engine.start_coalescing() if engine else super()._start_coalescing(device)

    def _end_coalescing(self, device):
        engine = self._batching(device)
        return engine.end_coalescing() if engine else super()._end_coalescing(device)

    # ---- lifecycle ------------------------------------------------------------------------
    def abort(self, reason: str = "aborted by the application") -> None:
        """Wake every op in flight and fail every queued op, on every engine; bounded; any thread."""
        self.aborted_by_caller = True
        self._fire_abort_hooks()
        for engine in self._all:
            engine.abort(reason)

    # torch's hooks and error API (torch >= 2.14; plain methods before it).  A hook fires once
    # when the group aborts: abort(), or the first failure that ends it (an op timeout, a lost
    # peer: a peer's own timeout can close the link before this rank's fires, so both must
    # count); never while a lock of the group is held.
    supports_abort_hooks = True

    def register_abort_hook(self, hook_id, hook) -> None:
        self.abort_hooks[int(hook_id)] = hook

    def unregister_abort_hook(self, hook_id) -> None:
        self.abort_hooks.pop(int(hook_id), None)

    def _fire_abort_hooks(self) -> None:
        for hook_id, hook in list(self.abort_hooks.items()):
            try:
                hook()
            except Exception as err:   # noqa: BLE001 -- a hook's failure never stops the abort
                print(f"hpct: abort hook {hook_id} of {self!r} raised {type(err).__name__}: {err}",
                      file=sys.stderr)

    @staticmethod
    def _timed_out(err) -> bool:
        # Gloo's OpTimeoutError/ConnectTimeoutError, the NCCL engine's NcclOpTimeoutError
        return "Timeout" in type(err).__name__

    def _engine_failed(self, err) -> None:
        if not self.aborted_by_caller:      # abort() has fired them already
            self._fire_abort_hooks()

    def get_error(self):
        """torch's ErrorType of what failed the group: SUCCESS when nothing did or the caller
        aborted it, TIMEOUT for an op timeout, REMOTE_ERROR for a lost peer, else COMM_ERROR."""
        from torch._C._distributed_c10d import ErrorType
        failure = self.failure
        if failure is None or self.aborted_by_caller:
            return ErrorType.SUCCESS
        if self._timed_out(failure):
            return ErrorType.TIMEOUT
        return ErrorType.REMOTE_ERROR if type(failure).__name__ == "PeerError" else ErrorType.COMM_ERROR

    def set_timeout(self, timeout) -> None:
        self._set_default_timeout(timeout)

    # torch's reconfigure API (torch >= 2.14): reconfigure.py sets `reconfigurer`.
    reconfigurer = None

    @property
    def supports_reconfigure(self) -> bool:
        return type(self).reconfigurer is not None

    def get_reconfigure_handle(self) -> str:
        return type(self).reconfigurer.handle(self)

    def reconfigure(self, opts):
        return type(self).reconfigurer.run(self, opts)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every engine and release its transport (ports, sockets, threads).

        An idle group closes gracefully (peers fail nothing); a group with an op running or
        queued, or a send/recv not yet waited for, is aborted instead (see the engines).
        """
        if self._closed:
            return
        self._closed = True
        for engine in self._all:
            engine.shutdown(timeout)
        _LIVE.discard(self)
        if self.on_shutdown is not None:
            self.on_shutdown(self)

    # ---- collectives: normalise, check, dispatch ------------------------------------------
    def allreduce(self, tensors, opts=None):
        tensors = _as_list(tensors)
        op = _reduce_op(opts)
        checks.nonempty("allreduce", tensors)
        engine = self._engine("allreduce", tensors, one_tensor=True)
        if tensors[0].layout == torch.sparse_coo:
            checks.sparse("allreduce", tensors, op)
            return engine.sparse_allreduce(tensors, op)
        checks.dense("allreduce", tensors)
        checks.like("allreduce", tensors[1:], tensors[0], start=1)
        ops.op_name(op)   # reject PREMUL_SUM & co. at the call, as ProcessGroupGloo does
        return self._go(engine, opts, "allreduce", tensors, op)

    def allreduce_coalesced(self, tensors, opts=None):
        tensors = _as_list(tensors)
        op = _reduce_op(opts)
        checks.nonempty("allreduce_coalesced", tensors)
        engine = self._engine("allreduce_coalesced", tensors)
        checks.coalesced("allreduce_coalesced", tensors)
        ops.op_name(op)
        return self._go(engine, opts, "allreduce_coalesced", tensors, op)

    def broadcast(self, tensors, opts=None, root=None):
        tensors = _as_list(tensors)
        opts = opts if opts is not None else BroadcastOptions()
        if root is not None:
            opts.rootRank = root
        checks.root_rank("broadcast", opts.rootRank, self._size)
        checks.root_tensor("broadcast", opts.rootTensor, len(tensors))
        engine = self._engine("broadcast", tensors, one_tensor=True)
        checks.dense("broadcast", tensors)
        checks.like("broadcast", tensors, tensors[0])
        return self._go(engine, opts, "broadcast", tensors, opts.rootRank, opts.rootTensor)

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
        engine = self._engine("reduce", tensors)
        checks.dense("reduce", tensors)
        ops.op_name(op)
        return self._go(engine, opts, "reduce", tensors[0], root, op)

    def allgather(self, output_tensors, input_tensors, opts=None):
        if isinstance(input_tensors, torch.Tensor):        # allgather([outputs], tensor)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        checks.nonempty("allgather", input_tensors, "input tensor list")
        checks.allgather_lists("allgather", output_tensors, input_tensors, self._size)
        engine = self._engine("allgather", input_tensors, one_tensor=True)
        checks.dense("allgather", input_tensors)
        checks.like("allgather", input_tensors[1:], input_tensors[0], start=1)
        for outs in output_tensors:
            checks.like("allgather", outs, input_tensors[0])
        return self._go(engine, opts, "allgather", output_tensors, input_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        checks.nonempty("allgather_coalesced", input_list, "input tensor list")
        if len(output_lists) != self._size:
            checks.fail("allgather_coalesced", f"output lists should be equal to world size "
                        f"({len(output_lists)} given, the group has {self._size})",
                        "pass one output list per rank: output_lists[rank][i] receives rank's input i")
        engine = self._engine("allgather_coalesced", input_list)
        checks.dense("allgather_coalesced", input_list)
        checks.coalesced_outputs("allgather_coalesced", output_lists, input_list)
        return self._go(engine, opts, "allgather_coalesced", output_lists, input_list)

    def all_gather_single(self, output, input, opts=None):
        engine = self._engine("all_gather_into_tensor", [output, input])
        if output.dtype != input.dtype:
            checks.fail("all_gather_into_tensor", f"invalid tensor type: output {output.dtype}, input "
                        f"{input.dtype}", "pass an output of the input's dtype")
        if output.numel() != input.numel() * self._size:
            checks.fail("all_gather_into_tensor", f"invalid tensor size: output has {output.numel()} "
                        f"elements, expected {self._size} x {input.numel()}",
                        "size the output as group size x input")
        return self._go(engine, opts, "all_gather_single", output, input)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        if len(outputs) != len(inputs):
            checks.fail("all_gather_into_tensor_coalesced", "requires input/output tensor lists to have "
                        "the same length", "pass one output per input")
        for o, i in zip(outputs, inputs):
            if o.dtype != i.dtype or o.numel() != i.numel() * self._size:
                checks.fail("all_gather_into_tensor_coalesced", "invalid tensor size or type: each output "
                            "needs its input's dtype and group size x its elements", "size the outputs so")
        engine = self._engine("all_gather_into_tensor_coalesced", [*outputs, *inputs])
        return self._go(engine, opts, "all_gather_single_coalesced", outputs, inputs)

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
        return self._go(self._engine("reduce_scatter", [out, *ins]), opts, "reduce_scatter", out, ins, op)

    def reduce_scatter_single(self, output, input, opts=None):
        op = _reduce_op(opts)
        ops.op_name(op)
        if input.numel() != output.numel() * self._size:
            checks.fail("reduce_scatter_tensor", f"invalid tensor size: input has {input.numel()} "
                        f"elements, expected {self._size} x {output.numel()}",
                        "size the input as group size x output")
        return self._go(self._engine("reduce_scatter_tensor", [output, input]), opts, "reduce_scatter_single",
                        output, input, op)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = _reduce_op(opts)
        ops.op_name(op)
        for o, i in zip(outputs, inputs):
            if i.numel() != o.numel() * self._size:
                checks.fail("reduce_scatter_tensor_coalesced", "invalid tensor size: each input needs "
                            "group size x its output's elements", "size the inputs so")
        engine = self._engine("reduce_scatter_tensor_coalesced", [*outputs, *inputs])
        return self._go(engine, opts, "reduce_scatter_single_coalesced", outputs, inputs, op)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        engine = self._engine("all_to_all_single", [output, input])
        return self._go(engine, opts, "all_to_all_single", output, input, output_split_sizes, input_split_sizes)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        checks.list_size("all_to_all", len(input_tensors), self._size, "input")
        checks.list_size("all_to_all", len(output_tensors), self._size, "output")
        engine = self._engine("all_to_all", [*output_tensors, *input_tensors])
        return self._go(engine, opts, "alltoall", output_tensors, input_tensors)

    def gather(self, output_tensors, input_tensors, opts=None, root=None):
        if isinstance(input_tensors, torch.Tensor):        # gather([outputs], tensor, root)
            input_tensors = [input_tensors]
            output_tensors = [output_tensors] if output_tensors else []
            opts, root = None, (opts if root is None else root)
        engine, opts, inp, outs = self._rooted("gather", input_tensors, output_tensors, opts, root,
                                               GatherOptions, local="input", rooted="output")
        return self._go(engine, opts, "gather", outs, inp, opts.rootRank)

    def scatter(self, output_tensors, input_tensors, opts=None, root=None):
        if isinstance(output_tensors, torch.Tensor):       # scatter(out, [inputs], root)
            output_tensors = [output_tensors]
            input_tensors = [input_tensors] if input_tensors else []
            opts, root = None, (opts if root is None else root)
        engine, opts, out, ins = self._rooted("scatter", output_tensors, input_tensors, opts, root,
                                              ScatterOptions, local="output", rooted="input")
        return self._go(engine, opts, "scatter", out, ins, opts.rootRank)

    def _rooted(self, op, mine, lists, opts, root, options, *, local, rooted):
        """gather/scatter: the engine, the options (root set), this rank's tensor and the root's
        list (None elsewhere)."""
        opts = opts if opts is not None else options()
        if root is not None:
            opts.rootRank = root
        root = opts.rootRank
        checks.root_rank(op, root, self._size)
        checks.single(op, mine, f"{local} tensor list")
        engine = self._engine(op, mine)
        checks.dense(op, mine)
        return engine, opts, mine[0], checks.root_list(op, lists, self._rank, root, self._size, mine[0], rooted)

    def barrier(self, opts=None):
        return self._go(self._engines["cpu"], opts, "barrier")

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        """Gloo's monitored barrier on this group (``hpct.distributed.monitored_barrier``)."""
        return monitored_barrier(self, timeout, wait_all_ranks)

    # ---- point to point --------------------------------------------------------------------
    def send(self, tensors, dst, tag=0):
        return self._p2p(f"send to rank {dst}", tensors, dst, tag).send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        return self._p2p(f"recv from rank {src}", tensors, src, tag).recv(tensors, src, tag)

    def _p2p(self, what, tensors, peer, tag):
        engine = self._engine("point-to-point", tensors)
        if tag < 0:
            raise ValueError(f"hpct {what}: tag must be non-negative, got {tag}")
        return engine

    def recv_anysource(self, tensors, tag=0):
        engine = self._p2p("recv from any source", tensors, -1, tag)
        checks.single("recv from any source", tensors, "tensor list")
        if not hasattr(engine, "recv_anysource"):
            checks.fail("recv from any source", f"{engine.device_type} tensors have no receive from any "
                        "source (NCCL has none)", "pass src=, or receive a CPU tensor")
        return engine.recv_anysource(tensors, tag)


class _Options:
    """A snapshot of the group's settings in the shape of ProcessGroupGloo.Options."""

    backend = BACKEND_NAME

    def __init__(self, pg: "HpctProcessGroup"):
        self._timeout = datetime.timedelta(seconds=pg.context.timeout)
        self.global_ranks_in_group = list(pg.global_ranks)
        self.group_name = pg.group_name
        self.generation = pg.generation
