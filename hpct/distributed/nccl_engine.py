"""The CUDA half of the ``hpct`` backend: NCCL driven through ctypes (nccl_lib.py).

Wiring (for the group facade and ``world._create``)::

    from .nccl_engine import engine_for_group
    engine = engine_for_group(cfg, name=name, index=index, slot=slot, group_rank=group_rank,
                              global_ranks=global_ranks, generation=gen, op_timeout=timeout)
    # facade: an op whose tensors are on CUDA goes to ``engine.<op>(...)`` (the names of the
    # Gloo path: allreduce, broadcast, ..., send, recv); abort()/shutdown() call the engine's;
    # ``_start_coalescing``/``_end_coalescing`` -> engine.start_coalescing()/end_coalescing().

``engine_for_group`` creates nothing on the GPU and opens no socket: the communicator is
created at the group's first launch (rootless: listen on this rank's NCCL port from the plan,
the slot the group holds in the NCCL block; the ring's next is group rank + 1).

The engine's parts: nccl_comm.py (the communicator and the rules for calling NCCL: one lock
per comm, abort alone, from any thread), nccl_device.py (the CUDA runtime: streams, events),
nccl_ops.py (the op bodies), nccl_work.py (Work), nccl_watchdog.py (the watchdog and the
completer).  The library and the runtime are the engine's two outside worlds, passed in:
tests/nccl_sim passes simulated ones and runs this same code on CPU tensors.

Semantics follow ProcessGroupNCCL: an op waits for the caller's current stream and runs on the
engine's own stream; ``Work.wait()`` makes the caller's stream wait (a barrier's blocks the
host), ``wait(timeout)`` bounds a host wait, ``get_future()`` is completed when the op's GPU
work has ended, or failed with the group's error -- unlike ProcessGroupNCCL's (completed at
launch), so DDP's backward raises before the optimizer steps on gradients a lost peer never
finished reducing.  The watchdog turns an op past its timeout or an asynchronous NCCL error
into an abort (``ncclCommAbort`` alone) and fails the group with an ``NcclGroupError`` naming
group, rank, generation and peer where known.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from typing import Callable, Sequence

import torch

from ..errors import HpctArgumentError
from . import nccl_find, nccl_lib
from .nccl_comm import ENDED, CommEnded, Communicator
from .nccl_device import CudaRuntime
from .nccl_lib import NoCudaDeviceError
from .nccl_ops import NcclOps
from .nccl_watchdog import Watchers
from .nccl_work import NcclAbortedError, NcclConnectError, NcclGroupError, NcclOpTimeoutError, NcclWork

__all__ = ["NcclAbortedError", "NcclConnectError", "NcclEngine", "NcclGroupError", "NcclOpTimeoutError",
           "NcclWork", "engine_for_group", "format_addr", "job_key", "nccl_addresses"]


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
                     places: Sequence[int] | None = None, runtime=None, load=None) -> "NcclEngine":
    """An engine for one hpct group from the Config and the group's facts (no GPU touched)."""
    import os
    addrs = nccl_addresses(cfg, slot, global_ranks if places is None else places)   # plan places (shrink)
    rid = os.environ.get("TORCHELASTIC_RUN_ID", "") if run_id is None else run_id
    return NcclEngine(rank=group_rank, size=len(global_ranks), global_ranks=list(global_ranks),
                      generation=generation, group_index=index, group_name=name,
                      listen_addr=addrs[group_rank], addresses=addrs, job_key=job_key(cfg, rid),
                      connect_timeout=cfg.connect_timeout, op_timeout=op_timeout,
                      retry_delay_ms=cfg.socket_retry_delay, runtime=runtime, load=load,
                      blocking_comm=cfg.nccl_blocking)


# ------------------------------------------------------------------------- the engine
class NcclEngine(NcclOps):
    """The NCCL communicator of one hpct group (one CUDA device per process and group).

    Locks: ``_lock`` guards the engine's state and is held only for short steps;
    ``_launch_lock`` keeps launches in issue order (a launch holds it while it waits for NCCL
    to take the group, so a flush from the watchdog cannot overtake an op); the communicator's
    own lock (nccl_comm.py) is held for one NCCL call at a time.  Abort takes none of them
    for long: that is how it ends a launch stuck on a dead peer.
    """

    def __init__(self, *, rank: int, size: int, global_ranks: Sequence[int], generation: int,
                 group_index: int, group_name: str, listen_addr: str, addresses: Sequence[str],
                 job_key: int, connect_timeout: float, op_timeout: float, retry_delay_ms: int = 100,
                 library: "nccl_lib.NcclLibrary | None" = None,
                 load: Callable[[], "nccl_lib.NcclLibrary"] | None = None, runtime=None,
                 blocking_comm: bool = False):
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
        # Blocking (HPCT_NCCL_BLOCKING=1, the Config's default): a launch is one call with no
        # NCCL thread per group (60-100 us of host time less per op on an H200 host); the comm is
        # formed on a helper thread that the caller waits for with a deadline, and a launch that
        # NCCL holds (a lazy connect to a dead peer) is ended by the watchdog's abort.
        self.blocking_comm = blocking_comm
        self._launch_since: float | None = None   # when the launch in progress began
        self._codes: dict = {}                    # dtype, (op, dtype) -> NCCL codes, computed once
        self.runtime = runtime or CudaRuntime()
        self._lib = library
        self._load = load or nccl_find.load
        self._lock = threading.RLock()
        self._launch_lock = threading.Lock()
        self._device: torch.device | None = None
        self._comm: Communicator | None = None
        self._stream = None
        self._failure: BaseException | None = None
        self.on_failure = None       # called once, with the first failure (group.py's abort hooks)
        self._closed = False
        self._inflight: list[NcclWork] = []       # launched, GPU work not seen ended
        self._batch: list[NcclWork] = []          # deferred launches (p2p, coalescing)
        self._batch_since = 0.0
        self._coalescing = False
        self._watchers = Watchers(self)

    @property
    def device_type(self) -> str:
        return self.runtime.device_type

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
        """Fail the group once: fail every op not done, then abort the communicator (bounded).
        A failed op keeps its tensors until its kernel has ended (the abort ends it): the
        completer holds every launched op until its event has completed."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = err
            works = self._inflight + self._batch
            self._inflight, self._batch = [], []
            comm = self._comm
        for w in works:
            if not w._poll():
                w._fail(err)
        held = [w for w in works if w._held()]
        if held:
            self._watchers.launched(held)   # their kernels may run until the abort ends them
        if self.on_failure is not None:
            self.on_failure(err)
        if comm is not None:
            comm.abort(on_stuck=lambda why: print(f"hpct: {self._describe('abort')}: {why}", file=sys.stderr,
                                                  flush=True))
        self._watchers.wake()

    def _refuse(self, err):
        """An op refused at the call.  While coalescing, the open batch is dropped whole (none of
        it is launched, so no peer gets part of a group) and coalescing ends: torch's
        _coalescing_manager does not end it when an op inside raises."""
        with self._lock:
            if not self._coalescing:
                return err
            batch, self._batch = self._batch, []
            self._coalescing = False
        for w in batch:
            w._fail(self._err(NcclGroupError, w.what, f"not launched: an op of its coalesced group was "
                                                      f"refused ({getattr(err, 'problem', err)})"))
        return err

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
        self._flush()                     # the deferred sends and receives go out first
        end = time.monotonic() + timeout
        settled = self._launch_lock.acquire(timeout=timeout)    # a launch on another thread ends first
        if settled:
            self._launch_lock.release()
        while time.monotonic() < end and self._failure is None and self._pending()[0]:
            time.sleep(0.005)
        with self._lock:
            busy = not settled or bool(self._pending_locked()) or bool(self._batch)
            comm = self._comm
        if busy or self._failure is not None:
            self.abort("process group shut down")
        self._watchers.join(timeout)
        if comm is not None:
            comm.destroy()            # does nothing when an abort (ours, the watchdog's) ended it

    def _pending(self):
        with self._lock:
            return self._pending_locked(), self._comm

    def _pending_locked(self) -> list[NcclWork]:
        self._inflight = [w for w in self._inflight if not w._poll()]
        return list(self._inflight)

    def _stale_batch(self, seconds: float) -> bool:
        with self._lock:
            return bool(self._batch) and not self._coalescing and time.monotonic() - self._batch_since > seconds

    # ---- devices and the communicator ----------------------------------------------------------
    def _check_device(self, tensors: Sequence[torch.Tensor], what: str) -> torch.device:
        if self._device is None and not self.runtime.available():
            raise self._refuse(NoCudaDeviceError(
                f"hpct NCCL {what}: no CUDA device is visible to this process ({self.runtime.describe()})",
                fix="run on a GPU node with a CUDA build of torch, or keep the tensors on the CPU"))
        if not tensors:
            raise self._refuse(HpctArgumentError(f"hpct NCCL {what}: requires a non-empty tensor list",
                                                 fix="pass a tensor"))
        dev = tensors[0].device
        for i, t in enumerate(tensors):
            if t.device.type != self.device_type or t.device != dev:
                raise self._refuse(HpctArgumentError(
                    f"hpct NCCL {what}: tensor {i} is on {t.device}, tensor 0 on {dev}",
                    fix="put every tensor of the op on the same CUDA device"))
            if t.is_sparse:
                raise self._refuse(HpctArgumentError(f"hpct NCCL {what}: sparse tensors are not supported "
                                                     "with NCCL", fix="use dense tensors"))
        if self._device is not None and dev != self._device:
            raise self._refuse(HpctArgumentError(
                f"hpct NCCL {what}: this group already uses {self._device}; one CUDA device per process "
                "and group", fix="call torch.cuda.set_device once per rank"))
        return dev

    def _ensure_stream(self, dev: torch.device) -> None:
        with self._lock:
            if self._stream is None:
                self._stream = self.runtime.new_stream(dev)
                self._device = dev

    def _ensure_comm(self) -> Communicator:
        """The communicator, created at the first launch (the launch lock is held)."""
        if self._comm is not None:
            return self._comm
        lib = self._lib if self._lib is not None else self._load()
        self._lib = lib
        lib.require_rootless()
        nxt = self.addresses[(self.rank + 1) % self.size]
        spec = nccl_lib.RootlessSpec(self.listen_addr, nxt, self.job_key, self.generation, self.group_index,
                                     int(self.connect_timeout * 1000), self.retry_delay_ms)
        if self.blocking_comm:
            comm = self._form_blocking(lib, spec, nxt)     # formed: the settle below polls once
        else:
            try:
                with self.runtime.on(self._device, self._stream):
                    comm = Communicator.create_rootless(lib, self.size, self.rank, spec)
            except nccl_lib.NcclError as err:
                raise self._err(NcclConnectError, "communicator creation", str(err)) from None
        with self._lock:
            self._comm = comm          # visible to abort() before the wait below
            failed = self._failure
        if failed is not None:
            comm.abort()
            raise failed
        # The connect deadline bounds the rootless ring inside NCCL; what follows (transport
        # set-up, which takes long at scale) is bounded by the op timeout, as for the first op.
        state = comm.settle(self.connect_timeout + self.op_timeout, stop=lambda: self._failure is not None)
        if state != nccl_lib.SUCCESS:
            cause = ("aborted while forming" if state == ENDED or self._failure is not None else
                     f"still in progress after {self.connect_timeout + self.op_timeout:g} s"
                     if state == nccl_lib.IN_PROGRESS else str(lib.error(state, "ncclCommInitRankRootless")))
            raise self._err(NcclConnectError, "communicator creation",
                            f"{cause} (listen {self.listen_addr}, next {nxt})")
        self._watchers.start()
        return comm

    def _form_blocking(self, lib, spec, nxt: str) -> Communicator:
        """A blocking rootless init on a helper thread, waited for at most the connect deadline
        plus the op timeout (as the non-blocking settle is) and given up when the group fails.
        A comm that NCCL hands over after the wait was given up is aborted by the helper."""
        box: dict = {}
        handoff = threading.Lock()
        done = threading.Event()
        dev, stream = self._device, self._stream

        def form():
            try:
                with self.runtime.on(dev, stream):
                    made = Communicator.create_rootless(lib, self.size, self.rank, spec, blocking=True)
            except BaseException as err:   # noqa: BLE001 -- handed to the waiting thread
                box["error"] = err
            else:
                with handoff:
                    box["comm"] = made
                    late = box.get("gave_up", False)
                if late:
                    made.abort()
            finally:
                done.set()
        threading.Thread(target=form, daemon=True, name=f"hpct-nccl-init-{self.group_name}").start()
        bound = self.connect_timeout + self.op_timeout
        end = time.monotonic() + bound
        while not done.wait(min(0.05, max(0.0, end - time.monotonic()))):
            if self._failure is None and time.monotonic() < end:
                continue
            with handoff:
                comm = box.get("comm")
                box["gave_up"] = comm is None
            if comm is not None:       # formed just now
                break
            why = "aborted while forming" if self._failure is not None else f"not formed within {bound:g} s"
            raise self._err(NcclConnectError, "communicator creation", f"{why} (listen {self.listen_addr}, next {nxt})")
        if "error" in box:
            err = box["error"]
            if isinstance(err, nccl_lib.NcclError):
                raise self._err(NcclConnectError, "communicator creation", str(err)) from None
            raise err
        return box["comm"]

    # ---- launching -------------------------------------------------------------------------
    def _submit(self, what: str, tensors: Sequence[torch.Tensor], calls, result, *, keep=(), post=None,
                pre=None, defer: bool = False, host_wait: bool = False, peer: int | None = None) -> NcclWork:
        """Launch one op built whole (its calls, kept tensors, copies out) now, or with the batch."""
        dev = self._check_device(tensors, what)
        work = NcclWork(self, what, dev, result, calls=calls, keep=[*tensors, *keep], post=post,
                        host_wait=host_wait, peer=peer)
        if self._failure is not None or self._closed:
            why = f"the group already failed: {self._failure}" if self._failure else "the group is shut down"
            work._fail(self._err(NcclAbortedError, what, why))
            return work
        self._ensure_stream(dev)
        work.captured = self.runtime.capturing(dev)
        self.runtime.follow(self._stream, dev)          # the op follows the caller's work so far
        if pre is not None:
            self.runtime.enqueue(dev, self._stream, pre)
        with self._lock:
            if defer or self._coalescing:
                if not self._batch:
                    self._batch_since = time.monotonic()
                self._batch.append(work)
                return work
        with self._launch_lock:
            self._launch_locked(self._take_batch() + [work], what)
        return work

    def _take_batch(self) -> list[NcclWork]:
        with self._lock:
            if self._coalescing:
                return []
            batch, self._batch = self._batch, []
            return batch

    def _flush(self, blocking: bool = True) -> None:
        if not self._launch_lock.acquire(blocking):
            return
        try:
            batch = self._take_batch()
            if batch:
                self._launch_locked(batch, "batched send/recv")
        finally:
            self._launch_lock.release()

    def _launch_locked(self, works: list[NcclWork], what: str) -> None:
        """One NCCL group of every call of ``works``; waits (polling) until NCCL has taken it."""
        try:
            if self._failure is not None:
                raise self._err(NcclAbortedError, what, f"the group already failed: {self._failure}")
            comm = self._ensure_comm()
            stream, dev = self._stream, self._device
            self._launch_since = time.monotonic()      # the watchdog ends a launch NCCL holds too long
            try:
                rc = comm.launch([c for w in works for c in w.calls], self.runtime.handle(stream))
            finally:
                self._launch_since = None
            if rc == nccl_lib.IN_PROGRESS:
                state = comm.settle(self.op_timeout, stop=lambda: self._failure is not None)
                if state == ENDED or self._failure is not None:
                    raise self._err(NcclAbortedError, what, "the communicator was aborted during the launch")
                if state == nccl_lib.IN_PROGRESS:
                    raise self._err(NcclOpTimeoutError, what, f"NCCL did not take the launch within "
                                                              f"{self.op_timeout:g} s")
                if state != nccl_lib.SUCCESS:
                    raise self._err(NcclGroupError, what, str(self._lib.error(state, what)))
            for w in works:                      # copies out of staging buffers, after the calls
                if w.post is not None:
                    self.runtime.enqueue(dev, stream, w.post)
            event = self.runtime.record(stream)
        except Exception as err:   # noqa: BLE001 -- any failure here may have launched part of a group
            failure = self._launch_failure(err, what)
            self._fail(failure)
            for w in works:
                w._fail(failure)
            return
        with self._lock:
            failed = self._failure
            settle = [w for w in works if w._mark_launched(event, stream)]
            watched = [w for w in works if not w.captured]
            if failed is None:
                self._inflight.extend(watched)
        if failed is not None:              # launched into a comm that an abort is ending
            err = self._err(NcclAbortedError, what, f"the group failed during the launch: {failed}")
            for w in works:
                w._fail(err)
            settle = [w for w in watched if not w._queued]    # held until their kernels end
        if settle:
            self._watchers.launched(settle)

    def _launch_failure(self, err: Exception, what: str) -> BaseException:
        if isinstance(err, NcclGroupError):
            return err
        if self._failure is not None:
            return self._err(NcclAbortedError, what, f"the group already failed: {self._failure}")
        if isinstance(err, CommEnded):
            return self._err(NcclAbortedError, what, f"the communicator was {err}")
        return self._err(NcclGroupError, what, f"{type(err).__name__}: {err}")

    # ---- coalescing (torch's _coalescing_manager, batch_isend_irecv) ---------------------------
    def start_coalescing(self) -> None:
        self._flush()
        with self._lock:
            self._coalescing = True

    def end_coalescing(self) -> NcclWork | None:
        """Launch every op issued since start_coalescing as one NCCL group; its one Work."""
        with self._lock:
            self._coalescing = False
            batch, self._batch = self._batch, []
        if not batch:
            return None
        group = NcclWork(self, "coalesced ops", batch[0].device, [w._result for w in batch],
                         keep=[t for w in batch for t in w._keep])
        group.captured = batch[0].captured
        with self._launch_lock:
            self._launch_locked(batch + [group], "coalesced ops")
        return group
