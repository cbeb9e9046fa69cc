"""The two threads of an NCCL engine: the watchdog and the completer.

The watchdog turns what NCCL cannot report by itself into a failed group: an op past its
timeout, a launch that NCCL holds past the op timeout (a blocking comm's lazy connect to a
dead peer), an asynchronous error of the communicator (a lost peer), a batch of sends and
receives that nobody flushed.  The completer settles an op's future once the op's GPU
work has ended, in launch order, so that DDP's backward sees a lost peer's error before the
optimizer steps on gradients that were never fully reduced; until then it holds the op, and
with it every tensor the kernel may still touch.  It sees only the ops that need it: those
whose future was asked for (DDP's) and those that failed while their kernel may still run.  A
plain collective never reaches it: the watchdog's look every 50 ms drops its tensors once its
event has completed, as ProcessGroupNCCL's watchdog does.

Neither thread touches the communicator except through ``Communicator`` (nccl_comm.py), and
neither holds the engine's lock across a wait.  Work launched into a CUDA graph capture is
never queued here: querying or waiting for its event would break the capture.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref

from . import nccl_lib
from .nccl_comm import ENDED
from .nccl_work import NcclGroupError, NcclOpTimeoutError

WATCHDOG_PERIOD_S = 0.05
P2P_FLUSH_S = 0.2
EXIT_JOIN_S = 2.0        # at interpreter exit: how long the threads get to leave torch's C++ code

# Every engine's threads, stopped before the interpreter finalizes.  A daemon thread that is in
# torch's C++ with the GIL released (a future's set_result, an event's synchronize) when
# finalization starts is ended by pthread_exit on its way back, and that unwinding through
# C++ noexcept frames is std::terminate: "terminate called without an active exception", exit 134,
# for a script that ends without destroy_process_group just after a burst of ops.
_LIVE: "weakref.WeakSet[Watchers]" = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    live = list(_LIVE)
    end = time.monotonic() + EXIT_JOIN_S
    for w in live:
        w.exiting = True
        w.stop.set()
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
        self._queue: list = []                 # launched works whose futures are not settled yet
        self._cv = threading.Condition()
        self._threads: list[threading.Thread] = []
        self.exiting = False                  # the interpreter is ending: leave without settling

    def start(self) -> None:
        if self._threads:
            return
        _LIVE.add(self)
        name = self.engine.group_name
        for target, what in ((self._watch, "watchdog"), (self._complete_in_order, "completer")):
            t = threading.Thread(target=target, daemon=True, name=f"hpct-nccl-{what}-{name}")
            t.start()
            self._threads.append(t)

    def launched(self, works) -> None:
        """Hold ``works`` until their events complete, then settle their futures (in order)."""
        with self._cv:
            for w in works:
                w._queued = True
            self._queue.extend(works)
            self._cv.notify()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def join(self, timeout: float) -> None:
        self.stop.set()
        self.wake()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    # ---- the completer ------------------------------------------------------------------------
    def _complete_in_order(self) -> None:
        runtime = self.engine.runtime
        # Once, not per op: this thread's current device and stream are the engine's (a device
        # and stream context per future cost about 20 us of host time each on an H200 host).
        runtime.bind(self.engine._device, self.engine._stream)
        while True:
            with self._cv:
                while not self._queue or self.exiting:
                    if self.stop.is_set():
                        return
                    self._cv.wait(WATCHDOG_PERIOD_S)
                w = self._queue.pop(0)
            # Blocks with the GIL released; the watchdog's abort ends a stuck kernel.  A failed
            # op is waited for too: its kernel may use its tensors until the abort ended it,
            # and this reference is what keeps them.
            runtime.host_wait(w._event)
            w._finish()

    # ---- the watchdog -------------------------------------------------------------------------
    def _watch(self) -> None:
        e = self.engine
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
        if e._stale_batch(P2P_FLUSH_S):
            e._flush(blocking=False)        # never waits behind a launch in progress
        pending, comm = e._pending()
        now = time.monotonic()
        for w in pending:
            if w.deadline is not None and now > w.deadline and not w._poll():
                e._fail(e._err(NcclOpTimeoutError, w.what,
                               f"did not complete within the op timeout ({e.op_timeout:g} s); "
                               "the communicator is aborted", peer=w.peer))
                return True
        since = e._launch_since
        if since is not None and now - since > e.op_timeout:
            e._fail(e._err(NcclOpTimeoutError, "launch", f"NCCL did not take the launch within the op timeout "
                                                         f"({e.op_timeout:g} s); the communicator is aborted"))
            return True
        if comm is None:
            return False
        state = comm.poll_if_free()
        if state is None:             # a launch holds the comm: look again at the next tick
            return False
        if state == ENDED:
            return True
        if state not in (nccl_lib.SUCCESS, nccl_lib.IN_PROGRESS):
            e._fail(e._err(NcclGroupError, "op", str(e.library.error(state, "asynchronous error"))))
            return True
        return False
