"""The two helper threads of an NCCL engine: the watchdog and the completer.  Neither ever launches.

The watchdog turns what NCCL cannot report by itself into a failed group: an op past its
timeout, a launch that NCCL holds past the op timeout (a blocking comm's lazy connect to a dead
peer), an asynchronous error of the communicator (a lost peer).  It looks every 50 ms at the
oldest launched ops only: on the one engine stream ops end in launch order, so the first one
not ended stops the look (one event query per tick in the steady state, not one per op).  It
never calls into NCCL but to poll (when no call holds the comm) and, through the group's
failure, to abort by NCCL's rules (comm.py); a deferred batch of sends and receives is launched
by the application's next call, never here.

The completer settles the futures that were asked for (DDP's) once their op's GPU work has
ended, so that DDP's backward sees a lost peer's error before the optimizer steps on gradients
that were never fully reduced; it also holds the ops of a failed group whose kernels may still
run (their tensors) until the abort has ended them.  Its loop is native (``hpct._gloo.Completer``,
native.py): the launching thread queues a work without any Python lock or wake-up of its own; the
completer's thread takes everything queued at once and waits without the GIL for the newest op's
event (the older ones have ended by then: one stream, launch order), then hands the batch back to
Python in one call.  A backward pass of many buckets costs it one wake, not one per bucket.

Both threads run in thread-local capture mode (``runtime.helper``): their event queries never
break a CUDA graph capture on another thread.  Work launched into a capture is never queued.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref

from . import library as nccl_lib, native
from .comm import ENDED
from .work import NcclGroupError, NcclOpTimeoutError

WATCHDOG_PERIOD_S = 0.05
EXIT_JOIN_S = 2.0        # at interpreter exit: how long the threads get to leave torch's C++ code

# Every engine's threads, stopped before the interpreter finalizes.  A daemon thread that is in
# torch's C++ with the GIL released when finalization starts is ended by pthread_exit on its way
# back, and unwinding that through C++ noexcept frames is std::terminate (exit 134).
_LIVE: "weakref.WeakSet[Watchers]" = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    live = list(_LIVE)
    end = time.monotonic() + EXIT_JOIN_S
    for w in live:
        w.exiting = True
        w.stop.set()
        if w._native is not None:
            w._native.stop(True)
        w.wake()
    for w in live:
        for t in w._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, end - time.monotonic()))


class Watchers:
    """Starts, feeds and stops the watchdog and the completer of one engine."""

    def __init__(self, engine):
        self.engine = engine
        self.stop = threading.Event()
        self._native = None                    # the completer's queue and loop (hpct._gloo.Completer)
        self.queued = 0                        # works handed to the completer so far
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()
        self.exiting = False                   # the interpreter is ending: leave without settling

    def start(self) -> None:
        with self._start_lock:
            if self._threads:
                return
            _LIVE.add(self)
            self._native = native.completer(self.engine.runtime)
            name = self.engine.group_name
            for target, what in ((self._watch, "watchdog"), (self._complete, "completer")):
                t = threading.Thread(target=target, daemon=True, name=f"hpct-nccl-{what}-{name}")
                t.start()
                self._threads.append(t)

    def settle(self, works) -> None:
        """Hold ``works`` until their events complete, then settle their futures (in order)."""
        if not self._threads:
            self.start()
        add = self._native.add
        for w in works:
            add(w, w._event, w.seq)
        self.queued += len(works)

    def wake(self) -> None:
        if self._native is not None:
            self._native.wake()

    def join(self, timeout: float) -> None:
        self.stop.set()
        if self._native is not None:
            self._native.stop(self.exiting)
        self.wake()
        end = time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, end - time.monotonic()))

    # ---- the completer ------------------------------------------------------------------------
    def _complete(self) -> None:
        e = self.engine
        e.runtime.helper(e._device)
        self._native.run(self._finish)

    def _finish(self, batch, rc: int) -> None:
        """The completer's batch: every op's GPU work has ended (``rc``: the wait's CUDA error)."""
        e = self.engine
        if rc and e.failure is None:
            e._fail(e._err(NcclGroupError, "completer", str(e.runtime.driver_error(
                rc, "waiting for an op's end event (cuEventSynchronize)"))))
        for w in batch:
            w._finish()

    # ---- the watchdog -------------------------------------------------------------------------
    def _watch(self) -> None:
        e = self.engine
        e.runtime.helper(e._device)
        while not self.stop.wait(WATCHDOG_PERIOD_S):
            if e.failure is not None:
                return
            try:
                if self._tick(e):
                    return
            except Exception as err:   # noqa: BLE001 -- the watchdog must fail the group, not die
                e._fail(e._err(NcclGroupError, "watchdog", f"{type(err).__name__}: {err}"))
                return

    def _tick(self, e) -> bool:
        """One look at the engine; True when the watchdog is done (the group failed or ended)."""
        inflight = e._inflight
        oldest = None
        while inflight:
            try:
                oldest = inflight[0]
            except IndexError:            # a failure cleared it meanwhile
                oldest = None
                break
            if not oldest._poll():
                break
            try:
                inflight.popleft()
            except IndexError:
                pass
            oldest = None
        now = time.monotonic()
        if oldest is not None and oldest.deadline is not None and now > oldest.deadline:
            e._fail(e._err(NcclOpTimeoutError, oldest.what,
                           f"did not complete within the op timeout ({e.op_timeout:g} s); "
                           "the communicator is aborted", peer=oldest.peer))
            return True
        since = e._launch_since
        if since is not None and now - since > e.op_timeout:
            e._fail(e._err(NcclOpTimeoutError, "launch", f"NCCL did not take the launch within the op timeout "
                                                         f"({e.op_timeout:g} s); the communicator is aborted"))
            return True
        comm = e._comm
        if comm is None or not e._formed:
            return False
        state = comm.poll_if_free()
        if state is None:             # a call holds the comm: look again at the next tick
            return False
        if state == ENDED:
            return True
        if state not in (nccl_lib.SUCCESS, nccl_lib.IN_PROGRESS):
            e._fail(e._err(NcclGroupError, "op", str(e.library.error(state, "asynchronous error"))))
            return True
        return False
