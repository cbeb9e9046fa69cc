"""The CUDA runtime as the NCCL engine sees it: streams, events, the current device.

This is one of the engine's two outside worlds (the other is the NCCL library, nccl_lib.py);
the engine reaches the runtime only through this interface, so that a test double with the
same methods (tests/nccl_sim: CPU tensors, streams that are threads) runs the engine's own
code on a machine without a GPU.  The real one below is what a GPU run uses.

Semantics the engine relies on (CUDA's, and what the double reproduces):
- work enqueued on a stream runs in order after everything enqueued before it;
- ``follow(stream, dev)``: the stream runs what comes next only after the caller's current
  stream has finished what it has so far (an event, no host wait);
- an event recorded on a stream completes when the stream reaches it; ``done`` polls it,
  ``host_wait`` blocks the host (GIL released), ``stream_wait`` makes the caller's current
  stream wait (no host block);
- ``bind(dev, stream)`` makes them the calling thread's current device and stream for good;
- ``enqueue(dev, stream, fn)`` runs host code that launches device work (a copy, a stack)
  so that the work lands on ``stream`` in order; on a GPU that is ``fn()`` under the stream
  context, for the double it is ``fn`` run by the stream itself;
- work launched while the caller's stream is being captured into a CUDA graph must not be
  polled or waited for (``capturing``): querying an event of a capture breaks the capture.
"""

from __future__ import annotations

import contextlib

import torch


class CudaRuntime:
    """torch.cuda, narrowed to what the engine uses."""

    device_type = "cuda"

    def available(self) -> bool:
        return torch.cuda.is_available()

    def describe(self) -> str:
        return f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}"

    def default_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def new_stream(self, dev: torch.device):
        return torch.cuda.Stream(dev)

    def handle(self, stream) -> int:
        """The cudaStream_t NCCL takes."""
        return stream.cuda_stream

    def follow(self, stream, dev: torch.device) -> None:
        stream.wait_stream(torch.cuda.current_stream(dev))

    @contextlib.contextmanager
    def on(self, dev: torch.device, stream):
        """Device work launched inside lands on ``stream`` of ``dev``."""
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            yield

    def bind(self, dev: torch.device, stream) -> None:
        """Make ``dev`` and ``stream`` this thread's current device and stream for good (the
        completer's thread: what it records lands on the engine stream, without a context per op)."""
        torch.cuda.set_device(dev)
        torch.cuda.set_stream(stream)

    def enqueue(self, dev: torch.device, stream, fn) -> None:
        with self.on(dev, stream):
            fn()

    def record(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def done(self, event) -> bool:
        return event.query()

    def host_wait(self, event) -> None:
        event.synchronize()

    def stream_wait(self, dev: torch.device, event) -> None:
        torch.cuda.current_stream(dev).wait_event(event)

    def capturing(self, dev: torch.device) -> bool:
        if torch.cuda.current_device() == dev.index:
            return torch.cuda.is_current_stream_capturing()
        with torch.cuda.device(dev):
            return torch.cuda.is_current_stream_capturing()

    def future(self, dev: torch.device) -> torch.futures.Future:
        """A CUDA-aware future: set_result records events on the current streams, and a
        consumer's wait()/then() makes its own current stream wait on them."""
        return torch.futures.Future(devices=[dev])
