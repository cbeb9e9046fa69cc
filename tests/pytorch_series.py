"""The PyTorch 2.6.0 series as tests/test_pytorch_patches.py and tests/test_pytorch_nccl.py both
use it: where its files are, the patched tree and its rootless module (fixtures), and the compile
check of a changed C++ unit against the torch==2.6.0 wheel's headers and the patched Gloo."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from hpct.builder.locks import file_lock
from hpct.builder.sources import sha256_of
from util import REPO, run_cli

VERSION = "2.6.0"
SERIES_DIR = REPO / "patches" / "pytorch" / VERSION
PATCHED = REPO / "third_party" / "patched" / f"pytorch-{VERSION}"
MODULE = "torch/distributed/_hpct_rootless.py"
VECTORS = json.loads((REPO / "tests" / "vectors" / "port_plan.json").read_text())


def _series_files() -> list[Path]:
    lines = (SERIES_DIR / "series").read_text().splitlines()
    names = [ln.split("#", 1)[0].strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return [SERIES_DIR / n for n in names]


def changed_files() -> list[str]:
    """Every path the series touches (b/ side), in order of first appearance."""
    seen: list[str] = []
    for patch in _series_files():
        for m in re.finditer(r"^diff --git a/\S+ b/(\S+)$", patch.read_text(), re.MULTILINE):
            if m.group(1) not in seen:
                seen.append(m.group(1))
    return seen


@pytest.fixture(scope="session")
def patched_tree() -> Path:
    """third_party/patched/pytorch-2.6.0 with the current series (idempotent: made when stale)."""
    proc = run_cli("hpct-build", "patch", "pytorch", "--root", str(REPO), timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert (PATCHED / MODULE).is_file()
    return PATCHED


@pytest.fixture
def rl(patched_tree: Path):
    """A fresh copy of the patched _hpct_rootless module (its state is per test)."""
    name = "_hpct_rootless_under_test"
    spec = importlib.util.spec_from_file_location(name, patched_tree / MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module      # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


def _error_names(err, *names: str) -> None:
    text = str(err)
    assert "\n  fix: " in text, text
    for n in names:
        assert n in text, f"{n!r} not in {text!r}"


# ------------------------------------------------------------ compile every changed C++ unit
#
# Against: the torch==2.6.0 wheel's torch/include (cached in third_party/cache/torch-2.6.0-include,
# the wheel itself is not kept and never installed), the changed headers of the patched tree
# (an overlay ahead of the wheel's copies), the patched Gloo tree plus the config.h of the
# patched Gloo build, the Python headers, and -- last -- the pristine source tree for the few
# headers the wheel does not ship, and Debian's fmt and cpp-httplib headers (neither the wheel
# nor the dfsg tree has them).

CACHE = REPO / "third_party" / "cache"
TORCH_INCLUDE = CACHE / f"torch-{VERSION}-include"
TORCH_WHEELS = {   # sha256 of the wheels pip may choose (pinned: a mismatch is an error)
    "torch-2.6.0-cp311-cp311-manylinux1_x86_64.whl":
        "7979834102cd5b7a43cc64e87f2f3b14bd0e1458f06e9f88ffa386d07c7446e1",
}
GLOO_PATCHED = REPO / "third_party" / "patched" / "gloo-5354032"
GLOO_PRISTINE = REPO / "third_party" / "src" / "gloo-5354032"
GLOO_CONFIG = REPO / "third_party" / "build" / "gloo-5354032" / "install" / "include"
PRISTINE = REPO / "third_party" / "src" / f"pytorch-{VERSION}"
DEFINES = ["-DUSE_C10D_GLOO", "-DUSE_DISTRIBUTED", "-DUSE_C10D", "-DUSE_RPC", "-DUSE_TENSORPIPE",
           "-DTHP_BUILD_MAIN_LIB"]
EXTRA_DEBS = ("libfmt-dev", "libcpp-httplib-dev")


def fetch_torch_headers(dest: Path = TORCH_INCLUDE) -> Path:
    """pip download torch==2.6.0 once, keep torch/include, drop the wheel (~766 MB -> ~51 MB)."""
    marker = dest / "torch" / "include" / "torch" / "csrc" / "distributed" / "c10d" / "ProcessGroupGloo.hpp"
    if marker.is_file():
        return dest
    # test_pytorch_nccl shares these headers and may run beside us in another xdist worker
    with file_lock(CACHE / "locks" / f"{dest.name}.lock", f"the torch {VERSION} headers"):
        if not marker.is_file():
            _download_torch_headers(dest)
    return dest


def _download_torch_headers(dest: Path) -> None:
    import tempfile
    import zipfile
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="torch-wheel-", dir=dest.parent) as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               f"torch=={VERSION}", "-d", tmp], capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, f"pip download torch=={VERSION} failed:\n{proc.stderr[-2000:]}"
        wheel = next(Path(tmp).glob("torch-*.whl"))
        want = TORCH_WHEELS.get(wheel.name)
        if want is not None:
            got = sha256_of(wheel)
            assert got == want, f"{wheel.name}: sha256 {got} is not the pinned {want}"
        scratch = Path(tmp) / "include"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(scratch, [n for n in z.namelist() if n.startswith("torch/include/")])
        wheel.unlink()
        os.replace(scratch, dest)      # atomic: a half-extracted tree is never left at dest


def fetch_extra_headers(dest: Path = TORCH_INCLUDE / "extra") -> Path:
    """fmt and cpp-httplib headers from Debian's packages (downloaded, unpacked, never installed)."""
    def done() -> bool:
        return (dest / "httplib.h").is_file() and (dest / "fmt" / "format.h").is_file()
    if done():
        return dest
    with file_lock(CACHE / "locks" / "extra-headers.lock", "the fmt and cpp-httplib headers"):
        if not done():
            _download_extra_headers(dest)
    return dest


def _download_extra_headers(dest: Path) -> None:
    import tempfile
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="extra-headers-", dir=dest.parent) as tmp:
        proc = subprocess.run(["apt-get", "download", *EXTRA_DEBS], cwd=tmp, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, (f"apt-get download {' '.join(EXTRA_DEBS)} failed:\n{proc.stderr[-1500:]}\n"
                                      "fix: run apt-get update (ci/setup.sh does)")
        root = Path(tmp) / "root"
        for deb in Path(tmp).glob("*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=120)
        scratch = Path(tmp) / "extra"
        scratch.mkdir()
        shutil.copy2(root / "usr/include/httplib.h", scratch / "httplib.h")
        shutil.copytree(root / "usr/include/fmt", scratch / "fmt")
        os.replace(scratch, dest)


def changed_units() -> list[str]:
    return [f for f in changed_files() if f.endswith((".cpp", ".cc"))]


def compile_unit(tree: Path, unit: str, gloo_include: Path, overlay: Path, torch_include: Path = TORCH_INCLUDE,
                 timeout: float = 900) -> subprocess.CompletedProcess:
    inc = torch_include / "torch" / "include"
    cmd = ["g++", "-fsyntax-only", "-std=c++17", "-fPIC", "-w", *DEFINES,
           "-I", str(overlay), "-I", str(inc), "-I", str(inc / "torch" / "csrc" / "api" / "include"),
           "-I", str(gloo_include), "-I", str(GLOO_CONFIG),
           "-I", sysconfig.get_paths()["include"],
           "-idirafter", str(PRISTINE), "-idirafter", str(torch_include / "extra"), unit]
    return subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=timeout)


def header_overlay(tree: Path, dest: Path) -> Path:
    """The series' changed headers at their include paths, to shadow the wheel's stock copies."""
    for rel in changed_files():
        if rel.endswith((".h", ".hpp")):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(tree / rel, dest / rel)
    return dest


@pytest.fixture(scope="session")
def compile_env(patched_tree, tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.fail("g++ is not installed; fix: apt-get install g++ (ci/setup.sh does)")
    proc = run_cli("hpct-build", "patch", "gloo", "--root", str(REPO), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert (GLOO_CONFIG / "gloo" / "config.h").is_file(), \
        "no patched Gloo build (its config.h); fix: hpct-build build gloo"
    fetch_torch_headers()
    fetch_extra_headers()
    return header_overlay(patched_tree, tmp_path_factory.mktemp("overlay"))
