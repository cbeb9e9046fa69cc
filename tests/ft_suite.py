"""PyTorch's own fault-tolerance suite (``test_c10d_fault_tolerance.py``) with a class for hpct.

The suite is PyTorch's, unmodified, read from ``$HPCT_NCCL_SOURCES/pytorch/`` (the shared
sources folder, which .ci/run names; no registry serves PyTorch's tests, and it is never
copied here).  Its processes are spawned by torch's MultiProcessTestCase, which finds the
test class again by module and name: so the class lives here, in a plain module on the
tests' path, and test_fault_tolerance.py only collects it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

import hpct.distributed  # noqa: F401 -- registers the hpct backend in every spawned process
from hpct.ports import free_port_block

SUITE = "test_c10d_fault_tolerance.py"


def suite_folder() -> Path | None:
    """Where the suite lies: $HPCT_NCCL_SOURCES/pytorch, else ../shared/sources/pytorch."""
    here = Path(__file__).resolve().parents[1]
    for root in (os.environ.get("HPCT_NCCL_SOURCES"), here.parent / "shared" / "sources"):
        if root and (Path(root) / "pytorch" / SUITE).is_file():
            return Path(root) / "pytorch"
    return None


# The suite's three processes on one host; HPCT_PORT_BASE is chosen per test.
ENV = {"HPCT_HOSTS": "127.0.0.1", "N_PROC_PER_NODE": "3", "HPCT_CONNECT_TIMEOUT": "30"}
HAS_API = hasattr(dist, "_reconfigure")
FOLDER = suite_folder()
upstream = None
if HAS_API and FOLDER is not None:
    sys.path.insert(0, str(FOLDER))
    import test_c10d_fault_tolerance as upstream  # noqa: E402


if upstream is not None:
    _Base = upstream._make_fault_tolerance_test_class("hpct", "cpu")

    class HpctFaultToleranceTest(_Base):
        """torch's suite on the hpct backend: three processes on loopback, a port plan of their own."""

        def setUp(self):
            # Spawned processes inherit the environment: one fresh block of ports per test.
            self._saved = {k: os.environ.get(k) for k in ENV}
            os.environ.update(ENV, HPCT_PORT_BASE=str(free_port_block(8 * 3)))
            super().setUp()

        def tearDown(self):
            super().tearDown()
            for k, v in self._saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    HpctFaultToleranceTest.__name__ = HpctFaultToleranceTest.__qualname__ = "HpctFaultToleranceTest"
