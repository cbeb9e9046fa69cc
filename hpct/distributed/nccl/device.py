"""The CUDA runtime as the NCCL engine sees it: raw stream handles, pooled driver events, capture mode.

This is one of the engine's two outside worlds (the other is the NCCL library, library.py);
the engine reaches the runtime only through this interface, so that a test double with the
same methods (hpct/testing/nccl_sim: CPU tensors, streams that are threads) runs the engine's own
code on a machine without a GPU.  The real one below is what a GPU run uses.

Semantics the engine relies on (CUDA's, and what the double reproduces):
- work enqueued on a stream runs in order after everything enqueued before it, so the end
  events of the ops of one engine stream complete in launch order;
- ``addresses()``: the driver functions the native launch calls (native.py): it makes the
  engine stream follow the caller's current stream (``current(dev)``) through a pooled event
  (a record there, a wait here: no host wait), checks whether that stream is being captured,
  records each op's end event, and makes the caller's stream wait for one (``Work.wait``);
  the completer waits for events with ``cuEventSynchronize``;
- ``take()`` gives a pooled event; ``done`` polls it, ``host_wait`` blocks the host with the
  GIL released, ``release`` gives it back once nobody will ask about it again;
- ``helper(dev)``: a helper thread (watchdog, completer) makes ``dev`` current and puts
  itself into thread-local stream-capture mode, as ProcessGroupNCCL's watchdog does: in the
  default (global) mode a query from any thread while another thread captures a CUDA graph
  fails and invalidates that capture;
- ``enqueue(dev, stream, fn)`` runs host code that launches device work (a copy, a stack) so
  that the work lands on ``stream`` in order;
- work launched while the caller's stream is being captured must not be polled or waited
  for by the host: its events belong to the graph.

Why driver calls (native, or through ctypes) and not torch.cuda objects: on an H200 host, per small op,
``torch.cuda.current_stream()`` cost 5.5-7.2 us (0.11 us for the raw handle), a new
``torch.cuda.Event`` per ``wait_stream`` 7.1 us, ``with device, stream`` 12.7-15.2 us; the
same group driven through a pool of driver events cost 7.9-8.5 us against 26.4 us.
"""

from __future__ import annotations

import contextlib
import ctypes

import torch

CU_EVENT_DISABLE_TIMING = 0x2
CUDA_ERROR_NOT_READY = 600
CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
POOL_MAX = 4096            # idle events kept for reuse; more are destroyed


class CudaDriverError(RuntimeError):
    """A CUDA driver call the engine made returned an error."""


class Driver:
    """The few libcuda functions the engine calls (libcuda is mapped once torch has a context)."""

    def __init__(self, name: str = "libcuda.so.1"):
        self._dll = ctypes.CDLL(name)
        v, p, u = ctypes.c_void_p, ctypes.POINTER, ctypes.c_uint
        table = {"cuEventCreate": [p(v), u], "cuEventDestroy_v2": [v], "cuEventRecord": [v, v],
                 "cuEventQuery": [v], "cuEventSynchronize": [v], "cuStreamWaitEvent": [v, v, u],
                 "cuStreamIsCapturing": [v, p(ctypes.c_int)],
                 "cuThreadExchangeStreamCaptureMode": [p(ctypes.c_int)], "cuGetErrorName": [ctypes.c_int, p(ctypes.c_char_p)]}
        for name_, args in table.items():
            fn = getattr(self._dll, name_)
            fn.restype, fn.argtypes = ctypes.c_int, args
            setattr(self, name_, fn)

    def error(self, rc: int, what: str) -> CudaDriverError:
        text = ctypes.c_char_p()
        self.cuGetErrorName(rc, ctypes.byref(text))
        return CudaDriverError(f"{what}: CUDA driver error {rc} ({(text.value or b'?').decode()})")

    def check(self, rc: int, what: str) -> None:
        if rc:
            raise self.error(rc, what)


class CudaRuntime:
    """The real runtime: torch for streams and devices, libcuda for events and waits.

    The pool is a plain list: ``pop`` and ``append`` are atomic under the GIL, so no lock is
    taken per op; the driver's functions are bound once (``_bind``), checked inline."""

    device_type = "cuda"

    def __init__(self):
        self._drv: Driver | None = None
        self._pool: list[int] = []

    @property
    def drv(self) -> Driver:
        if self._drv is None:
            self._bind()
        return self._drv

    def _bind(self) -> None:
        torch.cuda.init()                     # libcuda is mapped and the primary context exists
        d = self._drv = Driver()
        self._query_fn = d.cuEventQuery
        self._raw = torch._C._cuda_getCurrentRawStream

    def addresses(self) -> dict[str, int]:
        """The driver functions the native launch and the completer call (native.py)."""
        d = self.drv
        return {name: ctypes.cast(getattr(d, name), ctypes.c_void_p).value
                for name in ("cuEventRecord", "cuStreamWaitEvent", "cuStreamIsCapturing", "cuEventSynchronize")}

    def driver_error(self, rc: int, what: str) -> CudaDriverError:
        return self.drv.error(rc, what)

    def available(self) -> bool:
        return torch.cuda.is_available()

    def describe(self) -> str:
        return f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}"

    def default_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def new_stream(self, dev: torch.device):
        """(the stream object, which keeps it alive; its cudaStream_t)."""
        self.drv
        s = torch.cuda.Stream(dev)
        return s, s.cuda_stream

    def current(self, dev: torch.device) -> int:
        """The caller's current stream of ``dev`` (its cudaStream_t)."""
        return self._raw(dev.index)

    # ---- events ------------------------------------------------------------------------------
    def take(self) -> int:
        """An idle event (from the pool, else a new one)."""
        try:
            return self._pool.pop()
        except IndexError:
            ev = ctypes.c_void_p()
            self.drv.check(self.drv.cuEventCreate(ctypes.byref(ev), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            return ev.value

    def release(self, ev: int) -> None:
        """The event is idle (completed, or never to be asked about again): back to the pool."""
        if len(self._pool) < POOL_MAX:
            self._pool.append(ev)
        else:
            self.drv.cuEventDestroy_v2(ev)

    def done(self, ev: int) -> bool:
        rc = self._query_fn(ev)
        if rc == 0:
            return True
        if rc == CUDA_ERROR_NOT_READY:
            return False
        self.drv.check(rc, "cuEventQuery")
        return True

    def host_wait(self, ev: int) -> None:
        self.drv.check(self.drv.cuEventSynchronize(ev), "cuEventSynchronize")     # ctypes drops the GIL

    # ---- threads and host code on a stream -------------------------------------------------------
    def helper(self, dev: torch.device) -> None:
        """Called first on a helper thread: ``dev`` current, thread-local capture mode."""
        torch.cuda.set_device(dev)
        mode = ctypes.c_int(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        self.drv.check(self.drv.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)),
                       "cuThreadExchangeStreamCaptureMode")

    @contextlib.contextmanager
    def on(self, dev: torch.device, stream):
        """Device work launched inside lands on ``stream`` (the object) of ``dev``."""
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            yield

    def enqueue(self, dev: torch.device, stream, fn) -> None:
        with self.on(dev, stream):
            fn()

    def future(self):
        """A plain future (torch's C++ one, as ProcessGroupNCCL's Work hands out): the engine
        completes it only once the op's GPU work has ended, so a consumer needs no stream wait
        (a CUDA-aware one cost 25-35 us per op to complete)."""
        return torch._C.Future([])

    def capability(self, dev: torch.device) -> tuple[int, int]:
        return torch.cuda.get_device_capability(dev)
