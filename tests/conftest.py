"""Shared fixtures.  The suite tests the *installed* hpct, never the source tree."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from util import REPO, run_cli


def pytest_configure(config):
    import hpct
    here = Path(hpct.__file__).resolve()
    # The source package is REPO/hpct; a virtual environment inside the checkout (.venv/)
    # holds the installed wheel, which is what the suite should test.
    if here.parent == REPO / "hpct":
        raise pytest.UsageError(
            f"hpct is imported from the source tree ({here}); install the wheel "
            "(hpct-build wheel --install) and run pytest without PYTHONPATH pointing at the checkout")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture
def scratch_root(tmp_path: Path, repo: Path) -> Path:
    """A throw-away checkout: the real manifests, patches and recipes, an empty work area."""
    root = tmp_path / "checkout"
    root.mkdir()
    for name in ("third_party", "patches", "build_scripts"):
        shutil.copytree(repo / name, root / name,
                        ignore=shutil.ignore_patterns("src", "patched", "build", "cache"))
    return root


@pytest.fixture
def gloo_archive(repo: Path) -> Path:
    """The pinned Gloo tarball, fetched once into the real checkout's cache."""
    cached = repo / "third_party" / "cache" / "gloo_0.0~git20231202.5354032.orig.tar.xz"
    if not cached.is_file():
        proc = run_cli("hpct-build", "fetch", "gloo", "--root", str(repo), timeout=300)
        assert proc.returncode == 0, proc.stderr
    return cached


@pytest.fixture
def seeded_root(scratch_root: Path, gloo_archive: Path) -> Path:
    """A scratch checkout whose cache already holds the verified Gloo tarball."""
    (scratch_root / "third_party" / "cache").mkdir()
    shutil.copy2(gloo_archive, scratch_root / "third_party" / "cache" / gloo_archive.name)
    return scratch_root


@pytest.fixture(params=["mesh", "lazy"])
def connect_mode(request, monkeypatch) -> str:
    """Run a raw-context suite in both connect modes: the full mesh, and lazy pairs
    (the backend's default).  tests/gloo_worker.py reads HPCT_TEST_LAZY."""
    monkeypatch.setenv("HPCT_TEST_LAZY", "1" if request.param == "lazy" else "0")
    return request.param
