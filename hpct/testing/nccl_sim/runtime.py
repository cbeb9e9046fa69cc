"""The simulated CUDA runtime: the same methods as hpct.distributed.nccl.device.CudaRuntime.

A stream is a thread that runs what is enqueued on it, in order; an event completes when its
stream reaches its latest record (recording an event again makes it stand for the new point, as
CUDA's do).  The caller's current stream is the host itself (handle ``HOST``): what the caller did
is done, so an event recorded there has completed, and a wait of the host for an event blocks.
Tensors are CPU tensors; the device type the engine serves is "cpu".  Events are integer handles,
as the driver's are: the engine's native launch records them and makes streams wait through the
callbacks of ``addresses()`` (callbacks.py).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

import torch

from .breaches import breach
from .callbacks import CAPTURING, CUDA_ERROR_UNKNOWN, RECORD, SYNC, WAIT, Table

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


HOST = 0                                  # the caller's current stream: the host


class SimEvent:
    """``target``: its records so far; ``reached``: the newest record its stream has reached."""

    def __init__(self):
        self.captured = False
        self.target = 0
        self.reached = 0
        self._cv = threading.Condition()

    def arm(self, captured: bool) -> int:
        with self._cv:
            self.target += 1
            self.captured = captured
            return self.target

    def reach(self, k: int) -> None:
        with self._cv:
            self.reached = max(self.reached, k)
            self._cv.notify_all()

    def done(self) -> bool:
        return self.reached >= self.target

    def wait(self, seconds: float) -> bool:
        with self._cv:
            return self._cv.wait_for(self.done, seconds)


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

    def __init__(self):
        self.events: dict[int, SimEvent] = {}
        self._pool: list[int] = []
        self._ids = itertools.count(0xE000)
        self.on_capture_check: list = []   # tests: fn() run inside cuStreamIsCapturing (within a launch)
        self.capture_check_error = 0         # tests: cuStreamIsCapturing answers this CUDA error
        self._table = Table()
        for name, proto, fn in (("cuEventRecord", RECORD, self._record), ("cuStreamWaitEvent", WAIT, self._wait),
                                ("cuStreamIsCapturing", CAPTURING, self._capturing),
                                ("cuEventSynchronize", SYNC, self._sync)):
            self._table.add(name, proto, fn, CUDA_ERROR_UNKNOWN)

    def addresses(self) -> dict[str, int]:
        return dict(self._table.addresses)

    def driver_error(self, rc: int, what: str) -> RuntimeError:
        return RuntimeError(f"{what}: simulated CUDA driver error {rc}")

    def available(self) -> bool:
        return True

    def describe(self) -> str:
        return "simulated CUDA runtime (hpct/testing/nccl_sim)"

    def default_device(self) -> torch.device:
        return torch.device("cpu")

    def new_stream(self, dev):
        s = SimStream()
        return s, s.id

    def current(self, dev) -> int:
        return HOST

    @contextlib.contextmanager
    def on(self, dev, stream):
        yield

    def helper(self, dev) -> None:
        _helper.thread_local = True        # cuThreadExchangeStreamCaptureMode(THREAD_LOCAL)

    def enqueue(self, dev, stream: SimStream, fn) -> None:
        stream.put(fn)

    # ---- events: the driver's calls (callbacks of the native launch) and the engine's ------------
    def take(self) -> int:
        try:
            return self._pool.pop()
        except IndexError:
            h = next(self._ids)
            self.events[h] = SimEvent()
            return h

    def release(self, event: int) -> None:
        self._pool.append(event)

    def _event(self, handle: int, call: str) -> SimEvent:
        ev = self.events.get(handle)
        if ev is None:
            raise breach(f"{call} on an unknown event handle {handle:#x}")
        return ev

    def _record(self, event: int, stream: int) -> int:
        ev = self._event(event, "cuEventRecord")
        k = ev.arm(self._capturing_now())       # recorded into the caller's capture: the graph's event
        if stream == HOST:
            ev.reach(k)
        else:
            STREAMS[stream].put(lambda: ev.reach(k))
        return 0

    def _wait(self, stream: int, event: int, flags: int) -> int:
        ev = self._event(event, "cuStreamWaitEvent")
        if stream == HOST:                 # the caller's stream waits: a host wait, but not for a graph's event
            if not ev.captured:
                self.host_wait(event)
        elif not ev.done():
            target = ev.target
            STREAMS[stream].put(lambda: ev.wait(HANG_S) or breach("a stream waited for an event that "
                                                                   f"never reached record {target}"))
        return 0

    def _capturing(self, stream: int, out) -> int:
        for fn in list(self.on_capture_check):
            fn()
        if self.capture_check_error:
            return self.capture_check_error
        out[0] = 1 if stream == HOST and self._capturing_now() else 0
        return 0

    def _sync(self, event: int) -> int:
        self.host_wait(event)
        return 0

    @staticmethod
    def _capturing_now() -> bool:
        return threading.get_ident() in CAPTURES

    def done(self, event: int) -> bool:
        ev = self._event(event, "cudaEventQuery")
        _check_query(ev, "cudaEventQuery")
        return ev.done()

    def host_wait(self, event: int) -> None:
        ev = self._event(event, "cudaEventSynchronize")
        _check_query(ev, "cudaEventSynchronize")
        if not ev.wait(HANG_S):
            raise breach(f"a host wait on an event did not end within {HANG_S:g} s (a hang)")

    def future(self):
        return torch._C.Future([])

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
