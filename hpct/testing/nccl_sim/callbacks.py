"""The simulated NCCL and runtime as C function pointers: what the engine's native launch calls.

The native launch (hpct._gloo.Launcher, src/gloo_ext/launch.cpp) calls libcuda's and libnccl's
functions through addresses resolved once.  Here each address is a ctypes callback into a Python
method of the double, so the nccl_sim tier drives the very native code a GPU run uses.  A callback
runs on the thread that called it (its thread-locals: NCCL's group, the capture mode) and takes the
GIL itself, which the native launch has released.

A callback never lets an exception escape into C (ctypes would print it and answer 0, a success):
it answers ``error`` instead, and a breach is recorded as every breach is (``nccl_sim.BREACHES``).
"""

from __future__ import annotations

import ctypes
import sys
import traceback

_I, _U64, _SZ = ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t
# Pointers and handles travel as 64-bit integers (a c_void_p argument of 0 would arrive as None).
GROUP = ctypes.CFUNCTYPE(_I)
COLL = ctypes.CFUNCTYPE(_I, _U64, _U64, _SZ, _I, _I, _U64, _U64)           # all_reduce, broadcast, reduce_scatter
ROOTED = ctypes.CFUNCTYPE(_I, _U64, _U64, _SZ, _I, _I, _I, _U64, _U64)     # reduce
GATHER = ctypes.CFUNCTYPE(_I, _U64, _U64, _SZ, _I, _U64, _U64)             # all_gather
P2P = ctypes.CFUNCTYPE(_I, _U64, _SZ, _I, _I, _U64, _U64)                  # send, recv
RECORD = ctypes.CFUNCTYPE(_I, _U64, _U64)                                  # cuEventRecord(event, stream)
WAIT = ctypes.CFUNCTYPE(_I, _U64, _U64, ctypes.c_uint)                     # cuStreamWaitEvent(stream, event, flags)
CAPTURING = ctypes.CFUNCTYPE(_I, _U64, ctypes.POINTER(_I))                 # cuStreamIsCapturing(stream, &status)
SYNC = ctypes.CFUNCTYPE(_I, _U64)                                          # cuEventSynchronize(event)

NCCL_INTERNAL_ERROR = 3
CUDA_ERROR_UNKNOWN = 999


class Table:
    """Callbacks kept alive with their owner; ``addresses`` is what the engine resolves."""

    def __init__(self):
        self._keep: list = []
        self.addresses: dict[str, int] = {}

    def add(self, name: str, proto, fn, error: int) -> None:
        def safe(*args):
            try:
                return fn(*args)
            except BaseException:   # noqa: BLE001 -- never into C; a breach is already recorded
                print(f"NCCL SIM: {name} raised:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
                return error
        cb = proto(safe)
        self._keep.append(cb)
        self.addresses[name] = ctypes.cast(cb, ctypes.c_void_p).value
