"""The NCCL engine of one hpct group: launch ops, fail the group once, shut down; bounded everywhere.

Wiring (for the group facade and ``world.create_group``): ``engine_for_group`` (plan.py) builds one
per group and device; an op whose tensors are on CUDA goes to ``engine.<op>(...)`` (ops.py);
abort()/shutdown() come from the facade; ``start_coalescing``/``end_coalescing`` bracket torch's
``_coalescing_manager``.  The communicator is created at the group's first launch.

Semantics follow ProcessGroupNCCL: an op waits for the caller's current stream and runs on the
engine's own stream; ``Work.wait()`` makes the caller's stream wait (a barrier's blocks the
host), ``wait(timeout)`` bounds a host wait, ``get_future()`` is completed when the op's GPU
work has ended, or failed with the group's error -- unlike ProcessGroupNCCL's (completed at
launch), so DDP's backward raises before the optimizer steps on gradients a lost peer never
finished reducing.  The watchdog turns an op past its timeout, a launch NCCL holds past it or
an asynchronous NCCL error into the group's failure: ``NcclGroupError`` naming group, rank,
generation and peer where known; the comm ends by NCCL's abort contract (comm.py).

The fault model (docs/gpu.md): a failure fails every op not ended and keeps the tensors of
every op whose kernel may still run until its event completes; a held call is woken by the
abort flag and the comm aborted once it returned; a call that never returns leaves the comm
leaked (never freed under it), which the group's error says; every wait of a caller is bounded.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Callable, Sequence

import torch

from ...errors import HpctArgumentError
from . import find as nccl_find, library as nccl_lib, native
from .comm import LEAKED, Communicator
from .device import CudaRuntime
from .forming import Forming
from .launch import Launching
from .library import NoCudaDeviceError
from .ops import NcclOps
from .watchdog import Watchers
from .work import (NcclAbortedError, NcclConnectError, NcclGroupError, NcclOpTimeoutError, NcclRefusedError,
                   NcclWork, amend)

__all__ = ["NcclAbortedError", "NcclConnectError", "NcclEngine", "NcclGroupError", "NcclOpTimeoutError",
           "NcclRefusedError", "NcclWork"]



class NcclEngine(NcclOps, Launching, Forming):
    """The NCCL communicator of one hpct group (one CUDA device per process and group).

    Locks: ``_lock`` guards the failure, the batch and coalescing, held only for short steps;
    ``_launch_lock`` keeps launches in issue order and is waited for with a bound; the
    communicator's own lock (comm.py) is held for one NCCL call at a time.  ``_inflight`` holds
    the launched ops in launch order, which on the one engine stream is also their end order.
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
        # Asked for (HPCT_NCCL_BLOCKING=1, the default); used only with a libnccl that can wake a
        # held call (ncclCommRaiseAbortFlag), else non-blocking comms (``comm_kind`` says which).
        self.blocking_comm = blocking_comm
        self.comm_kind: str | None = None
        self._launch_since: float | None = None   # when the launch in progress began
        self._codes: dict = {}                    # dtype, (op, dtype) -> NCCL codes, computed once
        self._last_codes: tuple = (None, None, 0, 0)   # the last allreduce's op, dtype and their codes
        self._fns: dict = {}                      # call name -> (kind, address) of its NCCL function
        self._native = None                       # the native Launcher (native.py), bound at the first op
        self._follow_ev = None                    # the pooled event through which launches follow the caller
        self.runtime = runtime or CudaRuntime()
        self._lib = library
        self._load = load or nccl_find.load
        self._lock = threading.Lock()
        self._launch_lock = threading.Lock()
        self._device: torch.device | None = None
        self._device_index = None                 # its index as Tensor.get_device() says it (-1: CPU)
        self._comm: Communicator | None = None    # set before its init: abort() reaches a forming comm
        self._formed = False
        self._stream = None                       # the stream object (keeps it alive) and its handle
        self._stream_h = None
        self._failure: BaseException | None = None
        self.on_failure = None       # called once, with the first failure (group.py's abort hooks)
        self._closed = False
        self._inflight: collections.deque = collections.deque()   # launched, GPU work not seen ended
        self._batch: list[NcclWork] = []          # deferred launches (p2p, coalescing)
        self._coalescing = False
        self._captured = 0                        # ops launched into CUDA graph captures
        self._launches = 0                        # launches so far: an op's sequence number
        self._orphans: list[NcclWork] = []        # launched with no end event: kept for the engine's life
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

    def _fail(self, err: BaseException, *, capturing: bool = False) -> None:
        """Fail the group once: fail every op not ended, hand the ops whose kernels may still run
        to the completer (it keeps their tensors until their events complete), end the comm.
        ``capturing``: the calling thread is capturing a CUDA graph, where an event query would
        invalidate the capture: no op is asked whether it ended (all are failed and held)."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = err
            works = list(self._inflight) + self._batch
            self._inflight.clear()
            self._batch = []
            comm = self._comm
        for w in works:
            if capturing or not w._poll():
                w._fail(err)
        held = [w for w in works if w._event is not None and not w.captured and not w._done]
        if held:
            self._watchers.settle(held)
        if self.on_failure is not None:
            self.on_failure(err)
        if comm is not None:
            how = comm.abort(on_stuck=self._say_stuck)
            if how == LEAKED:
                amend(err, f"the communicator was {comm.end_how}")
        self._watchers.wake()

    def set_timeout(self, seconds: float) -> None:
        """The op timeout of ops launched from now on (an op in flight keeps its deadline)."""
        self.op_timeout = float(seconds)

    def abort(self, reason: str = "aborted by the application") -> None:
        self._fail(self._err(NcclAbortedError, "op", f"aborted: {reason}"))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Release the communicator within ``timeout``: destroy it when idle, abort it when ops
        are in flight or a launch still holds the engine."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        end = time.monotonic() + timeout
        self._flush(end)                  # the deferred sends and receives go out first
        settled = self._launch_lock.acquire(timeout=max(0.0, end - time.monotonic()))
        if settled:
            self._launch_lock.release()
        while time.monotonic() < end and self._failure is None and self._busy():
            time.sleep(0.005)
        busy = not settled or self._busy() or bool(self._batch)
        if busy or self._failure is not None:
            self.abort("process group shut down")
        self._watchers.join(max(0.0, end - time.monotonic()))
        comm = self._comm
        if comm is not None:          # destroy does nothing when an abort (ours, the watchdog's) ended it
            comm.destroy(max(0.5, end - time.monotonic()), on_stuck=self._say_stuck)

    def _say_stuck(self, why: str) -> None:
        graphs = (f"; {self._captured} op(s) of this group were captured into CUDA graphs: destroy those graphs "
                  "(del graph) to let NCCL free the communicator" if self._captured else "")
        print(f"hpct: {self._describe('end of the communicator')}: {why}{graphs}", file=sys.stderr, flush=True)

    def _busy(self) -> bool:
        """Whether an op launched here may still run (the newest ends last on the one stream)."""
        inflight = self._inflight
        try:
            newest = inflight[-1]
        except IndexError:
            return False
        if newest._poll():
            inflight.clear()
            return False
        return True

    # ---- devices -----------------------------------------------------------------------------
    def _check_device(self, tensors: Sequence[torch.Tensor], what: str) -> torch.device:
        dev = self._device
        if dev is not None and len(tensors) == 1 and tensors[0].device == dev and not tensors[0].is_sparse:
            return dev                    # the common case, checked in one comparison
        if dev is None and not self.runtime.available():
            raise self._refuse(NoCudaDeviceError(
                f"hpct NCCL {what}: no CUDA device is visible to this process ({self.runtime.describe()})",
                fix="run on a GPU node with a CUDA build of torch, or keep the tensors on the CPU"))
        if not tensors:
            raise self._refuse(HpctArgumentError(f"hpct NCCL {what}: requires a non-empty tensor list",
                                                 fix="pass a tensor"))
        first = tensors[0].device
        for i, t in enumerate(tensors):
            if t.device.type != self.device_type or t.device != first:
                raise self._refuse(HpctArgumentError(
                    f"hpct NCCL {what}: tensor {i} is on {t.device}, tensor 0 on {first}",
                    fix="put every tensor of the op on the same CUDA device"))
            if t.is_sparse:
                raise self._refuse(HpctArgumentError(f"hpct NCCL {what}: sparse tensors are not supported "
                                                     "with NCCL", fix="use dense tensors"))
        if dev is not None and first != dev:
            raise self._refuse(HpctArgumentError(
                f"hpct NCCL {what}: this group already uses {dev}; one CUDA device per process "
                "and group", fix="call torch.cuda.set_device once per rank"))
        return first

    def _ensure_stream(self, dev: torch.device) -> None:
        self._bind_native()
        with self._lock:
            if self._stream is None:
                self._stream, self._stream_h = self.runtime.new_stream(dev)
                self._follow_ev = self.runtime.take()
                self._device = dev
                self._device_index = -1 if dev.index is None else dev.index

    def _bind_native(self) -> None:
        """The library's and the runtime's functions for the native launch, resolved once."""
        if self._native is not None:
            return
        if self._lib is None:
            self._lib = self._load()
        launcher = native.launcher(self.runtime, self._lib)
        fns = native.call_prefixes(self._lib)
        with self._lock:
            if self._native is None:
                self._native, self._fns = launcher, fns

    def _stream_wait(self, dev: torch.device, ev) -> None:
        """The caller's current stream of ``dev`` waits for ``ev`` (no host wait)."""
        rc = self._native.stream_wait(self.runtime.current(dev), ev)
        if rc:
            raise self.runtime.driver_error(rc, "the caller's stream waiting for the op (cuStreamWaitEvent)")

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
