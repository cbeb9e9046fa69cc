"""The Work of an op of the NCCL engine, and the engine's error types."""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

from ..errors import CollectiveError


class NcclGroupError(CollectiveError):
    """An NCCL op of an hpct group failed; the group is failed until recover()."""


class NcclOpTimeoutError(NcclGroupError):
    """An op did not complete within the group's op timeout; the communicator was aborted."""


class NcclConnectError(NcclGroupError):
    """The rootless communicator could not be formed before the connect deadline."""


class NcclAbortedError(NcclGroupError):
    """The group was aborted (by the application, a recovery or a peer's failure)."""


def _unpack(raw):
    # Raised inside a then-callback, the error becomes the future's real (C++) error, which
    # DDP's reducer sees; Future.set_exception would store the exception object as a *value*
    # and the reducer would take it for the op's result.
    ok, value = raw.value()
    if not ok:
        raise value
    return value


class NcclWork(dist.Work):
    """The Work of one NCCL op (or of one NCCL group of ops).

    Built completely before its launch: ``calls`` (the NCCL calls), ``post`` (copies out of
    staging buffers, run on the engine stream right after the calls), ``keep`` (every tensor
    the GPU may still read or write).  Kept tensors are released only once the op's event has
    completed: a failed op's kernel may still run until the comm's abort has ended it.
    """

    def __init__(self, engine, what: str, device, result, *, calls=(), keep=(), post=None,
                 host_wait: bool = False, peer: int | None = None):
        super().__init__()
        self._engine = engine
        self._runtime = engine.runtime
        self.what = what
        self.device = device
        self.peer = peer
        self.calls = list(calls)
        self.post = post
        self.captured = False             # launched into a CUDA graph capture: never polled
        self._result = result
        self._host_wait = host_wait
        self._keep = list(keep)
        self._event = None                # set at launch, with the stream it was recorded on
        self._stream = None
        self._launched = threading.Event()
        self._error: BaseException | None = None
        self._done = False
        # The (ok, value) future is made only when someone asks (get_future: DDP does, a plain
        # collective's wait() does not); the completer then settles it once the kernel has ended.
        self._raw = None
        self._fut = None                  # get_future()'s, made on first use
        self._queued = False              # handed to the completer (it holds the op until its event)
        self._settle_lock = threading.Lock()
        self.deadline: float | None = None

    # ---- engine side --------------------------------------------------------------------------
    def _mark_launched(self, event, stream) -> bool:
        """Launched: True when the completer must settle a future already asked for."""
        with self._settle_lock:
            self._event = event
            self._stream = stream
            self.deadline = time.monotonic() + self._engine.op_timeout
            if self.captured:             # as ProcessGroupNCCL: a captured op completes at launch
                self._done = True
                if self._raw is not None and not self._raw.done():
                    self._raw.set_result((True, self._result))
            settle = self._raw is not None and not self.captured
        self._launched.set()
        return settle

    def _fail(self, err: BaseException) -> None:
        with self._settle_lock:
            if self._error is None and not self._done:
                self._error = err
            if self._event is None:       # never launched: nothing on the GPU can use them
                self._keep = []
            if self._raw is not None and not self._raw.done():
                self._raw.set_result((False, err))
        self._launched.set()

    def _held(self) -> bool:
        """A failed op whose kernel may still run: the completer must hold it (its tensors)
        until its event completes -- the abort ends the kernel."""
        return self._event is not None and not self.captured and not self._queued and not self._poll()

    def _finish(self) -> None:
        """The completer's: the op's GPU work has ended; settle the future, if one was asked for.
        The completer's thread has the engine's device and stream as its current ones
        (runtime.bind), so a CUDA-aware future's consumer waits for the engine stream."""
        with self._settle_lock:
            self._done, self._keep = True, []
            if self._raw is None or self._raw.done():
                return
            self._raw.set_result((False, self._error) if self._error is not None else (True, self._result))

    def _poll(self) -> bool:
        """True when the op's GPU work has ended (or it never launched and failed); drops the
        kept tensors then."""
        if self._done:
            return True
        if self._event is None:
            return self._error is not None
        if self.captured or not self._runtime.done(self._event):
            return False
        self._done, self._keep = True, []
        return True

    # ---- user side ------------------------------------------------------------------------------
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
        if self.captured:
            self._runtime.stream_wait(self.device, self._event)
        elif seconds:
            self._host_wait_until(deadline, seconds)
        elif self._host_wait:
            self._runtime.host_wait(self._event)    # the watchdog bounds it: a stuck op is aborted
        else:
            self._runtime.stream_wait(self.device, self._event)
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
        if self._fut is None:
            self._fut = self._future().then(_unpack)
        return self._fut

    def _future(self):
        """The (ok, value) future, made now: settled at once when the op has failed or ended (or
        was captured), else by the completer when its kernel ends (or by the launch that queues it)."""
        queue = False
        with self._settle_lock:
            if self._raw is None:
                self._raw = self._runtime.future(self.device)
                if self._error is not None:
                    self._raw.set_result((False, self._error))
                elif self._event is None:
                    pass                  # not launched yet: the launch hands it to the completer
                elif self._poll():           # ended (or captured: done at launch)
                    with self._runtime.on(self.device, self._stream):
                        self._raw.set_result((True, self._result))
                else:
                    queue = True
        if queue:
            self._engine._watchers.launched([self])
        return self._raw

    def result(self):
        self.wait()
        return self._result
