"""The simulated CUDA runtime: the same methods as hpct.distributed.nccl.device.CudaRuntime.

A stream is a thread that runs what is enqueued on it, in order; an event completes when its
stream reaches it.  The caller's current stream is the host itself: what the caller did is
done, so ``follow`` has nothing to wait for and ``stream_wait`` is a host wait.  Tensors are
CPU tensors; the device type the engine serves is "cpu".
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

import torch

from . import breach

HANG_S = 300.0            # a host wait longer than this is a hang in the test, not a slow op
IDLE_S = 1.0              # a stream's thread ends after this long with nothing to run
_ids = itertools.count(1)
STREAMS: dict[int, "SimStream"] = {}


class SimStream:
    """Runs enqueued callables in order on its own thread (started when there is work)."""

    def __init__(self):
        self.id = next(_ids)
        self._items: list = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []       # what a work item raised (a fault in the test, reported)
        STREAMS[self.id] = self

    def put(self, fn) -> None:
        with self._cv:
            self._items.append(fn)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=f"sim-stream-{self.id}")
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._items:
                    self._cv.wait(IDLE_S)
                if not self._items:           # idle: the thread ends, the next put starts one
                    self._thread = None
                    return
                fn = self._items.pop(0)
            try:
                fn()
            except Exception as err:   # noqa: BLE001 -- a stream never dies; the fault is kept
                self.errors.append(f"{type(err).__name__}: {err}")


class SimEvent:
    def __init__(self, captured: bool):
        self.captured = captured
        self._done = threading.Event()

    def complete(self) -> None:
        self._done.set()


def _check_query(event: SimEvent, call: str) -> None:
    """The capture rules of a host query (cudaEventQuery / cudaEventSynchronize)."""
    if event.captured:
        raise breach(f"{call} on an event recorded during a CUDA graph capture "
                     "(cudaErrorStreamCaptureUnsupported: the capture is invalidated)")
    me = threading.get_ident()
    others = [t for t, mode in list(CAPTURES.items()) if t != me and mode == "global"]
    if others and not getattr(_helper, "thread_local", False):
        raise breach(f"{call} from a thread in global capture mode while another thread captures a CUDA graph "
                     "in global mode: CUDA fails the call and invalidates that capture (helper threads must "
                     "use thread-local capture mode, as ProcessGroupNCCL's watchdog does)")


class SimRuntime:
    """The engine's view of a device, simulated on the CPU."""

    device_type = "cpu"

    def available(self) -> bool:
        return True

    def describe(self) -> str:
        return "simulated CUDA runtime (tests/nccl_sim)"

    def default_device(self) -> torch.device:
        return torch.device("cpu")

    def new_stream(self, dev):
        s = SimStream()
        return s, s.id

    def follow(self, stream: int, dev) -> None:
        pass                               # the caller's work so far is done: it ran on the host

    @contextlib.contextmanager
    def on(self, dev, stream):
        yield

    def helper(self, dev) -> None:
        _helper.thread_local = True        # cuThreadExchangeStreamCaptureMode(THREAD_LOCAL)

    def enqueue(self, dev, stream: SimStream, fn) -> None:
        stream.put(fn)

    def record(self, stream: int) -> SimEvent:
        ev = SimEvent(self.capturing(None))
        STREAMS[stream].put(ev.complete)
        return ev

    def release(self, event: SimEvent) -> None:
        pass

    def done(self, event: SimEvent) -> bool:
        _check_query(event, "cudaEventQuery")
        return event._done.is_set()

    def host_wait(self, event: SimEvent) -> None:
        _check_query(event, "cudaEventSynchronize")
        if not event._done.wait(HANG_S):
            raise breach(f"a host wait on an event did not end within {HANG_S:g} s (a hang)")

    def stream_wait(self, dev, event: SimEvent) -> None:
        if not event.captured:
            self.host_wait(event)

    def capturing(self, dev) -> bool:
        return threading.get_ident() in CAPTURES

    def future(self) -> torch.futures.Future:
        return torch.futures.Future()

    def capability(self, dev) -> tuple[int, int]:
        return CAPABILITY


CAPABILITY = (9, 0)                       # the simulated device's compute capability (tests change it)
CAPTURES: dict[int, str] = {}            # capturing thread -> its capture mode
_helper = threading.local()


@contextlib.contextmanager
def capture(mode: str = "global"):
    """Ops issued inside are launched as if into a CUDA graph capture on this thread, in
    ``mode`` (torch.cuda.graph's default is global)."""
    CAPTURES[threading.get_ident()] = mode
    try:
        yield
    finally:
        CAPTURES.pop(threading.get_ident(), None)


def drain(seconds: float = 10.0) -> None:
    """Wait until every stream has run what it was given (tests' teardown)."""
    end = time.monotonic() + seconds
    for s in list(STREAMS.values()):
        while s._items and time.monotonic() < end:
            time.sleep(0.005)
