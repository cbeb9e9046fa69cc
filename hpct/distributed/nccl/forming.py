"""Forming an engine's communicator at its first launch, bounded, by NCCL's rules.

Which kind of comm: blocking (``HPCT_NCCL_BLOCKING=1``, the default: a launch is one call with
no NCCL thread per group, 60-100 us of host time less per small op on an H200 host) only with a
libnccl that exports ``ncclCommRaiseAbortFlag`` (hpct's patch), without which nothing could
wake a call NCCL holds; otherwise non-blocking, whose calls return at once and which NCCL allows
to abort from another thread.  ``hpct doctor`` says which path the installed library gives.

A blocking init runs on a helper thread and holds the comm's lock to its end; NCCL fills in the
handle before the init runs, so the caller's bound (connect deadline plus op timeout) or a
failure of the group ends a hung init through the abort flag, and the comm is aborted under its
lock once the init returned.  A failed init's comm, which NCCL leaves allocated with its fixed
listen port, is aborted at once, so ``recover()`` can take the same slot again.
"""

from __future__ import annotations

import sys
import threading
import time

from . import library as nccl_lib
from .comm import ENDED, LEAKED, CommEnded, Communicator
from .library import BLOCKING, comm_kind
from .work import NcclConnectError

class Forming:
    """Mixed into NcclEngine: ``_ensure_comm`` (the launch lock is held)."""

    def _ensure_comm(self) -> Communicator:
        self._bind_native()
        lib = self._lib
        lib.require_rootless()
        self.comm_kind = comm_kind(lib, self.blocking_comm)[0]
        blocking = self.comm_kind == BLOCKING
        nxt = self.addresses[(self.rank + 1) % self.size]
        spec = nccl_lib.RootlessSpec(self.listen_addr, nxt, self.job_key, self.generation, self.group_index,
                                     int(self.connect_timeout * 1000), self.retry_delay_ms)
        comm = Communicator(lib, f"rank {self.rank} of {self.size}, listen {self.listen_addr}, next {nxt}",
                            self._native)
        with self._lock:
            if self._failure is not None:
                raise self._failure
            self._comm = comm                 # abort() reaches it from now on
        # The connect deadline bounds the rootless ring inside NCCL; what follows (transport
        # set-up, long at scale) is bounded by the op timeout, as for the first op.
        bound = self.connect_timeout + self.op_timeout
        where = f"(listen {self.listen_addr}, next {nxt})"
        if blocking:
            rc = self._init_blocking(comm, spec, bound, where)
        else:
            try:
                with self.runtime.on(self._device, self._stream):
                    rc = comm.init(self.size, self.rank, spec, blocking=False)
            except CommEnded:
                rc = ENDED
            if rc in (nccl_lib.SUCCESS, nccl_lib.IN_PROGRESS):
                rc = comm.settle(bound, stop=lambda: self._failure is not None)
        if rc != nccl_lib.SUCCESS or self._failure is not None:
            cause = ("aborted while forming" if rc == ENDED or self._failure is not None else
                     f"still in progress after {bound:g} s" if rc == nccl_lib.IN_PROGRESS else
                     str(lib.error(rc, lib.init_what(self.rank, self.size, spec), comm.handle)))
            how = comm.abort()                # the comm NCCL left allocated holds the listen port
            if how == LEAKED:
                cause += f"; the communicator was {comm.end_how}"
            if self._failure is not None and rc == ENDED:
                raise self._failure
            raise self._err(NcclConnectError, "communicator creation", f"{cause} {where}")
        self._formed = True
        self._watchers.start()
        return comm

    def _init_blocking(self, comm: Communicator, spec, bound: float, where: str) -> int:
        """The blocking init on a helper thread, waited for at most ``bound`` and given up when
        the group fails; then ended through the abort flag (comm.abort) and reported."""
        box: dict = {}
        done = threading.Event()
        dev, stream = self._device, self._stream

        def form():
            try:
                with self.runtime.on(dev, stream):
                    box["rc"] = comm.init(self.size, self.rank, spec, blocking=True)
            except CommEnded:
                box["rc"] = ENDED
            except BaseException as err:   # noqa: BLE001 -- handed to the waiting thread
                box["error"] = err
            finally:
                done.set()
        threading.Thread(target=form, daemon=True, name=f"hpct-nccl-init-{self.group_name}").start()
        end = time.monotonic() + bound
        while not done.wait(min(0.05, max(0.0, end - time.monotonic()))):
            if self._failure is None and time.monotonic() < end:
                continue
            why = "aborted while forming" if self._failure is not None else f"not formed within {bound:g} s"
            how = comm.abort(on_stuck=lambda text: print(f"hpct: {self._describe('init')}: {text}",
                                                         file=sys.stderr, flush=True))
            if how == LEAKED:
                why += f"; the communicator was {comm.end_how}"
            elif how is not None:
                why += "; the init was ended through the abort flag and the communicator aborted"
            if self._failure is not None:
                raise self._failure
            raise self._err(NcclConnectError, "communicator creation", f"{why} {where}")
        if "error" in box:
            raise box["error"]
        return box["rc"]
