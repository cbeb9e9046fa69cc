"""Run chosen tests of PyTorch's own distributed suites against one backend (tests/test_torch_suites.py).

    python torch_suite_worker.py SUITE BACKEND OUT_JSON TEST [TEST ...]

SUITE "generic": ``DistributedTest._DistTestBase`` from the torch wheel
(torch.testing._internal.distributed.distributed_test), world size 2, file:// init.
SUITE "c10d_gloo": ``ProcessGroupGlooTest`` from PyTorch 2.6.0's test/distributed/test_c10d_gloo.py,
whose folder is TORCH_C10D_TEST_DIR (the pinned, patched source tree); "c10d_gloo:CLASS,CLASS...",
those classes of that file, each at its own world size, their tests named CLASS.test
(tests/test_patched_torch.py runs the whole file so on torch 2.6.0, stock and patched).

BACKEND "gloo" runs the suite as PyTorch ships it, on whichever torch runs this script.  BACKEND "hpct" runs the same test bodies on
the hpct backend: the suites gate most tests on ``BACKEND == "gloo"`` and create their groups with
``backend="gloo"``, so the module is imported as for gloo and every group that the test asks to be
a gloo group is created as an hpct group instead (init_process_group, new_group, the direct
ProcessGroupGloo constructor of test_c10d_gloo.py).  The ranks are forked (the harness spawns
them, which costs an interpreter start per rank and test); every test is bounded by
DISTRIBUTED_TESTS_DEFAULT_TIMEOUT.

OUT_JSON gets {test: {"status": pass|fail|error|skip, "detail": text}}; OUT_JSON.meta.json says which
torch ran it and whose ProcessGroupGloo class it had.
"""

from __future__ import annotations

import json
import os
import sys
import time
import unittest

SUITE, BACKEND, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
NAMES = sys.argv[4:]           # or ALL
WORLD_SIZE = 2

os.environ["BACKEND"] = "gloo"          # the module's gates and test bodies take the gloo paths
os.environ["WORLD_SIZE"] = str(WORLD_SIZE)
os.environ.setdefault("N_PROC_PER_NODE", str(WORLD_SIZE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed import distributed_c10d as c10d  # noqa: E402

if BACKEND == "hpct":
    import hpct.distributed  # noqa: F401,E402  registers the backend (inherited by the forked ranks)

    _init = dist.init_process_group
    _new_group = c10d.new_group

    def _as_hpct(backend):
        if backend is None or str(backend).lower() == "gloo":
            return "hpct"
        return backend

    def init_process_group(backend=None, *args, **kwargs):
        return _init(_as_hpct(backend), *args, **kwargs)

    def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        return _new_group(ranks, timeout, _as_hpct(backend), *args, **kwargs)

    for mod in (dist, c10d):
        mod.init_process_group = init_process_group
        mod.new_group = new_group


def _fork(self) -> None:
    self._start_processes(torch.multiprocessing.get_context("fork").Process)


def generic_case():
    os.environ.setdefault("TEMP_DIR", "/tmp")      # read at import; each test makes its own
    from torch.testing._internal.distributed import distributed_test as dt

    class Generic(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            _fork(self)

    return Generic


def c10d_gloo_case():
    sys.path.insert(0, os.environ["TORCH_C10D_TEST_DIR"])
    import test_c10d_gloo as tg

    class C10dGloo(tg.ProcessGroupGlooTest):
        def setUp(self):
            super(tg.ProcessGroupGlooTest, self).setUp()
            _fork(self)

        @property
        def world_size(self):
            return WORLD_SIZE

        if BACKEND == "hpct":
            def _create_process_group_gloo(self, store, rank, world_size, opts):
                # A hpct group in place of ProcessGroupGloo(store, ...): the suite's own
                # timeout, no store traffic (the FileStore stays unused).
                dist.init_process_group("hpct", store=store, rank=self.rank, world_size=self.world_size,
                                        timeout=opts._timeout)
                pg = c10d._get_default_group()
                dist.barrier(group=pg)
                return pg

    return C10dGloo


def c10d_gloo_class_case(name: str):
    sys.path.insert(0, os.environ["TORCH_C10D_TEST_DIR"])
    import test_c10d_gloo as tg
    from torch.testing._internal.common_distributed import MultiProcessTestCase
    base = getattr(tg, name)
    if not issubclass(base, MultiProcessTestCase):
        return base

    class Forked(base):
        def setUp(self):
            MultiProcessTestCase.setUp(self)
            _fork(self)

    Forked.__name__ = Forked.__qualname__ = name
    return Forked


def meta() -> dict:
    ext = getattr(torch, "_hpct_c10d", None)
    return {"torch": torch.__version__,
            "process_group_gloo": "hpct's series (torch._hpct_c10d)"
            if ext is not None and dist.ProcessGroupGloo is ext.ProcessGroupGloo else "torch's own"}


class Recorder(unittest.TestResult):
    def __init__(self, qualified: bool = False):
        super().__init__()
        self.rows: dict[str, dict] = {}
        self.t0 = 0.0
        self.qualified = qualified

    def startTest(self, test):
        super().startTest(test)
        self.t0 = time.monotonic()

    def _put(self, test, status, detail=""):
        name = ".".join(test.id().split(".")[-2 if self.qualified else -1:])
        self.rows[name] = {"status": status, "detail": str(detail)[-1500:],
                           "seconds": round(time.monotonic() - self.t0, 2)}
        print(f"{name}: {status}", flush=True)

    def addSuccess(self, test):
        self._put(test, "pass")

    def addFailure(self, test, err):
        self._put(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        self._put(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        self._put(test, "skip", reason)

    def addExpectedFailure(self, test, err):
        self._put(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test):
        self._put(test, "fail", "unexpected success")


def main() -> int:
    if SUITE.startswith("c10d_gloo:"):
        cases = {name: c10d_gloo_class_case(name) for name in SUITE.partition(":")[2].split(",")}
    else:
        cases = {"": generic_case() if SUITE == "generic" else c10d_gloo_case()}
    suite, missing = unittest.TestSuite(), []
    for prefix, case in cases.items():
        names = NAMES
        if names == ["ALL"]:
            names = unittest.TestLoader().getTestCaseNames(case)
        elif prefix:              # CLASS.test names pick tests of the classes of a c10d_gloo:... suite
            names = [n.partition(".")[2] for n in names if n.partition(".")[0] == prefix]
        suite.addTests(case(name) for name in names if hasattr(case, name))
        missing += [n for n in names if not hasattr(case, n)]
    result = Recorder(qualified=SUITE.startswith("c10d_gloo:"))
    suite.run(result)
    for name in missing:
        result.rows[name] = {"status": "missing", "detail": f"no test {name} in {SUITE}"}
    tmp = OUT + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result.rows, f, indent=1, sort_keys=True)
    os.replace(tmp, OUT)
    with open(OUT + ".meta.json", "w") as f:
        json.dump(meta(), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
