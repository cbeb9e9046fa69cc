"""A test double of NCCL and of the CUDA runtime, for the NCCL engine's simulation tier (-m nccl_sim).

The NCCL engine (hpct/distributed/nccl/engine.py and its parts) talks to two worlds it does
not own: the NCCL library and the CUDA runtime.  This package is a simulated pair of them for
CPU tensors, so that CI runs the engine's own code -- futures, locking, lifecycle, error paths,
DDP, recovery -- on a machine without a GPU:

- runtime.py: streams are threads that run what is enqueued on them in order, events complete
  when their stream reaches them, the caller's "current stream" is the host;
- library.py: NCCL's documented semantics on raw pointers: non-blocking communicators whose
  init and ncclGroupEnd answer ncclInProgress, ncclCommGetAsyncError, ncclCommAbort from any
  thread that ends a stuck launch or a hung kernel, thread-local ncclGroupStart/End, a peer
  that vanishes (its socket resets: an asynchronous error, the kernel hangs until the abort),
  faults on demand (a launch or an op that never completes, an async error);
- bootstrap.py: the rootless ring (listen on this rank's address, connect to the next, pass
  the addresses round) as the patched NCCL forms it; data then moves over hpct's own
  storeless Gloo context on the same port.

The library enforces the rules the engine must keep and fails loudly on a breach
(``SimBreach``, recorded in ``BREACHES`` and fatal at exit): no two calls on one comm at once
(what the engine's per-comm lock guarantees), no call after ncclCommAbort or ncclCommDestroy,
abort allowed from any thread and once, no abort after a revoke that left a group job
dangling, no event query of a captured op, no partial group.

What it proves: the engine's logic.  What only a GPU proves: NCCL itself on real streams
(kernels, their ordering against torch's caching allocator, CUDA graph capture), bandwidth and
latency (docs/gpu.md).

``install()`` is the test-only switch: groups made after it route their CPU tensors to the
NCCL engine over this pair (hpct.distributed.membership.world.ENGINES_OVERRIDE).
"""

from __future__ import annotations

import atexit
import os

from .breaches import BREACHES, SimBreach, breach

__all__ = ["BREACHES", "SimBreach", "breach", "install"]


def install(**faults) -> None:
    """Route the CPU tensors of every hpct group made from now on to the NCCL engine over the
    simulated library and runtime (the test-only switch).  ``faults`` go to SimNccl."""
    from hpct.distributed.membership import world
    from hpct.distributed.nccl.plan import engine_for_group

    from .library import SimNccl
    from .runtime import SimRuntime
    lib, runtime = SimNccl(**faults), SimRuntime()

    def factory(cfg, **facts):
        return engine_for_group(cfg, runtime=runtime, load=lambda: lib, **facts)
    world.ENGINES_OVERRIDE = [("cpu", factory)]
    report = os.environ.get("SIM_NCCL_REPORT")
    if report:
        atexit.register(_write_report, lib, report)


def _write_report(lib, folder: str) -> None:
    """What this process did through the simulated NCCL (a test checks the route was taken)."""
    import json
    comms = list(lib.comms.values())
    data = {"pid": os.getpid(), "comms": len(comms), "generations": sorted({c.spec.generation for c in comms}),
            "groups": sum(len(c.groups) for c in comms),
            "calls": sorted({name for c in comms for g in c.groups for name in g}), "breaches": list(BREACHES)}
    path = os.path.join(folder, f"sim-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)
