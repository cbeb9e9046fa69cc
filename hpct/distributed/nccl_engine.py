"""The CUDA half of the ``hpct`` backend: NCCL driven through ctypes (nccl_lib.py).

Wiring (for the group facade and ``world._create``)::

    from .nccl_engine import engine_for_group
    engine = engine_for_group(cfg, name=name, index=index, slot=slot, group_rank=group_rank,
                              global_ranks=global_ranks, generation=gen, op_timeout=timeout)
    # facade: route an op whose tensors are on CUDA to ``engine.<op>(...)`` (same names as the
    # Gloo path: allreduce, broadcast, ..., send, recv); abort()/shutdown() call the engine's too;
    # ``_start_coalescing(device)``/``_end_coalescing(device)`` -> engine.start_coalescing() /
    # engine.end_coalescing() (which returns the one Work of the NCCL group).

``engine_for_group`` creates nothing on the GPU and opens no socket: the communicator is
created at the first CUDA op (rootless: listen on this rank's NCCL port from the plan, the
same slot the group holds in the Gloo block; the ring's next is group rank + 1), so a
CPU-only process pays nothing.

Semantics follow ProcessGroupNCCL: an op waits for the caller's current stream (an event),
runs on the engine's own stream; ``Work.wait()`` makes the caller's current stream wait (no
host block; a barrier's wait blocks the host, as NCCL's does), ``wait(timeout)`` bounds a
host wait, ``is_completed()`` polls the event, ``get_future()`` is a CUDA-aware future
completed when the op's GPU work has finished (a completer thread waits on each op's event
with the GIL released), or failed with the group's error if the group failed first.  Unlike
ProcessGroupNCCL's (completed at launch), it lets DDP's backward raise before the optimizer
steps on gradients a lost peer never finished reducing, so survivors recover in-process and
redo the step.  Tensors stay referenced until
their op's event completes.  Sends and receives are batched: consecutive ones go to NCCL
as one group when something needs them (a wait, the next collective, ``end_coalescing``,
or the watchdog after ``P2P_FLUSH_S`` idle), so ``batch_isend_irecv`` is one NCCL group
even when torch issues its ops one by one.  A watchdog thread per engine turns an op
past its timeout or an asynchronous NCCL error into an abort (``ncclCommRevoke`` first
where the library has it) and fails the group with an ``NcclGroupError`` naming the group,
rank, generation and peer where known.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import threading
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import HpctArgumentError, CollectiveError
from . import nccl_lib
from .nccl_lib import NoCudaDeviceError

WATCHDOG_PERIOD_S = 0.05
P2P_FLUSH_S = 0.2
ABORT_BOUND_S = 10.0
MIN_SETTLE_S = 1.0


class NcclGroupError(CollectiveError):
    """An NCCL op of an hpct group failed; the group is failed until recover()."""


class NcclOpTimeoutError(NcclGroupError):
    """An op did not complete within the group's op timeout; the communicator was aborted."""


class NcclConnectError(NcclGroupError):
    """The rootless communicator could not be formed before the connect deadline."""


class NcclAbortedError(NcclGroupError):
    """The group was aborted (by the application, a recovery or a peer's failure)."""


# ------------------------------------------------------------------------- the plan
def format_addr(host: str, port: int) -> str:
    """``host:port``, an IPv6 literal in brackets (what NCCL parses)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def job_key(cfg, run_id: str = "") -> int:
    """The 64-bit job key; the same text and hash as the patched torch (_hpct_rootless.job_key),
    so a patched ProcessGroupNCCL and this engine agree on a communicator's identity."""
    hosts = ",".join(cfg.hosts)
    text = "|".join(("hpct-nccl-job-1", f"run={run_id}", f"hosts={hosts}", f"nproc={cfg.nproc_per_node}",
                     f"slots={cfg.port_slots}", f"gloo={cfg.gloo_port_base}", f"nccl={cfg.nccl_port_base}"))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def nccl_addresses(cfg, slot: int, global_ranks: Sequence[int]) -> list[str]:
    """Each group member's NCCL listening address: hosts[r // P] : nccl_base + (slot mod S)*P + r % P."""
    from ..ports import host_of, port_of
    p = cfg.nproc_per_node
    return [format_addr(host_of(cfg.hosts, r, p), port_of(cfg.nccl_port_base, slot, r % p, p, cfg.port_slots))
            for r in global_ranks]


def engine_for_group(cfg, *, name: str, index: int, slot: int, group_rank: int, global_ranks: Sequence[int],
                     generation: int, op_timeout: float, run_id: str | None = None,
                     places: Sequence[int] | None = None) -> "NcclEngine":
    """An engine for one hpct group from the Config and the group's facts (no GPU touched)."""
    import os
    addrs = nccl_addresses(cfg, slot, global_ranks if places is None else places)   # plan places (shrink)
    rid = os.environ.get("TORCHELASTIC_RUN_ID", "") if run_id is None else run_id
    return NcclEngine(rank=group_rank, size=len(global_ranks), global_ranks=list(global_ranks),
                      generation=generation, group_index=index, group_name=name,
                      listen_addr=addrs[group_rank], addresses=addrs, job_key=job_key(cfg, rid),
                      connect_timeout=cfg.connect_timeout, op_timeout=op_timeout,
                      retry_delay_ms=cfg.socket_retry_delay)


# ------------------------------------------------------------------------- work
class NcclWork(dist.Work):
    """The Work of one NCCL op (or of one NCCL group of ops)."""

    def __init__(self, engine: "NcclEngine", what: str, device: torch.device, result, *,
                 host_wait: bool = False, peer: int | None = None):
        super().__init__()
        self._engine = engine
        self.what = what
        self.device = device
        self.peer = peer
        self._result = result
        self._host_wait = host_wait
        self._event: torch.cuda.Event | None = None      # set at launch
        self._launched = threading.Event()
        self._error: BaseException | None = None
        self._done = False
        self._keep: list = []                             # tensors alive until the op ends
        self._future = torch.futures.Future(devices=[device])
        self._future_lock = threading.Lock()              # the completer and _fail race to settle it
        self._stream = None
        self.deadline: float | None = None

    # engine side
    def _mark_launched(self, event, keep, stream) -> None:
        self._event = event
        self._keep = keep
        self._stream = stream
        self.deadline = time.monotonic() + self._engine.op_timeout
        self._launched.set()

    def _fail(self, err: BaseException) -> None:
        if self._error is None and not self._done:
            self._error = err
            self._keep = []
            with self._future_lock:
                if not self._future.done():
                    self._future.set_exception(err)
        self._launched.set()

    def _finish_future(self) -> None:
        """Settle the future once the GPU finished the op: its value, or the group's failure."""
        with self._future_lock:
            if self._future.done():
                return
            err = self._error or self._engine.failure
            if err is not None:
                self._future.set_exception(err)
                return
            with torch.cuda.stream(self._stream):
                self._future.set_result(self._result)

    def _poll(self) -> bool:
        """True when finished (done or failed); drops the kept tensors when done."""
        if self._error is not None or self._done:
            return True
        if self._event is not None and self._event.query():
            self._done, self._keep = True, []
            return True
        return False

    # user side
    def _ensure_launched(self, deadline: float | None) -> None:
        if not self._launched.is_set():
            self._engine._flush()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        bound = self._engine.op_timeout if left is None else left
        if not self._launched.wait(bound):
            raise self._engine._err(NcclOpTimeoutError, self.what, f"not launched within {bound:g} s",
                                    peer=self.peer)

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        deadline = time.monotonic() + seconds if seconds else None
        self._ensure_launched(deadline)
        if self._error is not None:
            raise self._error
        if seconds or self._host_wait:
            end = deadline if deadline is not None else time.monotonic() + self._engine.op_timeout
            while not self._poll():
                if time.monotonic() > end:
                    err = self._engine._err(NcclOpTimeoutError, self.what,
                                            f"did not complete within {seconds or self._engine.op_timeout:g} s "
                                            "(Work.wait timeout); the communicator is aborted", peer=self.peer)
                    self._engine._fail(err)
                    raise err
                time.sleep(0.001)
            if self._error is not None:
                raise self._error
        else:
            torch.cuda.current_stream(self.device).wait_event(self._event)
        return True

    def synchronize(self):
        self.wait()

    def is_completed(self):
        if not self._launched.is_set():
            self._engine._flush()
        return self._poll()

    def is_success(self):
        return self._poll() and self._error is None

    def exception(self):
        return self._error

    def get_future(self):
        if not self._launched.is_set():
            self._engine._flush()
        return self._future

    def result(self):
        self.wait()
        return self._result


# ------------------------------------------------------------------------- the engine
def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


class NcclEngine:
    """NCCL communicators of one hpct group (one per CUDA device this process uses: one)."""

    device_type = "cuda"

    def __init__(self, *, rank: int, size: int, global_ranks: Sequence[int], generation: int,
                 group_index: int, group_name: str, listen_addr: str, addresses: Sequence[str],
                 job_key: int, connect_timeout: float, op_timeout: float, retry_delay_ms: int = 100,
                 library: "nccl_lib.NcclLibrary | None" = None,
                 load: Callable[[], "nccl_lib.NcclLibrary"] | None = None):
        if not 0 <= rank < size or len(global_ranks) != size or len(addresses) != size:
            raise HpctArgumentError(f"NcclEngine: rank {rank}, size {size}, {len(global_ranks)} global ranks, "
                                f"{len(addresses)} addresses do not agree", fix="pass one entry per group rank")
        if addresses[rank] != listen_addr:
            raise HpctArgumentError(f"NcclEngine: listen address {listen_addr} is not addresses[{rank}] "
                                f"({addresses[rank]})", fix="derive both from the port plan")
        self.rank, self.size = rank, size
        self.global_ranks = list(global_ranks)
        self.generation, self.group_index, self.group_name = generation, group_index, group_name
        self.listen_addr, self.addresses = listen_addr, list(addresses)
        self.job_key = job_key
        self.connect_timeout, self.op_timeout = float(connect_timeout), float(op_timeout)
        self.retry_delay_ms = retry_delay_ms
        self._lib = library
        self._load = load or nccl_lib.load
        self._lock = threading.RLock()
        self._device: torch.device | None = None
        self._comm = None
        self._stream: torch.cuda.Stream | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._inflight: collections.deque[NcclWork] = collections.deque()
        self._batch: list[tuple[Callable, NcclWork]] = []     # deferred launches (p2p, coalescing)
        self._batch_since = 0.0
        self._coalescing = False
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._completions: collections.deque[NcclWork] = collections.deque()
        self._completion_cv = threading.Condition()
        self._completer: threading.Thread | None = None

    # ---- identity and failure -----------------------------------------------------------
    @property
    def failure(self) -> BaseException | None:
        return self._failure

    @property
    def library(self):
        return self._lib

    def _describe(self, what: str, peer: int | None = None) -> str:
        text = (f"hpct NCCL {what} failed on group {self.group_name} (rank {self.rank} of {self.size}, "
                f"global rank {self.global_ranks[self.rank]}, generation {self.generation}")
        if peer is not None:
            text += f", peer rank {peer} (global {self.global_ranks[peer]})"
        return text + ")"

    def _err(self, cls, what: str, cause: str, peer: int | None = None) -> NcclGroupError:
        return cls(f"{self._describe(what, peer)}: {cause}",
                   fix="call hpct.distributed.recover() to re-form the group")

    def _fail(self, err: BaseException) -> None:
        """Fail the group once: abort the communicator (bounded) and fail every op not done."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = err
            works = list(self._inflight) + [w for _, w in self._batch]
            self._batch.clear()
            comm, self._comm = self._comm, None
        for w in works:
            if not w._poll():
                w._fail(err)
        if comm is not None:
            self._abort_comm(comm)

    def _abort_comm(self, comm) -> None:
        lib = self._lib

        def run():
            if lib.has_revoke:
                lib.revoke(comm)
            lib.abort(comm)
        t = threading.Thread(target=run, name=f"hpct-nccl-abort-{self.group_name}", daemon=True)
        t.start()
        t.join(ABORT_BOUND_S)

    def set_timeout(self, seconds: float) -> None:
        """The op timeout of ops launched from now on (an op in flight keeps its deadline)."""
        self.op_timeout = float(seconds)

    def abort(self, reason: str = "aborted by the application") -> None:
        self._fail(self._err(NcclAbortedError, "op", f"aborted: {reason}"))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Release the communicator: destroy it when idle, abort it when ops are in flight."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._flush()
        end = time.monotonic() + timeout
        while time.monotonic() < end and self._failure is None:
            with self._lock:
                busy = [w for w in self._inflight if not w._poll()]
            if not busy:
                break
            time.sleep(0.005)
        with self._lock:
            busy = any(not w._poll() for w in self._inflight)
            comm = self._comm
        if busy or self._failure is not None:
            self.abort("process group shut down")
        elif comm is not None:
            with self._lock:
                self._comm = None
            self._lib.destroy(comm)
        self._stop.set()
        with self._completion_cv:
            self._completion_cv.notify()
        for t in (self._watchdog, self._completer):
            if t is not None and t is not threading.current_thread():
                t.join(timeout)

    # ---- the communicator -----------------------------------------------------------------
    def _check_device(self, tensors: Sequence[torch.Tensor], what: str) -> torch.device:
        if not torch.cuda.is_available():
            raise NoCudaDeviceError(
                f"hpct NCCL {what}: no CUDA device is visible to this process (torch "
                f"{torch.__version__}, CUDA {torch.version.cuda or 'none'})",
                fix="run on a GPU node with a CUDA build of torch, or keep the tensors on the CPU")
        if not tensors:
            raise HpctArgumentError(f"hpct NCCL {what}: requires a non-empty tensor list", fix="pass a tensor")
        dev = tensors[0].device
        for i, t in enumerate(tensors):
            if t.device.type != "cuda" or t.device != dev:
                raise HpctArgumentError(f"hpct NCCL {what}: tensor {i} is on {t.device}, tensor 0 on {dev}",
                                    fix="put every tensor of the op on the same CUDA device")
            if t.is_sparse:
                raise HpctArgumentError(f"hpct NCCL {what}: sparse tensors are not supported with NCCL",
                                    fix="use dense tensors")
        if self._device is not None and dev != self._device:
            raise HpctArgumentError(f"hpct NCCL {what}: this group already uses {self._device}; one CUDA "
                                f"device per process and group", fix="call torch.cuda.set_device once per rank")
        return dev

    def _ensure_comm(self, dev: torch.device):
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._closed:
                raise self._err(NcclAbortedError, "op", "the group is shut down")
            if self._comm is not None:
                return self._comm
            if self._lib is None:
                self._lib = self._load()
            self._lib.require_rootless()
            spec = nccl_lib.RootlessSpec(self.listen_addr, self.addresses[(self.rank + 1) % self.size],
                                         self.job_key, self.generation, self.group_index,
                                         int(self.connect_timeout * 1000), self.retry_delay_ms)
            with torch.cuda.device(dev):
                self._stream = torch.cuda.Stream(dev)
                comm, rc = self._lib.comm_init_rootless(self.size, self.rank, spec, blocking=False)
                try:
                    self._settle(comm, "communicator creation", self.connect_timeout + MIN_SETTLE_S,
                                 NcclConnectError)
                except BaseException:
                    self._abort_comm(comm) if comm.value else None
                    raise
            self._comm, self._device = comm, dev
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                                  name=f"hpct-nccl-watchdog-{self.group_name}")
                self._watchdog.start()
                self._completer = threading.Thread(target=self._complete_in_order, daemon=True,
                                                   name=f"hpct-nccl-completer-{self.group_name}")
                self._completer.start()
            return comm

    def _settle(self, comm, what: str, seconds: float, cls=NcclGroupError) -> None:
        """Wait (bounded) until a nonblocking communicator leaves ncclInProgress."""
        end = time.monotonic() + max(seconds, MIN_SETTLE_S)
        while True:
            try:
                state = self._lib.async_error(comm)
            except nccl_lib.NcclError as err:
                raise self._err(cls, what, str(err)) from None
            if state == nccl_lib.SUCCESS:
                return
            if state != nccl_lib.IN_PROGRESS:
                raise self._err(cls, what, str(self._lib.error(state, what, comm)))
            if time.monotonic() > end:
                raise self._err(cls, what, f"still in progress after {seconds:g} s (listen {self.listen_addr}, "
                                f"next {self.addresses[(self.rank + 1) % self.size]})")
            time.sleep(0.002)

    # ---- launching ------------------------------------------------------------------------
    def _submit(self, what: str, tensors: Sequence[torch.Tensor], launch: Callable, result, *,
                defer: bool = False, host_wait: bool = False, peer: int | None = None) -> NcclWork:
        """Check, then launch ``launch(comm, stream_handle)`` now or with the batch."""
        dev = self._check_device(tensors, what)
        work = NcclWork(self, what, dev, result, host_wait=host_wait, peer=peer)
        work._keep = list(tensors)
        if self._failure is not None:
            work._fail(self._err(NcclAbortedError, what, f"the group already failed: {self._failure}"))
            return work
        try:
            self._ensure_comm(dev)
        except NcclGroupError as err:
            self._fail(err)
            work._fail(err)
            return work
        caller = torch.cuda.current_stream(dev)
        self._stream.wait_stream(caller)          # the op follows the caller's work so far
        with self._lock:
            if defer or self._coalescing:
                if not self._batch:
                    self._batch_since = time.monotonic()
                self._batch.append((launch, work))
                return work
        self._flush()
        self._launch([(launch, work)], what)
        return work

    def _flush(self) -> None:
        with self._lock:
            if self._coalescing or not self._batch:
                return
            batch, self._batch = self._batch, []
        self._launch(batch, "batched send/recv")

    def _launch(self, items: list, what: str) -> None:
        with self._lock:
            if self._failure is not None:
                for _, w in items:
                    w._fail(self._err(NcclAbortedError, w.what, f"the group already failed: {self._failure}"))
                return
            comm, stream, lib = self._comm, self._stream, self._lib
            try:
                with torch.cuda.device(self._device), torch.cuda.stream(stream):
                    handle = stream.cuda_stream
                    lib.group_start()
                    try:
                        for launch, _ in items:
                            lib.check(launch(comm, handle), what, comm)
                    finally:
                        rc = lib.group_end()
                    if rc == nccl_lib.IN_PROGRESS:
                        self._settle(comm, what, self.op_timeout)
                    for _, w in items:                 # copies out of staging buffers
                        post = getattr(w, "_post", None)
                        if post is not None:
                            post()
                    event = torch.cuda.Event()
                    event.record(stream)
                    for _, w in items:
                        w._mark_launched(event, w._keep, stream)
                        self._inflight.append(w)
                    with self._completion_cv:
                        self._completions.extend(w for _, w in items)
                        self._completion_cv.notify()
            except nccl_lib.NcclError as err:
                failure = self._err(NcclGroupError, what, str(err))
            else:
                return
        self._fail(failure)

    def start_coalescing(self) -> None:
        with self._lock:
            self._flush_locked_guard()
            self._coalescing = True

    def _flush_locked_guard(self) -> None:
        if self._batch and not self._coalescing:
            batch, self._batch = self._batch, []
            self._launch(batch, "batched send/recv")

    def end_coalescing(self) -> NcclWork | None:
        """Launch every op issued since start_coalescing as one NCCL group; its one Work."""
        with self._lock:
            self._coalescing = False
            batch, self._batch = self._batch, []
        if not batch:
            return None
        works = [w for _, w in batch]
        group = NcclWork(self, "coalesced ops", works[0].device, [w._result for w in works])
        group._keep = [t for w in works for t in w._keep]
        self._launch(batch + [(lambda comm, stream: 0, group)], "coalesced ops")
        return group

    # ---- completion -----------------------------------------------------------------------
    def _complete_in_order(self) -> None:
        """Settle each launched op's future when its GPU work ends, in launch order."""
        while True:
            with self._completion_cv:
                while not self._completions:
                    if self._stop.is_set():
                        return
                    self._completion_cv.wait(WATCHDOG_PERIOD_S)
                w = self._completions.popleft()
            if w._error is None and w._event is not None:
                # Blocks with the GIL released; an abort (the watchdog's) ends a stuck kernel.
                w._event.synchronize()
            w._finish_future()

    # ---- the watchdog ---------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(WATCHDOG_PERIOD_S):
            if self._failure is not None:
                return
            try:
                with self._lock:
                    stale = (self._batch and not self._coalescing
                             and time.monotonic() - self._batch_since > P2P_FLUSH_S)
                if stale:
                    self._flush()
                with self._lock:
                    while self._inflight and self._inflight[0]._poll():
                        self._inflight.popleft()
                    pending = list(self._inflight)
                    comm = self._comm
                now = time.monotonic()
                for w in pending:
                    if not w._poll() and w.deadline is not None and now > w.deadline:
                        self._fail(self._err(NcclOpTimeoutError, w.what,
                                             f"did not complete within the op timeout ({self.op_timeout:g} s); "
                                             "the communicator is aborted", peer=w.peer))
                        return
                if comm is not None:
                    state = self._lib.async_error(comm)
                    if state not in (nccl_lib.SUCCESS, nccl_lib.IN_PROGRESS):
                        self._fail(self._err(NcclGroupError, "op", str(self._lib.error(state, "asynchronous error",
                                                                                        comm))))
                        return
            except Exception as err:   # noqa: BLE001 -- the watchdog must fail the group, not die
                self._fail(self._err(NcclGroupError, "watchdog", f"{type(err).__name__}: {err}"))
                return

    # ---- helpers for ops ------------------------------------------------------------------
    def _dt(self, t: torch.Tensor) -> int:
        return nccl_lib.nccl_dtype(t.dtype, self._lib.version if self._lib else 0)

    @staticmethod
    def _op(op, t: torch.Tensor) -> int:
        if t.is_complex() and getattr(op, "op", op) not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise HpctArgumentError(f"hpct NCCL: ReduceOp {op} is not defined for complex tensors",
                                fix="reduce complex tensors with SUM or AVG")
        return nccl_lib.nccl_op(op, t.dtype)

    def _stage(self, work: NcclWork, pairs) -> None:
        """Copy staging buffers back into the caller's tensors after the op (on the engine stream)."""
        def post():
            for dst, src in pairs:
                dst.copy_(src.reshape(dst.shape))
        work._post = post

    def _inplace(self, what, t, body, result, **kw):
        """Run ``body(comm, stream, buf)`` on a contiguous (real) view of t, copying back if staged."""
        buf = _contig(t)
        view = _real(buf)

        def launch(comm, stream):
            return body(comm, stream, view)
        work = self._submit(what, [t], launch, result, **kw)
        if buf is not t:
            work._keep.append(buf)
            self._stage(work, [(t, buf)])
        return work

    # ---- collectives (arguments validated by the facade) ------------------------------------
    def allreduce(self, tensors, op=dist.ReduceOp.SUM):
        if len(tensors) != 1:
            return self.allreduce_coalesced(tensors, op)
        t = tensors[0]
        code = self._op(op, t)
        return self._inplace("allreduce", t, lambda c, s, v: self._lib.all_reduce(
            v.data_ptr(), v.data_ptr(), v.numel(), self._dt(v), code, c, s), tensors)

    def allreduce_coalesced(self, tensors, op=dist.ReduceOp.SUM):
        with self._group_of_ops():
            works = [self.allreduce([t], op) for t in tensors]
        return self._combined(works, tensors)

    def broadcast(self, tensors, root: int, root_tensor: int = 0):
        t = tensors[root_tensor]
        return self._inplace("broadcast", t, lambda c, s, v: self._lib.broadcast(
            v.data_ptr(), v.data_ptr(), v.numel(), self._dt(v), root, c, s), tensors,
            peer=root if root != self.rank else None)

    def reduce(self, tensor, root: int, op=dist.ReduceOp.SUM):
        code = self._op(op, tensor)
        return self._inplace("reduce", tensor, lambda c, s, v: self._lib.reduce(
            v.data_ptr(), v.data_ptr(), v.numel(), self._dt(v), code, root, c, s), [tensor])

    def all_gather_single(self, output, input):
        out, inp = _contig(output), _contig(input)
        o, i = _real(out), _real(inp)

        def launch(c, s):
            return self._lib.all_gather(i.data_ptr(), o.data_ptr(), i.numel(), self._dt(i), c, s)
        work = self._submit("all_gather_into_tensor", [output, input], launch, [output])
        work._keep += [out, inp]
        if out is not output:
            self._stage(work, [(output, out)])
        return work

    def all_gather_single_coalesced(self, outputs, inputs):
        with self._group_of_ops():
            works = [self.all_gather_single(o, i) for o, i in zip(outputs, inputs)]
        return self._combined(works, outputs)

    def allgather(self, output_lists, inputs):
        inp = inputs[0]
        flat = torch.empty((self.size,) + tuple(inp.shape), dtype=inp.dtype, device=inp.device)
        work = self.all_gather_single(flat, inp)
        work._result = output_lists[0] if len(output_lists) == 1 else output_lists
        self._attach_copy(work, [(dst, flat[r]) for outs in output_lists for r, dst in enumerate(outs)])
        return work

    def allgather_coalesced(self, output_lists, input_list):
        # output_lists[rank][i] receives rank's input i
        flats = [torch.empty((self.size,) + tuple(t.shape), dtype=t.dtype, device=t.device) for t in input_list]
        with self._group_of_ops():
            works = [self.all_gather_single(f, t) for f, t in zip(flats, input_list)]
        work = self._combined(works, output_lists)
        self._attach_copy(work, [(output_lists[r][i], flats[i][r]) for r in range(self.size)
                                 for i in range(len(input_list))])
        return work

    def reduce_scatter_single(self, output, input, op=dist.ReduceOp.SUM):
        out, inp = _contig(output), _contig(input)
        o, i = _real(out), _real(inp)
        code = self._op(op, output)

        def launch(c, s):
            return self._lib.reduce_scatter(i.data_ptr(), o.data_ptr(), o.numel(), self._dt(o), code, c, s)
        work = self._submit("reduce_scatter_tensor", [output, input], launch, [output])
        work._keep += [out, inp]
        if out is not output:
            self._stage(work, [(output, out)])
        return work

    def reduce_scatter_single_coalesced(self, outputs, inputs, op=dist.ReduceOp.SUM):
        with self._group_of_ops():
            works = [self.reduce_scatter_single(o, i, op) for o, i in zip(outputs, inputs)]
        return self._combined(works, outputs)

    def reduce_scatter(self, out, ins, op=dist.ReduceOp.SUM):
        self._check_device([out, *ins], "reduce_scatter")
        s = self._stream_for(out.device)
        s.wait_stream(torch.cuda.current_stream(out.device))
        with torch.cuda.stream(s):
            flat = torch.stack([t.reshape(out.shape) for t in ins])
        work = self.reduce_scatter_single(out, flat, op)
        work._keep += list(ins)
        return work

    def all_to_all_single(self, output, input, out_splits, in_splits):
        out, inp = _contig(output), _contig(input)
        n = self.size

        def offsets(t, splits):
            rows = t.shape[0] if t.dim() else 1
            per_row = t.numel() // rows if rows else 0
            sizes = list(splits) if splits else [rows // n] * n
            offs, acc = [], 0
            for k in sizes:
                offs.append((acc * per_row, k * per_row))
                acc += k
            return offs
        send_offs, recv_offs = offsets(input, in_splits), offsets(output, out_splits)
        o, i = _real(out).reshape(-1), _real(inp).reshape(-1)
        mult = 2 if input.is_complex() else 1
        esz = i.element_size()

        def launch(c, s):
            dt = self._dt(i)
            for peer in range(n):
                so, sc = send_offs[peer]
                ro, rc_ = recv_offs[peer]
                rc = self._lib.send(i.data_ptr() + so * mult * esz, sc * mult, dt, peer, c, s)
                if rc:
                    return rc
                rc = self._lib.recv(o.data_ptr() + ro * mult * esz, rc_ * mult, dt, peer, c, s)
                if rc:
                    return rc
            return 0
        work = self._submit("all_to_all_single", [output, input], launch, [output])
        work._keep += [out, inp]
        if out is not output:
            self._stage(work, [(output, out)])
        return work

    def alltoall(self, outs, ins):
        with self._group_of_ops():
            works = []
            for peer in range(self.size):
                works.append(self._p2p("all_to_all", [ins[peer]], peer, send=True, defer=False))
                works.append(self._p2p("all_to_all", [outs[peer]], peer, send=False, defer=False))
        return self._combined(works, outs)

    def gather(self, outs, inp, root: int):
        with self._group_of_ops():
            works = [self._p2p("gather", [inp], root, send=True, defer=False)]
            if self.rank == root:
                for peer in range(self.size):
                    works.append(self._p2p("gather", [outs[peer]], peer, send=False, defer=False))
        return self._combined(works, [outs] if outs is not None else [])

    def scatter(self, out, ins, root: int):
        with self._group_of_ops():
            works = []
            if self.rank == root:
                for peer in range(self.size):
                    works.append(self._p2p("scatter", [ins[peer]], peer, send=True, defer=False))
            works.append(self._p2p("scatter", [out], root, send=False, defer=False))
        return self._combined(works, [out])

    def barrier(self):
        dev = self._device if self._device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None)
        if dev is None:
            self._check_device([], "barrier")
        t = torch.zeros(1, device=dev)
        return self._inplace("barrier", t, lambda c, s, v: self._lib.all_reduce(
            v.data_ptr(), v.data_ptr(), 1, self._dt(v), nccl_lib.NCCL_SUM, c, s), [], host_wait=True)

    # ---- point to point ---------------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        return self._p2p(f"send to rank {dst}", tensors, dst, send=True, defer=True)

    def recv(self, tensors, src: int, tag: int = 0):
        return self._p2p(f"recv from rank {src}", tensors, src, send=False, defer=True)

    def _p2p(self, what, tensors, peer: int, *, send: bool, defer: bool):
        if not 0 <= peer < self.size:
            raise HpctArgumentError(f"hpct NCCL {what}: peer rank {peer} is outside the group of {self.size}",
                                fix=f"pass a group rank from 0 to {self.size - 1}")
        bufs = [_contig(t) for t in tensors]
        views = [_real(b) for b in bufs]

        def launch(c, s):
            for v in views:
                fn = self._lib.send if send else self._lib.recv
                rc = fn(v.data_ptr(), v.numel(), self._dt(v), peer, c, s)
                if rc:
                    return rc
            return 0
        work = self._submit(what, list(tensors), launch, list(tensors), defer=defer, peer=peer)
        work._keep += bufs
        if not send:
            pairs = [(t, b) for t, b in zip(tensors, bufs) if b is not t]
            if pairs:
                self._stage(work, pairs)
        return work

    # ---- grouping helpers -------------------------------------------------------------------
    class _Group:
        def __init__(self, engine):
            self.engine = engine
            self.outer = False

        def __enter__(self):
            e = self.engine
            with e._lock:
                self.outer = not e._coalescing
                if self.outer:
                    e._flush_locked_guard()
                    e._coalescing = True
            return self

        def __exit__(self, *exc):
            e = self.engine
            if not self.outer:
                return False
            with e._lock:
                e._coalescing = False
                batch, e._batch = e._batch, []
            if exc[0] is not None:
                for _, w in batch:
                    w._fail(e._err(NcclGroupError, w.what, "not launched: an argument error ended the group"))
                return False
            if batch:
                e._launch(batch, batch[0][1].what)
            return False

    def _group_of_ops(self):
        return NcclEngine._Group(self)

    def _combined(self, works, result):
        """One Work over several ops launched in one NCCL group (they share the group's event)."""
        if not works:
            raise HpctArgumentError("hpct NCCL: an empty op list", fix="pass at least one tensor")
        last = works[-1]
        combined = NcclWork(self, last.what, last.device, result)
        combined._keep = [t for w in works for t in w._keep]
        if last._launched.is_set():
            if last._error is not None:
                combined._fail(last._error)
            else:
                combined._mark_launched(last._event, combined._keep, self._stream)
                with self._lock:
                    self._inflight.append(combined)
        else:       # inside an outer coalescing: launched with the batch
            with self._lock:
                self._batch.append((lambda comm, stream: 0, combined))
        return combined

    def _attach_copy(self, work: NcclWork, pairs) -> None:
        """Copy results out after the op, on the engine stream, before the work's event."""
        prev = getattr(work, "_post", None)
        if work._launched.is_set():       # launched already: copy now on our stream, move the event
            with torch.cuda.device(work.device), torch.cuda.stream(self._stream):
                for dst, src in pairs:
                    dst.copy_(src.reshape(dst.shape))
                ev = torch.cuda.Event()
                ev.record(self._stream)
                # The future was completed at launch; complete a fresh one after the copies.
                work._future = torch.futures.Future(devices=[work.device])
                work._future.set_result(work._result)
            work._event = ev
            work._keep += [d for d, _ in pairs]
            return

        def post():
            if prev is not None:
                prev()
            for dst, src in pairs:
                dst.copy_(src.reshape(dst.shape))
        work._post = post

    def _stream_for(self, dev):
        self._ensure_comm(dev)
        return self._stream
