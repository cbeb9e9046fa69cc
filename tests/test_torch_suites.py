"""PyTorch's own distributed suites against the hpct backend, next to Gloo in the same run (issue 13, item 7).

Two suites at world size 2, every test of each (tests/torch_suite_worker.py explains how
a suite is pointed at hpct):
- ``generic``: ``DistributedTest._DistTestBase`` from the installed torch wheel;
- ``c10d_gloo``: ``ProcessGroupGlooTest`` from PyTorch 2.6.0's test/distributed/test_c10d_gloo.py
  in the pinned, patched source tree (``hpct-build patch pytorch``).
Every test that passes on Gloo must pass on hpct, except the ones in KNOWN, each with the
reason (docs/distributed.md lists them too); a KNOWN test that starts passing must leave the
list.  Nothing may hang: every test is bounded by the harness timeout and the worker by ours.
The counts of both backends are printed (pytest -s) and written to counts.json.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpct.ports import free_port_block

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
C10D_DIR = ROOT / "third_party" / "patched" / "pytorch-2.6.0" / "test" / "distributed"
WORKER = Path(__file__).with_name("torch_suite_worker.py")
TEST_TIMEOUT_S = 60          # the harness's per-test bound (DISTRIBUTED_TESTS_DEFAULT_TIMEOUT)
SUITE_TIMEOUT_S = 420        # one suite, one backend

KNOWN = {
    "generic": {
        "test_get_backend": "get_backend() names the backend: 'hpct', not 'gloo'",
        "test_monitored_barrier_gloo": "torch's monitored_barrier refuses every non-Gloo group before calling "
                                       "it; hpct.distributed.monitored_barrier is the equivalent",
        "test_monitored_barrier_gloo_subgroup": "as test_monitored_barrier_gloo",
        "test_monitored_barrier_gloo_rank_0_timeout": "with a zero timeout hpct names the missing peer, Gloo "
                                                      "says rank 0 timed out",
    },
    "c10d_gloo": {},
}


def run_suite(tmp: Path, suite: str, backend: str) -> dict:
    out = tmp / f"{suite}-{backend}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCT_")}
    env.update({"HPCT_PORT_BASE": str(free_port_block(16)), "TORCH_C10D_TEST_DIR": str(C10D_DIR),
                "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(TEST_TIMEOUT_S), "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
                "OMP_NUM_THREADS": "1"})
    log = tmp / f"{suite}-{backend}.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, str(WORKER), suite, backend, str(out), "ALL"], env=env,
                              stdout=f, stderr=subprocess.STDOUT, timeout=SUITE_TIMEOUT_S, cwd=str(tmp))
    assert proc.returncode == 0 and out.exists(), log.read_text()[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if importlib.util.find_spec("expecttest") is None:
        pytest.skip("torch's test harness needs the expecttest package: pip install expecttest")
    if not (C10D_DIR / "test_c10d_gloo.py").is_file():
        pytest.skip(f"{C10D_DIR}/test_c10d_gloo.py is missing: run `hpct-build patch pytorch` first")
    tmp = tmp_path_factory.mktemp("torch-suites")
    got = {(s, b): run_suite(tmp, s, b) for s in ("c10d_gloo", "generic") for b in ("gloo", "hpct")}
    counts = {f"{s}/{b}": dict(collections.Counter(v["status"] for v in rows.values()))
              for (s, b), rows in got.items()}
    (tmp / "counts.json").write_text(json.dumps(counts, indent=1))
    print("\ntorch suites (world size 2):", json.dumps(counts))
    return got


@pytest.mark.parametrize("suite", ["c10d_gloo", "generic"])
def test_every_test_gloo_passes_passes_on_hpct(results, suite):
    gloo, hpct = results[(suite, "gloo")], results[(suite, "hpct")]
    assert gloo.keys() == hpct.keys() and len(gloo) > 40
    assert sum(v["status"] == "pass" for v in gloo.values()) > 30, "the suite itself did not run"
    broken = {name: hpct[name]["detail"][-600:] for name, row in gloo.items()
              if row["status"] == "pass" and hpct[name]["status"] != "pass" and name not in KNOWN[suite]}
    assert not broken, "\n\n".join(f"{k}:\n{v}" for k, v in broken.items())


@pytest.mark.parametrize("suite", ["c10d_gloo", "generic"])
def test_known_differences_are_still_real(results, suite):
    hpct = results[(suite, "hpct")]
    stale = [name for name in KNOWN[suite] if hpct.get(name, {}).get("status") == "pass"]
    assert not stale, f"these pass on hpct now: remove them from KNOWN and the docs: {stale}"


@pytest.mark.parametrize("suite", ["c10d_gloo", "generic"])
def test_nothing_hangs(results, suite):
    slow = {name: row["seconds"] for name, row in results[(suite, "hpct")].items()
            if row.get("seconds", 0) > TEST_TIMEOUT_S / 2}
    assert not slow, slow
