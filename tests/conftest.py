"""Shared fixtures.  The suite tests the *installed* hpct, never the source tree."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

from util import REPO, run_cli, seed_checkout
from zygote import children_cpu


def pytest_configure(config):
    import hpct
    here = Path(hpct.__file__).resolve()
    # The source package is REPO/hpct; a virtual environment inside the checkout (.venv/)
    # holds the installed wheel, which is what the suite should test.
    if here.parent == REPO / "hpct":
        raise pytest.UsageError(
            f"hpct is imported from the source tree ({here}); install the wheel "
            "(hpct-build wheel --install) and run pytest without PYTHONPATH pointing at the checkout")
    _own_ports_per_worker()


def _own_ports_per_worker() -> None:
    """Under pytest-xdist, each worker picks its ports from a range of its own: two tests running
    at once then never pick overlapping blocks on loopback (namespaces have ports of their own)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    import hpct.ports as ports
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    low, high, *rest = ports.free_port_block.__defaults__
    span = (high - low) // count
    start = low + int(worker[2:]) * span
    ports.free_port_block.__defaults__ = (start, start + span, *rest)


def pytest_addoption(parser):
    parser.addoption("--first", default="", metavar="FILES",
                     help="comma-separated test files whose tests come first, in this order (ci/test.sh "
                          "starts its longest files first; with xdist, add --no-loadscope-reorder)")


def pytest_collection_modifyitems(config, items):
    first = {f: i for i, f in enumerate(f for f in config.getoption("--first").split(",") if f)}
    if first:          # a stable sort: the rest keep their order, after the named files
        items.sort(key=lambda it: first.get(it.nodeid.split("::")[0], len(first)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's wall time and the CPU time it used, its own and its children's: the suite's
    profile (build/test-profile.jsonl), from which the tiers are chosen by measurement -- a test
    that waits (sockets, deadlines) uses little CPU for its wall time and can share the machine, one
    that loads the CPU or times itself cannot (ci/summary.py prints the heaviest)."""
    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + children_cpu()
    wall, used = time.monotonic(), cpu()
    yield
    record = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 3), "cpu_s": round(cpu() - used, 3),
              "markers": sorted({m.name for m in item.iter_markers()})}
    try:
        (REPO / "build").mkdir(exist_ok=True)
        with open(REPO / "build" / f"test-profile-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError:
        pass


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture
def scratch_root(tmp_path: Path, repo: Path) -> Path:
    """A throw-away checkout: the real manifests, patches and recipes, an empty work area."""
    return seed_checkout(tmp_path / "checkout", repo)


@pytest.fixture
def gloo_archive(repo: Path) -> Path:
    """The pinned Gloo tarball, fetched once into the real checkout's cache."""
    cached = repo / "third_party" / "cache" / "gloo_0.0~git20231202.5354032.orig.tar.xz"
    if not cached.is_file():
        proc = run_cli("hpct-build", "fetch", "gloo", "--root", str(repo), timeout=300)
        assert proc.returncode == 0, proc.stderr
    return cached


@pytest.fixture
def seeded_root(tmp_path: Path, repo: Path, gloo_archive: Path) -> Path:
    """A scratch checkout whose cache already holds the verified Gloo tarball."""
    return seed_checkout(tmp_path / "checkout", repo, gloo_archive)


@pytest.fixture(params=["mesh", "lazy"])
def connect_mode(request, monkeypatch) -> str:
    """Run a raw-context suite in both connect modes: the full mesh, and lazy pairs
    (the backend's default).  tests/gloo_worker.py reads HPCT_TEST_LAZY."""
    monkeypatch.setenv("HPCT_TEST_LAZY", "1" if request.param == "lazy" else "0")
    return request.param
