"""One NCCL communicator and the rules for calling into it: the only module that touches a comm handle.

The rules (NCCL 2.30.7's sources and torch's ProcessGroupNCCL say why each is needed):

1. **Every call on a communicator holds its lock**, ``ncclCommGetAsyncError`` included: on a
   non-blocking comm that call completes and frees the comm's finished group job without a lock
   of NCCL's own (init.cc ~3477), so two threads polling one comm at once free it twice.  torch
   keeps a mutex per NCCLComm for the same reason.  The lock is held for one call at a time and
   never across a wait of ours.  A non-blocking comm's calls return at once; a blocking comm's
   launch returns once NCCL has taken it, which a lazy connect to a dead peer can hold: the
   watchdog then looks with ``poll_if_free`` (it never queues behind the launch) and ends it
   by abort (rule 4) once it is older than the op timeout.
2. **No call after the comm has ended.**  Whoever ends it (abort or destroy) marks it ended
   under the lock, so a call that takes the lock afterwards sees the mark and touches nothing.
3. **Abort alone ends a failed comm**, never revoke then abort: with a group job still linked,
   ``ncclCommRevoke`` frees the job and leaves ``comm->groupJob`` dangling (init.cc ~425,
   group.cc ~902) for the abort to walk.  ProcessGroupNCCL aborts alone too.
4. **Abort may come from any thread and ends a stuck call.**  It marks the comm ending first (no
   new call starts), waits at most ``ABORT_LOCK_S`` for the call in progress, then calls
   ``ncclCommAbort`` -- without the lock when a call is stuck inside NCCL, which is the one case
   NCCL documents abort from another thread for.  Abort is bounded by ``ABORT_BOUND_S``.
5. **A comm ends once**: abort and destroy race (a watchdog failing the group while the
   application shuts it down); the first wins and the other does nothing.
6. **Waiting polls, it does not sleep**: ``settle`` polls the async state and yields the CPU
   (``sched_yield``) between polls, as torch does; only after ``SPIN_POLLS`` polls (a launch
   that is evidently not quick: a connect, a peer that is late) it sleeps, backing off to
   ``MAX_BACKOFF_S``.  A 2 ms sleep per poll cost every small op 2 ms.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Sequence

from . import nccl_lib

ABORT_LOCK_S = 1.0        # how long abort waits for a call in progress before aborting without the lock
ABORT_BOUND_S = 10.0      # how long abort itself may take before the caller goes on without it
SPIN_POLLS = 2000         # polls (each followed by sched_yield) before a wait starts sleeping
MAX_BACKOFF_S = 0.001     # the longest sleep between two polls of a long wait

# A call of an op: (library method, arguments before comm and stream), all plain ints, computed
# before ncclGroupStart so nothing can raise between the group's start and its end.
Call = tuple[str, tuple]

ENDED = -1                # poll()'s answer once the comm has ended (no NCCL result has this value)


class CommEnded(Exception):
    """A call was asked of a comm that has ended (aborted or destroyed); nothing was called."""


class Communicator:
    """An NCCL communicator handle with its lock and its end (see the module doc for the rules)."""

    def __init__(self, lib, handle, describe: str):
        self.lib = lib
        self._handle = handle
        self.describe = describe
        self.lock = threading.Lock()
        self._ending = False          # set first by abort: no new call may start
        self._ended = False           # set under the lock by whoever ends it
        self.end_how: str | None = None

    # ---- creation ---------------------------------------------------------------------------
    @classmethod
    def create_rootless(cls, lib, nranks: int, rank: int, spec, *, blocking: bool = False) -> "Communicator":
        """Start a rootless init (non-blocking unless asked); ``settle`` then waits for it (bounded)."""
        handle, _ = lib.comm_init_rootless(nranks, rank, spec, blocking=blocking)
        return cls(lib, handle, f"rank {rank} of {nranks}, listen {spec.listen_addr}, next {spec.next_addr}")

    # ---- state --------------------------------------------------------------------------------
    @property
    def ended(self) -> bool:
        return self._ending or self._ended

    def call(self, method: str, *args):
        """``lib.method(*args, handle)`` under the lock; CommEnded when the comm has ended."""
        with self.lock:
            if self._ending or self._ended:
                raise CommEnded(self.end_how or "ending")
            return getattr(self.lib, method)(*args, self._handle)

    def poll(self) -> int:
        """The comm's async state (ncclSuccess, ncclInProgress or an error code), or ENDED."""
        try:
            return self.call("async_error")
        except CommEnded:
            return ENDED

    def poll_if_free(self) -> int | None:
        """``poll()``, or None at once when another call holds the comm (a blocking launch that
        NCCL holds: the watchdog must not queue behind it, it has to end it)."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            if self._ending or self._ended:
                return ENDED
            return self.lib.async_error(self._handle)
        finally:
            self.lock.release()

    def launch(self, calls: Sequence[Call], stream: int) -> int:
        """One NCCL group of ``calls`` on ``stream``, under the lock.  Returns ncclGroupEnd's
        result (ncclSuccess or ncclInProgress) or raises NcclError; CommEnded when ended."""
        lib = self.lib
        with self.lock:
            if self._ending or self._ended:
                raise CommEnded(self.end_how or "ending")
            lib.group_start()
            first_error = None
            for method, args in calls:
                rc = getattr(lib, method)(*args, self._handle, stream)
                if rc and first_error is None:
                    # NCCL remembers the error and ncclGroupEnd cleans the whole group up
                    # without launching any of it; the group must still be ended.
                    first_error = lib.error(rc, method, self._handle)
            try:
                rc = lib.group_end()
            except nccl_lib.NcclError as err:
                first_error = first_error or err
        if first_error is not None:
            raise first_error
        return rc

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
    def abort(self, on_stuck: Callable[[str], None] | None = None) -> bool:
        """End the comm with ncclCommAbort, from any thread, bounded.  False if it had ended."""
        with _end_lock:
            if self._ending or self._ended:
                return False
            self._ending = True
        locked = self.lock.acquire(timeout=ABORT_LOCK_S)
        self._ended, self.end_how = True, "aborted"
        handle, self._handle = self._handle, None

        def run():
            try:
                self.lib.abort(handle)
            finally:
                if locked:
                    self.lock.release()
        t = threading.Thread(target=run, name="hpct-nccl-abort", daemon=True)
        t.start()
        t.join(ABORT_BOUND_S)
        if t.is_alive() and on_stuck is not None:
            on_stuck(f"ncclCommAbort did not return within {ABORT_BOUND_S:g} s ({self.describe})")
        return True

    def destroy(self) -> bool:
        """End an idle comm with ncclCommDestroy.  False if it had ended (abort won)."""
        with _end_lock:
            if self._ending or self._ended:
                return False
            self._ending = True
        with self.lock:
            self._ended, self.end_how = True, "destroyed"
            handle, self._handle = self._handle, None
            self.lib.destroy(handle)
        return True

    def __repr__(self) -> str:
        return f"Communicator({self.describe}, {'ended: ' + str(self.end_how) if self.ended else 'live'})"


# Deciding who ends a comm is one step for every comm of the process (rule 5); it never waits.
_end_lock = threading.Lock()
