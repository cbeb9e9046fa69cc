"""The engine's native half (``hpct._gloo``: Launcher, AbortFlag, Completer) wired to its two outside worlds.

One launch per op is one call into the extension, which runs with the GIL released: the capture
check of the caller's stream, the engine stream following it through a pooled event, the NCCL
group (start, the calls, end) with the comm's abort flag honoured, and the op's end events
(src/gloo_ext/launch.cpp).  The extension links neither torch nor CUDA nor NCCL: the functions it
calls are addresses, resolved once per engine from the runtime (``runtime.addresses()``) and the
library (``lib.addresses()``).  The real ones are libcuda's and libnccl's (ctypes); the simulated
ones of the nccl_sim tier are callbacks into the test doubles, so CI runs this same native code.

The launch answers one integer: ``OK`` (NCCL took the group, the end events are recorded, the
caller's stream is not captured) or a combination of the bits below, decoded by launch.py.
"""

from __future__ import annotations

from hpct import _gloo

from .library import OP_FUNCTIONS

RESULT_MASK = _gloo.LAUNCH_RESULT_MASK
REFUSED = _gloo.LAUNCH_REFUSED            # an op's own call answered ncclInvalidArgument
CAPTURED = _gloo.LAUNCH_CAPTURED          # the caller's stream is being captured into a CUDA graph
FLAG_BEFORE = _gloo.LAUNCH_FLAG_BEFORE    # the comm's abort flag was up before the group: nothing called
FLAG_DURING = _gloo.LAUNCH_FLAG_DURING    # the flag went up while NCCL had the group (a held call ended)
RECORDED = _gloo.LAUNCH_RECORDED          # the end events were recorded after NCCL answered
OK = RECORDED
CUDA_SHIFT, STEP_SHIFT = _gloo.LAUNCH_CUDA_SHIFT, _gloo.LAUNCH_STEP_SHIFT
STEP_END_RECORD = 4
STEPS = {1: "the capture check of the caller's stream (cuStreamIsCapturing)",
         2: "following the caller's stream (cuEventRecord on it)",
         3: "following the caller's stream (cuStreamWaitEvent)",
         STEP_END_RECORD: "recording the op's end event (cuEventRecord)"}

# The CUDA driver functions the extension calls, and NCCL's group calls, in its argument order.
CUDA_FUNCTIONS = ("cuEventRecord", "cuStreamWaitEvent", "cuStreamIsCapturing")
SYNC_FUNCTION = "cuEventSynchronize"
GROUP_FUNCTIONS = ("ncclGroupStart", "ncclGroupEnd")
# An op's call name -> the kind of its NCCL function's signature (launch.cpp's Kind).
KINDS = {"all_reduce": _gloo.CALL_COLL, "broadcast": _gloo.CALL_COLL, "reduce_scatter": _gloo.CALL_COLL,
         "reduce": _gloo.CALL_ROOTED, "all_gather": _gloo.CALL_GATHER, "send": _gloo.CALL_P2P,
         "recv": _gloo.CALL_P2P}

AbortFlag = _gloo.AbortFlag


def _addresses(table: dict, names, where: str) -> tuple:
    missing = [n for n in names if not table.get(n)]
    if missing:
        raise RuntimeError(f"hpct NCCL: {where} gave no address for {', '.join(missing)}")
    return tuple(int(table[n]) for n in names)


def launcher(runtime, lib) -> "_gloo.Launcher":
    """The engine's Launcher over ``runtime``'s and ``lib``'s functions (resolved here, once)."""
    return _gloo.Launcher(_addresses(runtime.addresses(), CUDA_FUNCTIONS, "the CUDA runtime"),
                          _addresses(lib.addresses(), GROUP_FUNCTIONS, "the NCCL library"))


def call_prefixes(lib) -> dict:
    """An op's call name -> (kind, function address): an op's call is that plus its arguments."""
    table = lib.addresses()
    names = [OP_FUNCTIONS[name] for name in KINDS]
    return {name: (KINDS[name], addr) for name, addr in zip(KINDS, _addresses(table, names, "the NCCL library"))}


def completer(runtime) -> "_gloo.Completer":
    return _gloo.Completer(_addresses(runtime.addresses(), (SYNC_FUNCTION,), "the CUDA runtime")[0])


def cuda_step(result: int) -> int:
    """Which step a CUDA driver error of a launch came from (0: none)."""
    return (result >> STEP_SHIFT) & 0xF if result >> CUDA_SHIFT else 0


def cuda_error(runtime, result: int):
    """The CudaDriverError of a launch's CUDA failure, naming the step and the driver's error."""
    rc = (result >> CUDA_SHIFT) & 0xFFFF
    return runtime.driver_error(rc, STEPS.get(cuda_step(result), "a CUDA call of the launch"))
