"""Work objects of the hpct process group."""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist
from torch.futures import Future

from ...errors import CollectiveError


class HpctWork(dist.Work):
    """A Work whose wait() raises CollectiveError when the op failed (and honours a timeout).

    torch's FutureWrappingWork (``_create_work_from_future``) returns from wait() even when
    its future holds an error, so the group keeps its own Work type.
    """

    def __init__(self, raw: Future):
        super().__init__()
        self._raw = raw              # completed with (ok, value) when the op ends
        self._fut = None             # get_future()'s, made on first use: most ops never need it
        self._claim = None           # runs the op on the waiting thread if nobody started it

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        claim = self._claim
        if claim is not None:
            self._claim = None
            if not seconds and not self._raw.done():
                claim()
        if seconds and not self._raw.done():
            done = threading.Event()
            self._raw.add_done_callback(lambda _: done.set())
            if not done.wait(seconds):
                raise CollectiveError(f"hpct op did not complete within {seconds:g} s (Work.wait timeout)")
        ok, value = self._raw.wait()
        if not ok:
            raise CollectiveError(value)
        return True

    def get_future(self):
        # The future holds the value or a real C++ error (an exception raised in a
        # then-callback is stored as such) that C++ consumers such as DDP's reducer see;
        # Future.set_exception would store the exception object as a *value*.
        if self._fut is None:
            self._fut = self._raw.then(_unpack)
        return self._fut

    def is_completed(self):
        return self._raw.done()

    def is_success(self):
        return self._raw.done() and self._raw.value()[0]

    def exception(self):
        if self._raw.done() and not self._raw.value()[0]:
            return CollectiveError(self._raw.value()[1])
        return None

    def result(self):
        self.wait()
        return self._raw.value()[1]

    def synchronize(self):
        pass


def _unpack(raw):
    ok, value = raw.value()
    if not ok:
        raise CollectiveError(value)
    return value


class HpctP2PWork(HpctWork):
    """The Work of a send or recv: the message is already posted; wait() completes it.

    As with ProcessGroupGloo, the wait runs on the caller's thread (any number of sends
    and receives may be in flight, in any order), and a ``timeout`` that expires fails the
    group as the op timeout does.  ``is_completed()`` and ``get_future()`` start a
    background wait (bounded by the op timeout), so polling or chaining never waits for a
    wait() that nobody calls.
    """

    def __init__(self, requests, describe, on_error, result):
        super().__init__(Future())
        self._requests = requests          # [(request, finish or None)]
        self._describe = describe
        self._on_error = on_error
        self._result = result
        self._finish_lock = threading.Lock()
        self._waiter: threading.Thread | None = None

    def _complete(self, seconds) -> None:
        try:
            for request, _ in self._requests:
                request.wait(seconds)
        except Exception as err:   # noqa: BLE001 -- the failure goes to the future
            self._on_error(err)
            outcome = (False, f"{self._describe}: {type(err).__name__}: {err}")
        else:
            outcome = (True, self._result)
        with self._finish_lock:
            if self._raw.done():
                return
            if outcome[0]:
                for _, finish in self._requests:
                    if finish is not None:
                        finish()
            self._raw.set_result(outcome)

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if not self._raw.done():
            self._complete(seconds or None)
        return super().wait()

    def _start_waiter(self) -> None:
        with self._finish_lock:
            if self._waiter is None and not self._raw.done():
                self._waiter = threading.Thread(target=self._complete, args=(None,), daemon=True,
                                                name="hpct-p2p-wait")
                self._waiter.start()

    def is_completed(self):
        self._start_waiter()
        return self._raw.done()

    def _source_rank(self):
        """The rank a receive's message came from (what torch asks after recv(src=None))."""
        self.wait()
        return self._requests[0][0].source

    def get_future(self):
        self._start_waiter()
        return super().get_future()
