"""The Work of an op of the NCCL engine, and the engine's error types."""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from ...errors import CollectiveError, HpctArgumentError

LAUNCH_POLL_S = 0.0005     # a wait for an op another thread is launching polls this often


class NcclGroupError(CollectiveError):
    """An NCCL op of an hpct group failed; the group is failed until recover()."""


class NcclOpTimeoutError(NcclGroupError):
    """An op did not complete within the group's op timeout; the communicator was aborted."""


class NcclConnectError(NcclGroupError):
    """The rootless communicator could not be formed before the connect deadline."""


class NcclAbortedError(NcclGroupError):
    """The group was aborted (by the application, a recovery or a peer's failure)."""


class NcclRefusedError(HpctArgumentError):
    """NCCL refused one op at its call (ncclInvalidArgument): nothing was launched and the group
    goes on, as NCCL's comm does."""


def amend(err: BaseException, text: str) -> None:
    """Add ``text`` to an error already handed out (the comm's end is known only after it)."""
    if getattr(err, "problem", None) is not None:
        err.problem = f"{err.problem}; {text}"
    err.args = (f"{err.args[0]}; {text}",) + err.args[1:] if err.args else (text,)


def _unpack(raw):
    # Raised inside a then-callback, the error becomes the future's real (C++) error, which
    # DDP's reducer sees; Future.set_exception would store the exception object as a *value*
    # and the reducer would take it for the op's result.
    ok, value = raw.value()
    if not ok:
        raise value
    return value


def _settle(raw, value) -> None:
    try:
        raw.set_result(value)
    except RuntimeError:       # settled already: a failure and the completer may both try
        pass


class NcclWork(dist.Work):
    """The Work of one NCCL op (or of one NCCL group of ops).

    Built completely before its launch: ``calls`` (the NCCL calls), ``post`` (copies out of
    staging buffers, run on the engine stream right after the calls), ``keep`` (every tensor
    the GPU may still read or write).  Kept tensors are released only once the op's event has
    completed: a failed op's kernel may still run until the comm's abort has ended it.  No
    lock per Work: the launch writes ``_event`` before it reads ``_raw`` and ``get_future``
    writes ``_raw`` before it reads ``_event``, so one of them always queues the future.
    """

    # Slots, not a __dict__: a small op's Work is built per op, and a pybind-derived instance's
    # dict cost it 0.2-0.3 us more on this 2-core machine.
    __slots__ = ("_engine", "what", "device", "calls", "_result", "_keep", "peer", "post", "captured",
                 "_host_wait", "_event", "_launched", "_error", "_done", "_raw", "_fut", "deadline", "seq")

    def __init__(self, engine, what: str, device, result, calls=(), keep=(), *, post=None,
                 host_wait: bool = False, peer: int | None = None):
        super().__init__()
        self._engine = engine
        self.what = what
        self.device = device
        self.calls = calls
        self._result = result
        self._keep = keep
        self.peer = peer
        self.post = post
        self.captured = False             # launched into a CUDA graph capture: never polled
        self._host_wait = host_wait
        self._event = None                # the op's end event, recorded at launch
        self._launched = False            # launched, or failed before it could be
        self._error: BaseException | None = None
        self._done = False
        self._raw = None                  # the (ok, value) future, made on demand (get_future)
        self._fut = None
        self.deadline: float | None = None
        self.seq = 0                      # the launch's sequence number (ops end in launch order)

    def __del__(self):
        ev = self._event
        if ev is not None and not self.captured:      # a captured op's event belongs to its graph
            try:
                self._engine.runtime.release(ev)
            except Exception:   # noqa: BLE001 -- interpreter shutdown
                pass

    # ---- engine side --------------------------------------------------------------------------
    def _mark_launched(self, event, deadline: float, seq: int, ok: bool = True) -> bool:
        """Launched (``ok``: NCCL took it): True when a future was already asked for and must be
        queued.  A captured op that NCCL took completes at launch, as ProcessGroupNCCL's; one it
        failed is failed by the launch next."""
        self._event = event
        self.deadline = deadline
        self.seq = seq
        captured = self.captured and ok
        if captured:
            self._done = True
        self._launched = True
        raw = self._raw
        if raw is not None and captured:
            _settle(raw, (True, self._result))
            return False
        return raw is not None

    def _fail(self, err: BaseException) -> None:
        if self._error is None and not self._done:
            self._error = err
        if self._event is None:           # never launched: nothing on the GPU can use them
            self._keep = ()
        self._launched = True
        raw = self._raw
        if raw is not None and not raw.done():
            _settle(raw, (False, err))

    def _finish(self) -> None:
        """The op's GPU work has ended (the completer's): release the tensors, settle the future."""
        self._done, self._keep = True, ()
        raw = self._raw
        if raw is not None and not raw.done():
            _settle(raw, (False, self._error) if self._error is not None else (True, self._result))

    def _poll(self) -> bool:
        """True when the op's GPU work has ended (or it failed unlaunched); drops the tensors then."""
        if self._done:
            return True
        ev = self._event
        if ev is None:
            return self._error is not None
        if self.captured or not self._engine.runtime.done(ev):
            return False
        self._done, self._keep = True, ()
        return True

    # ---- user side ------------------------------------------------------------------------------
    def _ensure_launched(self, deadline: float | None) -> None:
        bound = self._engine.op_timeout if deadline is None else max(0.0, deadline - time.monotonic())
        end = time.monotonic() + bound
        self._engine._flush(end)
        while not self._launched:          # taken by a launch on another thread: bounded
            if time.monotonic() > end:
                raise self._engine._err(NcclOpTimeoutError, self.what, f"not launched within {bound:g} s",
                                        peer=self.peer)
            time.sleep(LAUNCH_POLL_S)

    def wait(self, timeout=None):
        if timeout is None and self._launched and self._error is None and not (
                self.captured or self._host_wait or self._done):     # the common case: a stream wait
            e = self._engine
            rc = e._native.stream_wait(e.runtime.current(self.device), self._event)
            if rc:
                raise e.runtime.driver_error(rc, "the caller's stream waiting for the op (cuStreamWaitEvent)")
            if self._error is not None:
                raise self._error
            return True
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        deadline = time.monotonic() + seconds if seconds else None
        if not self._launched:
            self._ensure_launched(deadline)
        if self._error is not None:
            raise self._error
        if self.captured:
            self._engine._stream_wait(self.device, self._event)
        elif seconds:
            self._host_wait_until(deadline, seconds)
        elif self._host_wait:
            self._engine.runtime.host_wait(self._event)      # the watchdog bounds it: a stuck op is aborted
        elif not self._done:
            self._engine._stream_wait(self.device, self._event)
        if self._error is not None:
            raise self._error
        return True

    def _host_wait_until(self, deadline: float, seconds: float) -> None:
        pause = 1e-5
        while not self._poll():
            if time.monotonic() > deadline:
                err = self._engine._err(NcclOpTimeoutError, self.what,
                                        f"did not complete within {seconds:g} s (Work.wait timeout); "
                                        "the communicator is aborted", peer=self.peer)
                self._engine._fail(err)
                raise err
            time.sleep(pause)
            pause = min(pause * 2, 0.001)

    def synchronize(self):
        self.wait()

    def is_completed(self):
        """Never waits: a deferred op is launched only when no other launch holds the engine."""
        if not self._launched:
            self._engine._flush(None)
        return self._poll()

    def is_success(self):
        return self._poll() and self._error is None

    def exception(self):
        return self._error

    def get_future(self):
        fut = self._fut
        if fut is None:
            if not self._launched:
                self._engine._flush(time.monotonic() + self._engine.op_timeout)
            if self._poll() and self._error is None:     # ended well (a failure is set before its abort)
                fut = self._engine.runtime.future()
                fut.set_result(self._result)
            else:
                fut = self._future().then(_unpack)
            self._fut = fut
        return fut

    def _future(self):
        """The (ok, value) future: settled at once when the op has failed or ended (or was
        captured), else by the completer once its kernel ended (queued by whoever sees both)."""
        raw = self._raw
        if raw is not None:
            return raw
        raw = self._raw = self._engine.runtime.future()
        if self._error is not None:
            _settle(raw, (False, self._error))
        elif self._event is not None:
            if self._poll():
                _settle(raw, (True, self._result))
            else:
                self._engine._watchers.settle([self])
        return raw

    def result(self):
        self.wait()
        return self._result
