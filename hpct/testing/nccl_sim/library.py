"""The simulated NCCL library: the methods of hpct.distributed.nccl.library.NcclLibrary the engine calls.

Semantics (NCCL's, as documented and as 2.30.7's sources behave):
- a non-blocking communicator: ncclCommInitRankRootless answers ncclInProgress and forms
  the ring (bootstrap.py) and the data context on a thread; ncclCommGetAsyncError answers
  ncclInProgress until then, ncclSuccess after, or the error;
- ncclGroupStart/End are per thread; on a non-blocking comm ncclGroupEnd answers ncclInProgress
  and the group's launch is "taken" after ``launch_polls`` polls of the comm's async state (or
  never, with the fault ``stuck_launch``); its kernel then runs on the stream (kernels.py);
- a blocking communicator: the init forms the ring in the calling thread and answers its
  result; ncclGroupEnd returns once the launch is taken, or -- ``stuck_launch``: a lazy connect
  to a peer that never answers -- holds the caller until ncclCommAbort from another thread,
  then answers an error;
- a peer that vanishes: the kernel's transfer fails, the comm's async state becomes
  ncclRemoteError, and the kernel hangs (as an NCCL kernel spins) until ncclCommAbort;
- ncclCommAbort from any thread: every later call on the comm is a breach; a hung kernel
  ends, the data context is aborted; ncclCommDestroy of an idle comm likewise.

Rules enforced (breach: see __init__.py): one call at a time on a comm (``jitter`` holds each
call open a little so that a race shows), no call after abort or destroy, no abort after a
revoke that left a group job dangling, no group left open or nested on a thread (an exception
between ncclGroupStart and ncclGroupEnd), no launch before the init or the previous launch
settled.

One module over 400 lines, one concern: the one object the engine sees as its NCCL, whose calls
share the rules above (kernels, the ring and the streams are the modules beside it).
"""

from __future__ import annotations

import itertools
import random
import threading
import time

from hpct.distributed.nccl import library as nccl_lib

from .breaches import breach
from .bootstrap import RingError, listen, ring_addresses, split_addr
from .callbacks import COLL, GATHER, GROUP, NCCL_INTERNAL_ERROR, P2P, ROOTED, Table
from .kernels import Kernel
from .runtime import CAPTURES, HANG_S, STREAMS

SUCCESS, IN_PROGRESS = nccl_lib.SUCCESS, nccl_lib.IN_PROGRESS
SYSTEM_ERROR, INVALID_ARGUMENT, INVALID_USAGE, REMOTE_ERROR = 2, 4, 5, 6
_handles = itertools.count(0x5100)


class SimComm:
    def __init__(self, lib, rank: int, nranks: int, spec):
        self.lib, self.rank, self.nranks, self.spec = lib, rank, nranks, spec
        self.handle = next(_handles)
        self.state = IN_PROGRESS          # the async result
        self.blocking = False             # config.blocking
        self.last_error = ""
        self.ctx = None                   # the data context (hpct's storeless Gloo)
        self.ended: str | None = None     # "aborted" / "destroyed"
        self.aborted = threading.Event()     # the abort flag as NCCL's loops see it
        self.flag = threading.Event()        # raised by ncclCommRaiseAbortFlag
        self.listener = None                 # the fixed-port listen socket, until the ring formed
        self.refused = 0                     # op calls refused (refuse_calls)
        self.launches = 0
        self.graphs = 0                      # groups captured into CUDA graphs that are still alive
        self.graphs_gone = threading.Event() # release_graphs(): every such graph destroyed
        self.in_call: str | None = None
        self.job_polls: int | None = None    # polls left before the linked group job is taken
        self.dangling_job = False
        self.kernels: list[Kernel] = []      # launched, not finished
        self.calls: list[tuple[str, str]] = []   # (thread, call) log
        self.groups: list[list[str]] = []        # each launched group's calls (tests read it)

    def close_listener(self) -> None:
        srv, self.listener = self.listener, None
        if srv is not None:
            srv.close()

    def fail(self, code: int, why: str) -> None:
        if self.state in (SUCCESS, IN_PROGRESS):
            self.state, self.last_error = code, why


class SimNccl:
    """Faults: ``launch_polls`` (polls before a launch is taken), ``stuck_launch`` (a launch is
    never taken), ``hang_op`` (kernels never complete), ``init_delay`` (seconds the init takes
    after the ring), ``jitter`` (seconds a call is held open, at most)."""

    path, how, shared_with_torch = "simulated", "hpct/testing/nccl_sim", False
    version = 23007
    version_text = "2.30.7 (simulated)"
    has_rootless = has_revoke = True
    init_what = staticmethod(nccl_lib.NcclLibrary.init_what)

    def __init__(self, *, launch_polls: int = 2, stuck_launch: bool = False, hang_op: bool = False,
                 init_delay: float = 0.0, jitter: float = 0.0, linger_s: float = 0.0,
                 raise_flag: bool = True, deaf_to_flag: bool = False, refuse_calls: int = 0,
                 stuck_from: int = 0, error_after_launch: bool = False, gate_kernels: bool = False):
        self.launch_polls, self.stuck_launch, self.hang_op = launch_polls, stuck_launch, hang_op
        self.stuck_from = stuck_from         # stuck_launch holds a comm's launches from this one on
        # error_after_launch: ncclGroupEnd enqueues the group's kernel and then answers an error
        # (a failure half-way through a launch): the kernel may run with the op's buffers
        self.error_after_launch = error_after_launch
        # raise_flag=False: a libnccl without hpct's ncclCommRaiseAbortFlag (an older drop-in);
        # deaf_to_flag: a held call that never returns, whatever its flag says, until ``release``
        # is set (the engine must leak the comm, and abort it once the call returned);
        # refuse_calls: each comm's first N op calls answer ncclInvalidArgument (as an fp8 sum below
        # sm_90 does on every rank).
        self.has_raise_abort = raise_flag
        self.deaf_to_flag = deaf_to_flag
        self.release = threading.Event()
        self.refuse_calls = refuse_calls
        self.linger_s = linger_s             # a hung kernel runs this long after the abort
        # gate_kernels: a hung kernel ends after the abort only once the test opens ``kernel_gate``
        self.kernel_gate = threading.Event()
        if not gate_kernels:
            self.kernel_gate.set()
        self.init_delay, self.jitter = init_delay, jitter
        self.comms: dict[int, SimComm] = {}
        self.on_abort: list = []             # tests: fn(comm) run inside ncclCommAbort
        self._group = threading.local()
        self._lock = threading.Lock()
        self._table: Table | None = None
        self._table_lock = threading.Lock()    # ranks bind at once; a losing table would free its callbacks
        self.group_starts = 0                # ncclGroupStart calls (tests: what a launch reached)

    # ---- the rules ---------------------------------------------------------------------------
    def _enter(self, handle, call: str, *, abort: bool = False) -> SimComm:
        comm = self.comms.get(handle)
        if comm is None:
            raise breach(f"{call} on an unknown communicator handle {handle!r}")
        with self._lock:
            comm.calls.append((threading.current_thread().name, call))
            if comm.ended:
                raise breach(f"{call} on a communicator after {comm.ended} (rank {comm.rank}): "
                             "a use after free")
            if comm.in_call is not None:
                if abort:
                    raise breach(f"ncclCommAbort on rank {comm.rank}'s communicator while another thread is inside "
                                 f"{comm.in_call}: NCCL frees the comm under that call (abort only when no "
                                 "thread is inside a call on the comm: raise its abort flag first)")
                raise breach(f"{call} on rank {comm.rank}'s communicator while another thread is inside "
                             f"{comm.in_call}: every call on a comm must hold its lock")
            if not abort:
                comm.in_call = call
        if self.jitter and not abort:
            time.sleep(random.uniform(0, self.jitter))
        return comm

    def _leave(self, comm: SimComm) -> None:
        comm.in_call = None

    # ---- the library's facts and errors -------------------------------------------------------
    def require_rootless(self) -> None:
        pass

    def error_string(self, code: int) -> str:
        return {SYSTEM_ERROR: "unhandled system error", INVALID_USAGE: "invalid usage",
                INVALID_ARGUMENT: "invalid argument",
                REMOTE_ERROR: "remote process exited or there was a network error"}.get(code, f"error {code}")

    def error(self, code: int, what: str, comm=None) -> nccl_lib.NcclError:
        cls = nccl_lib.RESULT_ERRORS.get(code, nccl_lib.NcclError)
        c = self.comms.get(comm) if comm is not None else None
        last = f"; last error: {c.last_error}" if c is not None and c.last_error else ""
        return cls(f"{what}: NCCL {self.error_string(code)} ({cls.result_name}, {code}){last}", code=code)

    def check(self, code: int, what: str, comm=None, *, allow_in_progress: bool = False) -> int:
        if code == SUCCESS or (allow_in_progress and code == IN_PROGRESS):
            return code
        raise self.error(code, what, comm)

    # ---- communicators ----------------------------------------------------------------------------
    def init_rootless(self, box, nranks: int, rank: int, spec, *, blocking: bool) -> int:
        """As NCCL: ``*box`` is set before the init runs; a blocking init runs in the caller (its
        call is open until it returns), a non-blocking one on NCCL's own thread."""
        comm = SimComm(self, rank, nranks, spec)
        comm.blocking = blocking
        self.comms[comm.handle] = comm
        box.value = comm.handle
        if blocking:
            self._enter(comm.handle, "ncclCommInitRankRootless")
            try:
                self._form(comm)
            finally:
                self._leave(comm)
            return comm.state
        threading.Thread(target=self._form, args=(comm,), daemon=True, name=f"sim-init-{rank}").start()
        return IN_PROGRESS

    def comm_init_rootless(self, nranks: int, rank: int, spec, *, blocking: bool = False):
        import ctypes
        box = ctypes.c_void_p()
        rc = self.init_rootless(box, nranks, rank, spec, blocking=blocking)
        return box.value, self.check(rc, "ncclCommInitRankRootless", box.value, allow_in_progress=True)

    def raise_abort(self, handle) -> int:
        """hpct's ncclCommRaiseAbortFlag: an atomic store, allowed beside any call."""
        comm = self.comms.get(handle)
        if comm is None:
            raise breach(f"ncclCommRaiseAbortFlag on an unknown communicator handle {handle!r}")
        if comm.ended:
            raise breach(f"ncclCommRaiseAbortFlag on rank {comm.rank}'s communicator after {comm.ended}: "
                         "a use after free")
        comm.flag.set()
        if not self.deaf_to_flag:
            comm.aborted.set()
        return SUCCESS

    def addresses(self) -> dict[str, int]:
        """The functions the engine's native launch calls: callbacks into this library.  Made
        once, under a lock: two ranks binding at once each made a table before, and the one not
        kept was freed with its callbacks while its engine still called them (a segfault in about
        one run in ten of test_nccl_sim.py's 12 formations)."""
        with self._table_lock:
            return dict(self._make_table().addresses)

    def _make_table(self) -> Table:
        if self._table is None:
            t = Table()
            t.add("ncclGroupStart", GROUP, self.group_start, NCCL_INTERNAL_ERROR)
            t.add("ncclGroupEnd", GROUP, self.group_end, NCCL_INTERNAL_ERROR)
            for name, proto, method in (("ncclAllReduce", COLL, self.all_reduce), ("ncclBroadcast", COLL, self.broadcast),
                                        ("ncclReduceScatter", COLL, self.reduce_scatter),
                                        ("ncclReduce", ROOTED, self.reduce), ("ncclAllGather", GATHER, self.all_gather),
                                        ("ncclSend", P2P, self.send), ("ncclRecv", P2P, self.recv)):
                t.add(name, proto, method, NCCL_INTERNAL_ERROR)
            self._table = t
        return self._table

    def _form(self, comm: SimComm) -> None:
        from hpct import _gloo
        spec = comm.spec
        deadline = time.monotonic() + spec.connect_timeout_ms / 1000.0
        try:
            # As NCCL's bootstrap: the fixed-port listener belongs to the comm, and a comm whose
            # init failed keeps it until ncclCommAbort or ncclCommDestroy frees the comm.
            comm.listener = listen(spec.listen_addr) if comm.nranks > 1 else None
            book = ring_addresses(comm.rank, comm.nranks, spec.listen_addr, spec.next_addr, comm.listener,
                                  job_key=spec.job_key, generation=spec.generation, deadline=deadline,
                                  retry_s=spec.retry_delay_ms / 1000.0, aborted=comm.aborted.is_set)
            comm.close_listener()          # the data context takes the port over
            ctx = _gloo.Context(comm.rank, comm.nranks, spec.generation, [split_addr(a) for a in book],
                                timeout=3600.0, connect_timeout=max(0.5, deadline - time.monotonic() + 5.0),
                                connect=False, lazy=False, group_key=spec.group_index % 1024)
            comm.ctx = ctx
            if comm.aborted.is_set():
                raise RingError("aborted")
            ctx.connect()
            if self.init_delay:
                comm.aborted.wait(self.init_delay)   # transport set-up that takes long
            if comm.aborted.is_set():
                raise RingError("aborted during transport set-up (the abort flag)")
        except Exception as err:   # noqa: BLE001 -- becomes the comm's async error
            comm.fail(SYSTEM_ERROR, f"rootless init: {type(err).__name__}: {err}")
            return
        if comm.state == IN_PROGRESS and not comm.aborted.is_set():
            comm.state = SUCCESS

    def async_error(self, handle) -> int:
        comm = self._enter(handle, "ncclCommGetAsyncError")
        try:
            if comm.state == SUCCESS and comm.job_polls is not None:
                if comm.job_polls > 0 or self.stuck_launch:
                    comm.job_polls -= 1
                    return IN_PROGRESS
                comm.job_polls = None         # the group job is complete (and freed, as 2.30.7 does)
            return comm.state
        finally:
            self._leave(comm)

    def revoke(self, handle) -> int:
        comm = self._enter(handle, "ncclCommRevoke")
        try:
            if comm.job_polls is not None:
                comm.dangling_job = True      # ncclGroupJobAbort freed it; comm->groupJob still points at it
            return SUCCESS
        finally:
            self._leave(comm)

    def abort(self, handle) -> int:
        comm = self._enter(handle, "ncclCommAbort", abort=True)
        if comm.dangling_job:
            raise breach("ncclCommAbort after ncclCommRevoke left the comm's group job dangling: "
                         "the abort walks freed memory (abort alone, as ProcessGroupNCCL does)")
        for fn in list(self.on_abort):
            fn(comm)
        self._wait_graphs(comm, "ncclCommAbort")
        comm.ended = "aborted"
        comm.aborted.set()
        comm.fail(SYSTEM_ERROR, "aborted")
        comm.close_listener()
        if comm.ctx is not None:
            comm.ctx.abort("ncclCommAbort")
        return SUCCESS

    def _wait_graphs(self, comm: SimComm, call: str) -> None:
        """As commDestroySync: abort and destroy wait for every graph that captured an op on the comm."""
        if comm.graphs and not comm.graphs_gone.wait(HANG_S):
            raise breach(f"{call} waited {HANG_S:g} s for CUDA graphs that were never destroyed (a hang)")

    def release_graphs(self) -> None:
        """The tests' ``del graph``: every graph that captured an op is destroyed."""
        for comm in self.comms.values():
            comm.graphs_gone.set()

    def destroy(self, handle) -> int:
        comm = self._enter(handle, "ncclCommDestroy")
        self._wait_graphs(comm, "ncclCommDestroy")
        comm.ended = "destroyed"
        comm.close_listener()
        self._leave(comm)
        for k in list(comm.kernels):
            k.finished.wait(30.0)
        if comm.ctx is not None:
            comm.ctx.close()
        return SUCCESS

    # ---- groups and ops -------------------------------------------------------------------------
    def _open(self) -> list:
        ops = getattr(self._group, "ops", None)
        if ops is None:
            raise breach("an NCCL op outside ncclGroupStart/ncclGroupEnd (the engine always groups)")
        return ops

    def group_start(self) -> int:
        if getattr(self._group, "ops", None) is not None:
            raise breach("nested ncclGroupStart on one thread (the engine never nests)")
        self._group.ops = []
        self._group.error = SUCCESS
        self.group_starts += 1
        return SUCCESS

    def group_end(self) -> int:
        ops = getattr(self._group, "ops", None)
        if ops is None:
            raise breach("ncclGroupEnd without ncclGroupStart")
        self._group.ops = None
        if self._group.error != SUCCESS:       # an op refused at its call: nothing is launched
            return self._group.error
        by_comm: dict[int, list] = {}
        for op in ops:
            by_comm.setdefault(op[1], []).append(op)
        blocking = {self.comms[h].blocking for h in by_comm if h in self.comms}
        if len(blocking) > 1:
            raise breach("blocking and non-blocking communicators in one group (NCCL refuses it)")
        result = IN_PROGRESS if by_comm and blocking != {True} else SUCCESS
        for handle, comm_ops in by_comm.items():
            comm = self._enter(handle, "ncclGroupEnd")
            try:
                if comm.state == IN_PROGRESS:
                    raise breach(f"a group launched on rank {comm.rank}'s comm before its init settled")
                if comm.job_polls is not None:
                    raise breach(f"a group launched on rank {comm.rank}'s comm while its previous group job "
                                 "is still in progress (settle each launch first)")
                if comm.state != SUCCESS:        # a failed comm launches nothing and says why
                    result = comm.state
                    continue
                streams = {op[2] for op in comm_ops}
                if len(streams) != 1:
                    raise breach(f"one group puts rank {comm.rank}'s ops on {len(streams)} streams")
                comm.launches += 1
                if comm.blocking and self.stuck_launch and comm.launches > self.stuck_from:
                    # held inside NCCL (a lazy connect to a silent peer) until the abort flag ends
                    # it, or -- deaf_to_flag -- until the test releases it
                    end = time.monotonic() + HANG_S
                    while not (comm.aborted.is_set() or self.release.is_set()) and time.monotonic() < end:
                        comm.aborted.wait(0.01)
                    result = SYSTEM_ERROR
                    continue
                comm.groups.append([op[0] for op in comm_ops])
                if threading.get_ident() in CAPTURES:       # a persistent plan: the graph holds the comm
                    comm.graphs += 1
                    continue
                kernel = Kernel(comm, [(op[0], op[3]) for op in comm_ops], hang=self.hang_op or self.error_after_launch,
                                linger_s=self.linger_s)
                comm.kernels.append(kernel)
                STREAMS[streams.pop()].put(kernel.run)
                if self.error_after_launch:
                    comm.fail(SYSTEM_ERROR, "the launch failed after its kernel was enqueued")
                    result = SYSTEM_ERROR
                    continue
                if not comm.blocking:
                    comm.job_polls = self.launch_polls
            finally:
                self._leave(comm)
        return result

    def _op(self, name: str, args: tuple, comm, stream) -> int:
        c = self.comms.get(comm)
        if c is not None and c.ended:
            raise breach(f"{name} on a communicator after {c.ended}: a use after free")
        ops = self._open()
        if c is not None and c.refused < self.refuse_calls:    # NCCL's ArgsCheck: the group fails, nothing queued
            c.refused += 1
            self._group.error = INVALID_ARGUMENT
            return INVALID_ARGUMENT
        ops.append((name, comm, stream, args))
        return SUCCESS

    def all_reduce(self, send, recv, count, dtype, op, comm, stream):
        return self._op("all_reduce", (send, recv, count, dtype, op), comm, stream)

    def broadcast(self, send, recv, count, dtype, root, comm, stream):
        return self._op("broadcast", (send, recv, count, dtype, root), comm, stream)

    def reduce(self, send, recv, count, dtype, op, root, comm, stream):
        return self._op("reduce", (send, recv, count, dtype, op, root), comm, stream)

    def all_gather(self, send, recv, count, dtype, comm, stream):
        return self._op("all_gather", (send, recv, count, dtype), comm, stream)

    def reduce_scatter(self, send, recv, count, dtype, op, comm, stream):
        return self._op("reduce_scatter", (send, recv, count, dtype, op), comm, stream)

    def send(self, buf, count, dtype, peer, comm, stream):
        return self._op("send", (buf, count, dtype, peer), comm, stream)

    def recv(self, buf, count, dtype, peer, comm, stream):
        return self._op("recv", (buf, count, dtype, peer), comm, stream)
