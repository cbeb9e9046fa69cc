"""The real CUDA runtime of the NCCL engine (hpct/distributed/nccl/device.py) over a stand-in libcuda.

What this proves: the runtime's own logic -- which driver call each step makes with which
handles (the native launch's follow and capture check through the addresses the runtime hands
out, its pool of events: an event goes back once a Work is dropped, beyond the cap it is
destroyed), that the caller's stream is the current one of the tensor's device, and that a driver
error becomes one CudaDriverError naming the step and the error.  What only a GPU
proves: that libcuda behaves as stood in for here (the GPU proof runs this runtime, docs/gpu.md).
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from hpct.distributed.nccl import device, native
from hpct.testing.nccl_sim.callbacks import CAPTURING, GROUP, RECORD, SYNC, WAIT

pytestmark = pytest.mark.unit
NOT_READY, INVALID_HANDLE = device.CUDA_ERROR_NOT_READY, 400


class StubDriver:
    """libcuda's calls the runtime makes, recorded; results come from ``answers``.  The calls the
    native launch makes are C callbacks (the addresses the runtime hands out)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.answers: dict[str, int] = {}
        self._next = 0x100
        self.cuEventRecord = RECORD(lambda ev, stream: self._ret("record", ev, stream))
        self.cuStreamWaitEvent = WAIT(lambda stream, ev, flags: self._ret("wait", stream, ev))
        self.cuEventSynchronize = SYNC(lambda ev: self._ret("sync", ev))
        self.cuStreamIsCapturing = CAPTURING(self._capturing)

    def _ret(self, name, *args):
        self.calls.append((name, *args))
        return self.answers.get(name, 0)

    def _capturing(self, stream, out):
        out[0] = self.answers.get("capturing", 0)
        return self._ret("is_capturing", stream)

    def cuEventCreate(self, out, flags):
        self._next += 1
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = self._next
        return self._ret("create", flags)

    def cuEventQuery(self, ev): return self._ret("query", ev)
    def cuEventDestroy_v2(self, ev): return self._ret("destroy", ev)

    def cuGetErrorName(self, rc, out):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_char_p))[0] = b"CUDA_ERROR_INVALID_HANDLE"
        return 0

    check, error = device.Driver.check, device.Driver.error


class NoNccl:
    """The NCCL half of a Launcher, never called by these tests' follows."""

    def addresses(self):
        return {"ncclGroupStart": address_of(GROUP(lambda: 99)), "ncclGroupEnd": address_of(GROUP(lambda: 99))}


_KEEP = []


def address_of(cb):
    _KEEP.append(cb)
    return ctypes.cast(cb, ctypes.c_void_p).value


@pytest.fixture
def rt():
    r = device.CudaRuntime()
    d = r._drv = StubDriver()
    r._query_fn = d.cuEventQuery
    r._raw = lambda index: 0x5000 + index          # the caller's current stream of device ``index``
    return r


DEV = torch.device("cuda", 3)


def test_the_launch_follows_the_callers_stream_of_the_tensors_device(rt):
    launcher = native.launcher(rt, NoNccl())
    ev = rt.take()
    assert rt._drv.calls[0][0] == "create"
    assert launcher.follow(rt.current(DEV), 0x77, ev) == 0
    assert rt._drv.calls[1:] == [("is_capturing", 0x5003), ("record", ev, 0x5003), ("wait", 0x77, ev)]
    assert native.completer(rt) is not None         # cuEventSynchronize's address resolves too


def test_an_end_event_is_pooled_only_when_released_and_destroyed_beyond_the_cap(rt, monkeypatch):
    ev = rt.take()
    assert rt._pool == []
    rt._drv.answers["query"] = NOT_READY
    assert rt.done(ev) is False
    rt._drv.answers["query"] = 0
    assert rt.done(ev) is True
    monkeypatch.setattr(device, "POOL_MAX", 1)
    rt.release(ev)
    other = rt.take()                             # taken from the pool
    assert other == ev and rt._pool == []
    third = rt.take()
    rt.release(other)
    rt.release(third)                             # over the cap: destroyed
    assert rt._pool == [ev] and rt._drv.calls[-1] == ("destroy", third)


def test_the_capture_check_asks_about_the_callers_stream_of_the_device(rt):
    launcher = native.launcher(rt, NoNccl())
    ev = rt.take()
    assert launcher.follow(rt.current(DEV), 0x77, ev) & native.CAPTURED == 0
    rt._drv.answers["capturing"] = 1
    assert launcher.follow(rt.current(DEV), 0x77, ev) & native.CAPTURED
    assert rt._drv.calls[-3] == ("is_capturing", 0x5003)


def test_a_driver_error_names_the_step_and_the_error(rt):
    launcher = native.launcher(rt, NoNccl())
    ev = rt.take()
    rt._drv.answers["record"] = INVALID_HANDLE
    r = launcher.follow(rt.current(DEV), 0x77, ev)
    err = native.cuda_error(rt, r)
    assert isinstance(err, device.CudaDriverError)
    assert str(err) == ("following the caller's stream (cuEventRecord on it): CUDA driver error 400 "
                        "(CUDA_ERROR_INVALID_HANDLE)")
    assert [c[0] for c in rt._drv.calls[-2:]] == ["is_capturing", "record"]     # no wait after it
    rt._drv.answers["query"] = INVALID_HANDLE
    with pytest.raises(device.CudaDriverError, match="cuEventQuery"):
        rt.done(0x101)
