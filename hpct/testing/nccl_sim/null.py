"""A NCCL library and a CUDA runtime that do nothing, instantly: the engine's own path alone.

The functions the native launch calls are C functions that return at once (null.c, compiled here
once per source into the temp folder with the system's C compiler), so what a benchmark times is
hpct's code: its Python and its native launch.  What it proves: what the engine's code costs per op
and that its threads end cleanly (no data moves).  benchmarks/engine_path.py times ops over it,
tests/test_nccl_exit.py exits a process in the middle of a burst of completions, and
tests/test_nccl_native.py holds a launch inside C to show it runs without the GIL.

``NullRuntime(pending=True)``: an event is reported not ended the first time it is asked, so a
future asked for goes through the completer (its native wait is null.c's) instead of being
settled at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from hpct.distributed.nccl import library as nccl_lib

SOURCE = Path(__file__).with_name("null.c")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """null.c compiled and loaded (once per process; the build is kept per source hash)."""
    global _lib
    with _lock:
        if _lib is None:
            text = SOURCE.read_bytes()
            out = Path(tempfile.gettempdir()) / f"hpct-nccl-null-{hashlib.sha256(text).hexdigest()[:16]}.so"
            if not out.exists():
                tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
                subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE)], check=True,
                               capture_output=True, timeout=120)
                os.replace(tmp, out)
            _lib = ctypes.CDLL(str(out))
    return _lib


def address(name: str) -> int:
    return ctypes.cast(getattr(library(), name), ctypes.c_void_p).value


def flag(name: str) -> ctypes.c_int:
    """One of null.c's control variables (hold_group_end, null_release, null_held_out,
    null_group_end_result)."""
    return ctypes.c_int.in_dll(library(), name)


def calls() -> int:
    return ctypes.c_long.in_dll(library(), "null_calls").value


class NullRuntime:
    device_type = "cpu"

    def __init__(self, pending: bool = False):
        self.pending = pending
        self._asked: set[int] = set()
        self._next = 0x1000
        self._pool: list[int] = []

    def available(self): return True
    def describe(self): return "null runtime"
    def default_device(self): return torch.device("cpu")
    def new_stream(self, dev): return object(), 0x77
    def current(self, dev): return 0

    def addresses(self):
        return {"cuEventRecord": address("null_record"), "cuStreamWaitEvent": address("null_wait"),
                "cuStreamIsCapturing": address("null_capturing"), "cuEventSynchronize": address("null_sync")}

    def driver_error(self, rc, what): return RuntimeError(f"{what}: null CUDA error {rc}")

    @contextlib.contextmanager
    def on(self, dev, stream): yield

    def helper(self, dev): pass
    def enqueue(self, dev, stream, fn): fn()

    def take(self):
        try:
            return self._pool.pop()
        except IndexError:
            self._next += 1
            return self._next

    def release(self, event):
        self._asked.discard(event)
        self._pool.append(event)

    def done(self, event):
        if self.pending and event not in self._asked:
            self._asked.add(event)
            return False
        return True

    def host_wait(self, event): pass
    def future(self): return torch._C.Future([])
    def capability(self, dev): return (9, 0)


class NullNccl:
    version = 23007
    has_rootless = has_raise_abort = True
    init_what = staticmethod(nccl_lib.NcclLibrary.init_what)

    def __init__(self, group_end_result: int = nccl_lib.SUCCESS):
        flag("null_group_end_result").value = group_end_result     # null.c's, for the process

    def addresses(self):
        names = {"ncclGroupStart": "null_group_start", "ncclGroupEnd": "null_group_end",
                 "ncclAllReduce": "null_coll", "ncclBroadcast": "null_coll", "ncclReduceScatter": "null_coll",
                 "ncclReduce": "null_rooted", "ncclAllGather": "null_gather", "ncclSend": "null_p2p",
                 "ncclRecv": "null_p2p"}
        return {k: address(v) for k, v in names.items()}

    def require_rootless(self): pass
    def error(self, code, what, comm=None): return nccl_lib.NcclError(f"{what}: {code}")
    def check(self, code, what, comm=None, *, allow_in_progress=False): return code

    def init_rootless(self, box, n, rank, spec, *, blocking):
        box.value = 1
        return nccl_lib.SUCCESS

    def async_error(self, comm): return nccl_lib.SUCCESS
    def abort(self, comm): return 0
    def destroy(self, comm): return 0
    def raise_abort(self, comm): return 0
