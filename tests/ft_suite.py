"""PyTorch's own fault-tolerance suite (``test_c10d_fault_tolerance.py``) with a class for hpct.

The suite is PyTorch's, unmodified, read from ``$HPCT_NCCL_SOURCES/pytorch/`` (the shared
sources folder, which .ci/run names; no registry serves PyTorch's tests, and it is never
copied here).  Its processes are started by torch's MultiProcessTestCase (here from a fork
server, see ``_spawn_processes``), which finds the test class again by module and name: so the
class lives here, in a plain module on the tests' path, and test_fault_tolerance.py only
collects it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import hpct.distributed  # noqa: F401 -- registers the hpct backend in every spawned process

SUITE = "test_c10d_fault_tolerance.py"


def suite_folder() -> Path | None:
    """Where the suite lies: $HPCT_NCCL_SOURCES/pytorch, else ../shared/sources/pytorch."""
    here = Path(__file__).resolve().parents[1]
    for root in (os.environ.get("HPCT_NCCL_SOURCES"), here.parent / "shared" / "sources"):
        if root and (Path(root) / "pytorch" / SUITE).is_file():
            return Path(root) / "pytorch"
    return None


# None: the suite runs as a user's harness would, with no hpct variable (issue 41); the hpct
# variables of the caller's environment are kept out of the spawned processes.
ENV_UNSET = ("HPCT_HOSTS", "HPCT_HOSTFILE", "N_PROC_PER_NODE", "LOCAL_WORLD_SIZE", "HPCT_PORT_BASE",
             "HPCT_CONNECT_TIMEOUT")
HAS_API = hasattr(dist, "_reconfigure")
FOLDER = suite_folder()
upstream = None
if HAS_API and FOLDER is not None:
    sys.path.insert(0, str(FOLDER))
    import test_c10d_fault_tolerance as upstream  # noqa: E402


if upstream is not None:
    _Base = upstream._make_fault_tolerance_test_class("hpct", "cpu")

    class HpctFaultToleranceTest(_Base):
        """torch's suite on the hpct backend: three processes on loopback, no hpct variable."""

        def setUp(self):
            # Spawned processes inherit the environment: as a user's, with no hpct variable.
            self._saved = {k: os.environ.get(k) for k in ENV_UNSET}
            for k in ENV_UNSET:
                os.environ.pop(k, None)
            super().setUp()

        def _spawn_processes(self):
            # The harness spawns each rank: a fresh interpreter importing torch, about 4 CPU-s
            # for the CUDA build, three ranks per test, on a 2-core machine.  A fork server (a
            # clean process: not pytest's, which other tests left threads in) imports this
            # module once and forks every rank from there; the test bodies run unchanged.
            ctx = torch.multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload([__name__])
            self._start_processes(ctx.Process)

        def tearDown(self):
            super().tearDown()
            for k, v in self._saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    HpctFaultToleranceTest.__name__ = HpctFaultToleranceTest.__qualname__ = "HpctFaultToleranceTest"
