"""One collective at a time, in issue order, with as few thread handoffs as possible.

A collective used to go to the group's worker thread every time: the caller queued it,
the worker woke, took the GIL, ran it and completed two torch futures, and the caller
woke again.  For a 4-byte all_reduce that handoff cost more than the message (two
wake-ups and GIL handoffs per op, far worse when the CPUs are busy).  So an op now runs
where it costs least, with the same guarantees:

- An op the caller blocks on at once (torch passes ``asyncOp=False`` for a blocking call;
  the facade says so with ``blocking()``) runs on the caller's thread when nothing is
  queued or running: no queue, no wake-up.
- Any other op is queued for the worker, which runs it without anyone waiting for it
  (an async op progresses while its caller does something else, e.g. a send its peer needs).
- ``Work.wait()`` without a timeout on an op the worker has not started runs it on the
  waiting thread, if it is the head of the line (every op issued before it finished):
  the caller would block anyway, and the worker later finds it taken.

Why the worker is still woken at once for every queued op (measured with
``benchmarks/collectives.py`` at 4 B, N = 2 and 4, on 2 virtual CPUs): C++ doorbells that let
the worker sleep without the GIL until an op went unclaimed for 200 us (woken by a condition
variable, by a 1 ms poll while ops came often, or by a kernel timer) spared the caller a
wake-up (8 us median, 30 us p90), yet no row got faster: with the timer, all_to_all_single
at N = 2 ran at 0.69-0.83x Gloo's against 0.86-0.95x in interleaved runs, and the poll cost
N = 4 (all_reduce 0.86-0.90x against 1.2x).  A likely cause, not proven: the early wake-up
has the second CPU running when the messages arrive.

Every op still runs alone and in issue order (one claim at a time, always the head of the
queue).  A transport error fails the group: every later op fails at once with its cause.
"""

from __future__ import annotations

import collections
import queue
import threading

import torch
from torch.futures import Future

from ... import _gloo
from .work import HpctWork


class _Op:
    __slots__ = ("what", "fn", "result", "inference", "raw")

    def __init__(self, what, fn, result, inference, raw):
        self.what, self.fn, self.result, self.inference, self.raw = what, fn, result, inference, raw


def failed_work(message: str) -> HpctWork:
    raw = Future()
    raw.set_result((False, message))
    return HpctWork(raw)


def done_work(value=None) -> HpctWork:
    raw = Future()
    raw.set_result((True, value))
    return HpctWork(raw)


class Runner:
    """Runs a group's collectives; ``describe(what)`` words their errors."""

    def __init__(self, describe, thread_name: str):
        self._describe = describe
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()   # _Op not started, in issue order
        self._running = False            # an op is running (on the worker or a caller)
        self._tokens: queue.SimpleQueue = queue.SimpleQueue()    # one per queued op; None stops
        self._local = threading.local()  # .blocking: the op being issued is waited for at once
        self.failure: BaseException | None = None
        self.on_failure = None           # called once, with the first failure (group.py's abort hooks)
        self.closed = False
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._thread.start()

    def blocking(self, call, *args):
        """``call(*args)``, whose op the caller waits for at once (may run on this thread)."""
        self._local.blocking = True
        try:
            return call(*args)
        finally:
            self._local.blocking = False

    def submit(self, what: str, fn, result) -> HpctWork:
        """Issue ``fn`` (the op's body); its Work's value is ``result``."""
        raw = Future()
        op = _Op(what, fn, result, torch.is_inference_mode_enabled(), raw)
        here = getattr(self._local, "blocking", False)
        with self._lock:
            if self.closed:
                closed = True
            else:
                closed = False
                here = here and not self._running and not self._pending
                if here:
                    self._running = True
                else:
                    self._pending.append(op)
        if closed:
            return failed_work(f"{self._describe(what)}: the group is shut down")
        work = HpctWork(raw)
        if here:
            self._execute(op)
        else:
            work._claim = lambda: self._run_here(op)
            self._tokens.put(True)
        return work

    def note_failure(self, err) -> None:
        # Only a transport error ends the group; a local one (bad argument) fails its op only.
        if isinstance(err, _gloo.GlooError):
            self.fail(err)

    def fail(self, err: BaseException) -> None:
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = err
        if first and self.on_failure is not None:
            self.on_failure(err)

    def start_close(self) -> tuple[bool, bool]:
        """Refuse new ops: (first close?, an op running or queued?)."""
        with self._lock:
            first, self.closed = not self.closed, True
            return first, self._running or bool(self._pending)

    def finish_close(self, timeout: float) -> None:
        """Fail what never started, stop the worker (a running op was aborted by the caller)."""
        with self._lock:
            doomed = list(self._pending)
            self._pending.clear()
        for op in doomed:
            op.raw.set_result((False, f"{self._describe(op.what)}: the group already failed: "
                                      f"{self.failure or 'the group is shut down'}"))
        self._tokens.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- running ops ------------------------------------------------------------------------
    def _claim(self, want=None):
        """Take the head of the queue (only ``want``, if given) when nothing runs."""
        with self._lock:
            if self._running or not self._pending or (want is not None and self._pending[0] is not want):
                return None
            self._running = True
            return self._pending.popleft()

    def _run_here(self, op) -> None:
        if self._claim(op) is not None:
            self._execute(op)

    def _loop(self) -> None:
        while self._tokens.get() is not None:
            while (op := self._claim()) is not None:
                self._execute(op)

    def _execute(self, op) -> None:
        failure = self.failure
        if failure is not None:
            outcome = (False, f"{self._describe(op.what)}: the group already failed: {failure}")
        else:
            try:
                # The caller's inference mode travels with the op: outputs made under
                # torch.inference_mode() may only be written in that mode.
                if op.inference != torch.is_inference_mode_enabled():
                    with torch.inference_mode(op.inference):
                        op.fn()
                else:
                    op.fn()
                outcome = (True, op.result)
            except BaseException as err:   # noqa: BLE001 -- every error goes to the Work
                self.note_failure(err)
                outcome = (False, f"{self._describe(op.what)}: {type(err).__name__}: {err}")
        with self._lock:
            self._running = False
            more = bool(self._pending)
        op.raw.set_result(outcome)
        if more and threading.current_thread() is not self._thread:
            self._tokens.put(True)       # the worker skipped them while this op ran here
