"""One NCCL communicator and the rules for calling into it: the only module that touches a comm handle.

The rules (NCCL 2.30.7's sources, its "Fault Tolerance" section and torch's ProcessGroupNCCL say
why each is needed):

1. **Every call on a communicator holds its lock**, ``ncclCommGetAsyncError`` and
   ``ncclCommAbort`` included: on a non-blocking comm ``ncclCommGetAsyncError`` completes and
   frees the comm's finished group job without a lock of NCCL's own (init.cc ~3477), and abort
   frees the comm itself.  A blocking comm's init and launch hold the lock for the whole call,
   which NCCL can hold (a lazy connect to a silent peer, a ring that does not form); the
   watchdog looks with ``poll_if_free`` and never queues behind such a call.
2. **No call after the comm has ended.**  Whoever ends it marks it ended under the lock.
3. **Abort alone ends a failed comm**, never revoke then abort (revoke frees a linked group
   job and leaves ``comm->groupJob`` dangling, init.cc ~425, group.cc ~902).
4. **ncclCommAbort runs only under the lock**: NCCL allows abort only while no other thread
   is inside a call on the same comm, because ``commFree`` frees the comm, its abort flag, its
   host stream and its scratch event.  A held call is first woken by raising the comm's abort
   flags alone (``ncclCommRaiseAbortFlag``, hpct's NCCL patch: an atomic store, no lock) and
   the native launch's own (``flag``: a launch that sees it before its group calls nothing);
   abort then waits at most ``ABORT_HELD_S`` for the call to return and release the lock.  A call that
   does not return in that time leaves the comm **leaked**: never freed under the call; a reaper
   thread aborts it if the call ever returns.  A libnccl without the patch cannot wake a held
   call, so the engine uses non-blocking comms there, whose calls return at once (engine.py).
5. **A comm ends once**: abort and destroy race; the first wins, the other does nothing.
6. **Waiting polls, it does not sleep**: ``settle`` polls and yields (``sched_yield``) between
   polls, as torch does; after ``SPIN_POLLS`` polls it backs off up to ``MAX_BACKOFF_S``.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Callable

from . import library as nccl_lib
from .native import AbortFlag

ABORT_HELD_S = 5.0        # how long abort waits for a held call to return after raising the flag
ABORT_BOUND_S = 10.0      # how long ncclCommAbort itself may take before the caller goes on
RAISE_EVERY_S = 0.002     # while waiting, the flag is raised again (a blocking init sets the handle late)
SPIN_POLLS = 2000         # polls (each followed by sched_yield) before a wait starts sleeping
MAX_BACKOFF_S = 0.001     # the longest sleep between two polls of a long wait

# A call of an op is (kind, function address, its arguments before comm and stream), all
# computed before the launch (native.py), so nothing can raise between the group's start and end.

ENDED = -1                # poll()'s answer once the comm has ended (no NCCL result has this value)
ABORTED, LEAKED = "aborted", "leaked"


class CommEnded(Exception):
    """A call was asked of a comm that has ended (aborted, leaked or destroyed); nothing was called."""


class Communicator:
    """An NCCL communicator handle with its lock and its end (see the module doc for the rules).

    The handle lives in ``box`` (a ``c_void_p``) from before the init call: NCCL fills it in
    before a blocking init runs, so abort can raise its flag from another thread."""

    def __init__(self, lib, describe: str, launcher=None):
        self.lib = lib
        self.launcher = launcher      # the engine's native Launcher (native.py)
        self.flag = AbortFlag()       # the native launch's view of the abort flag
        self.box = ctypes.c_void_p()
        self.describe = describe
        self.lock = threading.Lock()
        self._ending = False          # set first by abort: no new call may start
        self._ended = False           # set under the lock by whoever ends it
        self.end_how: str | None = None
        self.freed = False            # ncclCommAbort / ncclCommDestroy returned
        self.trace: list[tuple[float, str]] = []   # the end's steps (monotonic time, what): the proof reads it

    @property
    def handle(self):
        return self.box.value

    # ---- creation ---------------------------------------------------------------------------
    def init(self, nranks: int, rank: int, spec, *, blocking: bool) -> int:
        """ncclCommInitRankRootless under the lock (a blocking init holds it to the end); its result.
        A failed init leaves the comm allocated: the caller aborts it (it holds the listen port)."""
        with self.lock:
            if self._ending or self._ended:
                raise CommEnded(self.end_how or "ending")
            return self.lib.init_rootless(self.box, nranks, rank, spec, blocking=blocking)

    # ---- state --------------------------------------------------------------------------------
    @property
    def ended(self) -> bool:
        return self._ending or self._ended

    def call(self, method: str, *args):
        """``lib.method(*args, handle)`` under the lock; CommEnded when the comm has ended."""
        with self.lock:
            if self._ending or self._ended:
                raise CommEnded(self.end_how or "ending")
            return getattr(self.lib, method)(*args, self.box.value)

    def poll(self) -> int:
        """The comm's async state (ncclSuccess, ncclInProgress or an error code), or ENDED."""
        try:
            return self.call("async_error")
        except CommEnded:
            return ENDED

    def poll_if_free(self) -> int | None:
        """``poll()``, or None at once when another call holds the comm."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            if self._ending or self._ended:
                return ENDED
            return self.lib.async_error(self.box.value)
        finally:
            self.lock.release()

    def launch(self, calls: list, caller: int, stream: int, follow_event: int, end) -> int:
        """One native launch under the lock (native.py): the engine stream follows ``caller``
        through ``follow_event`` (0: the ops followed it when issued), one NCCL group of
        ``calls`` on ``stream``, then the end event(s) ``end``.  Returns the launch's bits; an op
        whose own call answered ncclInvalidArgument is REFUSED (NCCL ended the group without
        launching any of it and the comm stays usable).  CommEnded when ended."""
        with self.lock:
            if self._ending or self._ended:
                raise CommEnded(self.end_how or "ending")
            return self.launcher.launch(self.flag, self.box.value or 0, caller, stream, follow_event, end, calls)

    def settle(self, seconds: float, *, stop: Callable[[], bool] = lambda: False) -> int:
        """Poll until the comm leaves ncclInProgress or ``seconds`` pass; the last state.

        The lock is taken for each poll only, so abort (and the watchdog) get in between.
        Returns ncclSuccess, an error code, ENDED, or ncclInProgress when time ran out or
        ``stop()`` said so.
        """
        end = time.monotonic() + seconds
        polls = 0
        backoff = 1e-5
        while True:
            state = self.poll()
            if state != nccl_lib.IN_PROGRESS or stop() or time.monotonic() > end:
                return state
            polls += 1
            os.sched_yield()
            if polls > SPIN_POLLS:
                time.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    # ---- the end -----------------------------------------------------------------------------
    def _raise_flag(self) -> None:
        self.flag.raise_flag()
        handle = self.box.value
        if handle is not None and self.lib.has_raise_abort:
            self.lib.raise_abort(handle)

    def abort(self, on_stuck: Callable[[str], None] | None = None) -> str | None:
        """End the comm with ncclCommAbort under its lock, from any thread, bounded.

        Returns ABORTED, LEAKED (a held call did not return within ABORT_HELD_S of its abort
        flag: the comm is left allocated and a reaper aborts it once the call returns), or None
        when the comm had already ended."""
        with _end_lock:
            if self._ending or self._ended:
                return None
            self._ending = True
        # A poll holds the lock for microseconds: the flag is for a call that NCCL holds.
        locked = self.lock.acquire(timeout=RAISE_EVERY_S)
        if not locked:                 # a call is inside NCCL: wake it, then wait for it
            end = time.monotonic() + ABORT_HELD_S
            while not locked and time.monotonic() < end:
                if not self.trace:
                    self.trace.append((time.monotonic(), "abort flag raised"))
                self._raise_flag()
                locked = self.lock.acquire(timeout=RAISE_EVERY_S)
            if locked:
                self.trace.append((time.monotonic(), "the held call returned"))
        if not locked:
            self.end_how = (f"{LEAKED}: a call on it did not return within {ABORT_HELD_S:g} s of its abort "
                            "flag; it is aborted if the call ever returns")
            threading.Thread(target=self._reap, name="hpct-nccl-reaper", daemon=True).start()
            if on_stuck is not None:
                on_stuck(f"communicator {self.end_how} ({self.describe})")
            return LEAKED
        self._ended, self.end_how = True, ABORTED
        self._abort_locked(on_stuck)
        return ABORTED

    def _abort_locked(self, on_stuck) -> None:
        self._free_locked(self.lib.abort, "ncclCommAbort", ABORT_BOUND_S, on_stuck)

    def _free_locked(self, call, name: str, bound: float, on_stuck) -> bool:
        """``call(handle)`` on a helper thread that owns the (already taken) lock; bounded join.
        NCCL's abort and destroy wait for every CUDA graph that captured an op on the comm to be
        destroyed (commDestroySync), so either may outlast any bound: the caller goes on."""
        handle = self.box.value

        def run():
            try:
                self.trace.append((time.monotonic(), f"{name} called"))
                if handle is not None:
                    call(handle)
                self.freed = True
                self.trace.append((time.monotonic(), f"{name} returned"))
            finally:
                self.lock.release()
        t = threading.Thread(target=run, name=f"hpct-nccl-{name}", daemon=True)
        t.start()
        t.join(bound)
        if t.is_alive() and on_stuck is not None:
            on_stuck(f"{name} did not return within {bound:.1f} s ({self.describe}); it frees the comm once it "
                     "does (a CUDA graph that captured an op on this comm keeps it until the graph is destroyed)")
        return not t.is_alive()

    def _reap(self) -> None:
        self.lock.acquire()            # the held call returned: nothing else is inside the comm
        self._ended = True
        self._abort_locked(None)

    def destroy(self, bound: float = ABORT_BOUND_S, on_stuck=None) -> bool:
        """End an idle comm with ncclCommDestroy, waiting at most ``bound`` for it.  False if it
        had ended (abort won) or is still being destroyed at the bound."""
        with _end_lock:
            if self._ending or self._ended:
                return False
            self._ending = True
        if not self.lock.acquire(timeout=ABORT_HELD_S):     # not idle after all: abort by the rules
            with _end_lock:
                self._ending = False
            self.abort(on_stuck)
            return False
        self._ended, self.end_how = True, "destroyed"
        return self._free_locked(self.lib.destroy, "ncclCommDestroy", bound, on_stuck)

    def __repr__(self) -> str:
        return f"Communicator({self.describe}, {'ended: ' + str(self.end_how) if self.ended else 'live'})"


# Deciding who ends a comm is one step for every comm of the process (rule 5); it never waits.
_end_lock = threading.Lock()
