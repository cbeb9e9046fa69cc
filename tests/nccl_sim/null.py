"""A NCCL library and a CUDA runtime that do nothing, instantly: the engine's own Python path alone.

What it proves: what the engine's code costs per op and that its threads end cleanly (no data
moves, every event has completed when asked).  benchmarks/engine_path.py times ops over it and
tests/test_nccl_exit.py exits a process in the middle of a burst of completions.
"""

from __future__ import annotations

import contextlib

import torch

from hpct.distributed.nccl import library as nccl_lib


class NullRuntime:
    device_type = "cpu"

    def available(self): return True
    def describe(self): return "null runtime"
    def default_device(self): return torch.device("cpu")
    def new_stream(self, dev): return object(), 0
    def follow(self, stream, dev): pass

    @contextlib.contextmanager
    def on(self, dev, stream): yield

    def helper(self, dev): pass
    def enqueue(self, dev, stream, fn): fn()
    def record(self, stream): return 1
    def release(self, event): pass
    def done(self, event): return True
    def host_wait(self, event): pass
    def stream_wait(self, dev, event): pass
    def capturing(self, dev): return False
    def future(self): return torch.futures.Future()
    def capability(self, dev): return (9, 0)


def _ok(*args):
    return 0


class NullNccl:
    version = 23007
    has_rootless = has_raise_abort = True
    init_what = staticmethod(nccl_lib.NcclLibrary.init_what)

    def __init__(self, group_end_result: int = nccl_lib.SUCCESS):
        self._end = group_end_result

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
    def group_start(self): return 0
    def group_end(self): return self._end
    def fn(self, name): return _ok
