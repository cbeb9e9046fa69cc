"""The real CUDA runtime of the NCCL engine (hpct/distributed/nccl/device.py) over a stand-in libcuda.

What this proves: the runtime's own logic -- which driver call each method makes with which
handles, the event pool (an event goes back after a follow, after a Work is dropped; beyond the
cap it is destroyed), that the caller's stream is the current one of the tensor's device, and
that a driver error becomes one CudaDriverError naming the call and the error.  What only a GPU
proves: that libcuda behaves as stood in for here (the GPU proof runs this runtime, docs/gpu.md).
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from hpct.distributed.nccl import device

pytestmark = pytest.mark.unit
NOT_READY, INVALID_HANDLE = device.CUDA_ERROR_NOT_READY, 400


class StubDriver:
    """libcuda's calls the runtime makes, recorded; results come from ``answers``."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.answers: dict[str, int] = {}
        self._next = 0x100

    def _ret(self, name, *args):
        self.calls.append((name, *args))
        return self.answers.get(name, 0)

    def cuEventCreate(self, out, flags):
        self._next += 1
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = self._next
        return self._ret("create", flags)

    def cuEventRecord(self, ev, stream): return self._ret("record", ev, stream)
    def cuStreamWaitEvent(self, stream, ev, flags): return self._ret("wait", stream, ev)
    def cuEventQuery(self, ev): return self._ret("query", ev)
    def cuEventSynchronize(self, ev): return self._ret("sync", ev)
    def cuEventDestroy_v2(self, ev): return self._ret("destroy", ev)

    def cuStreamIsCapturing(self, stream, out):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = self.answers.get("capturing", 0)
        return self._ret("is_capturing", stream)

    def cuGetErrorName(self, rc, out):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_char_p))[0] = b"CUDA_ERROR_INVALID_HANDLE"
        return 0

    check = device.Driver.check


@pytest.fixture
def rt():
    r = device.CudaRuntime()
    d = r._drv = StubDriver()
    r._record_fn, r._wait_fn, r._query_fn = d.cuEventRecord, d.cuStreamWaitEvent, d.cuEventQuery
    r._capturing_fn = d.cuStreamIsCapturing
    r._raw = lambda index: 0x5000 + index          # the caller's current stream of device ``index``
    return r


DEV = torch.device("cuda", 3)


def test_follow_records_on_the_callers_stream_of_the_tensors_device_and_returns_the_event(rt):
    rt.follow(0x77, DEV)
    (create,), rest = rt._drv.calls[:1], rt._drv.calls[1:]
    ev = rt._pool[-1]
    assert rest == [("record", ev, 0x5003), ("wait", 0x77, ev)] and create[0] == "create"
    rt.follow(0x77, DEV)                          # the same event again: no new one is created
    assert [c[0] for c in rt._drv.calls].count("create") == 1 and rt._pool == [ev]


def test_an_end_event_is_pooled_only_when_released_and_destroyed_beyond_the_cap(rt, monkeypatch):
    ev = rt.record(0x77)
    assert rt._drv.calls[-1] == ("record", ev, 0x77) and rt._pool == []
    rt._drv.answers["query"] = NOT_READY
    assert rt.done(ev) is False
    rt._drv.answers["query"] = 0
    assert rt.done(ev) is True
    monkeypatch.setattr(device, "POOL_MAX", 1)
    rt.release(ev)
    other = rt.record(0x77)                       # taken from the pool
    assert other == ev and rt._pool == []
    third = rt.record(0x77)
    rt.release(other)
    rt.release(third)                             # over the cap: destroyed
    assert rt._pool == [ev] and rt._drv.calls[-1] == ("destroy", third)


def test_capturing_asks_about_the_callers_stream_of_the_device(rt):
    assert rt.capturing(DEV) is False and rt._drv.calls[-1] == ("is_capturing", 0x5003)
    rt._drv.answers["capturing"] = 1
    assert rt.capturing(DEV) is True


def test_a_driver_error_names_the_call_and_the_error(rt):
    rt._drv.answers["record"] = INVALID_HANDLE
    with pytest.raises(device.CudaDriverError, match=r"cuEventRecord: CUDA driver error 400 \(CUDA_ERROR_INVALID_HANDLE\)"):
        rt.record(0x77)
    with pytest.raises(device.CudaDriverError, match=r"following the caller's stream .*error 400"):
        rt.follow(0x77, DEV)
    rt._drv.answers["query"] = INVALID_HANDLE
    with pytest.raises(device.CudaDriverError, match="cuEventQuery"):
        rt.done(0x101)
    rt._drv.answers["wait"] = INVALID_HANDLE
    with pytest.raises(device.CudaDriverError, match="cuStreamWaitEvent"):
        rt.stream_wait(DEV, 0x101)
