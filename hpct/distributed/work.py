"""Work objects of the hpct process group and its error type."""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist
from torch.futures import Future


class HpctError(RuntimeError):
    """An hpct collective failed (peer lost, aborted, timed out); the message names the cause."""


class HpctWork(dist.Work):
    """A Work whose wait() raises HpctError when the op failed (and honours a timeout).

    torch's FutureWrappingWork (``_create_work_from_future``) returns from wait() even when
    its future holds an error, so the group keeps its own Work type.
    """

    def __init__(self, raw: Future, fut: Future):
        super().__init__()
        self._raw = raw
        self._fut = fut

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if seconds and not self._raw.done():
            done = threading.Event()
            self._raw.add_done_callback(lambda _: done.set())
            if not done.wait(seconds):
                raise HpctError(f"hpct op did not complete within {seconds:g} s (Work.wait timeout)")
        ok, value = self._raw.wait()
        if not ok:
            raise HpctError(value)
        return True

    def get_future(self):
        return self._fut

    def is_completed(self):
        return self._raw.done()

    def is_success(self):
        return self._raw.done() and self._raw.value()[0]

    def exception(self):
        if self._raw.done() and not self._raw.value()[0]:
            return HpctError(self._raw.value()[1])
        return None

    def result(self):
        self.wait()
        return self._raw.value()[1]

    def synchronize(self):
        pass


def _unpack(raw):
    ok, value = raw.value()
    if not ok:
        raise HpctError(value)
    return value
