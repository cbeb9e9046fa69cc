"""The real NCCL builds of test_nccl_build.py, started early by ci/test.sh.

On 2 cores the two builds take about 11 minutes of CPU, most of it nvcc.  ci/test.sh starts
this script in the background at nice 19 before the suite, so the builds use the CPU the
multi-process tests leave idle.  Each build holds its version's lock while it runs; the test
fixture takes the same lock before running the same build, which then finds everything built
and only relinks.  The prebuild is an optimisation only: when it fails or never ran, the
fixture builds from scratch and reports what went wrong.

    python tests/nccl_prebuild.py     (from ci/test.sh; the log is build/nccl-prebuild.log)
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "build"
OLD, NEW = "2.21.5", "2.30.7"
# What the test's build must not pick up from the caller (no network, no foreign toolchain).
OFFLINE = {"CUDA_HOME": "", "HTTPS_PROXY": "http://127.0.0.1:1", "https_proxy": "http://127.0.0.1:1",
           "HPCT_NCCL_SOURCE": "", "HPCT_NCCL_SOURCES": ""}


def _tarball(version: str) -> Path | None:
    folder = os.environ.get("HPCT_NCCL_SOURCES")
    path = Path(folder) / f"nccl-{version}-1.tar.gz" if folder else None
    return path if path and path.is_file() else None


def new_cuda_home() -> str:
    return os.environ.get("CUDA_HOME") or "/usr/local/cuda"


def why_not(version: str) -> str | None:
    """Why the real build of ``version`` cannot run here (the test's skip reason), or None."""
    from hpct.builder.sources import STAMP
    fetched = (REPO / "third_party" / "src" / f"nccl-{version}" / STAMP).is_file()
    if version == OLD:
        if not (os.environ.get("HPCT_NCCL_SOURCE") or _tarball(version) or fetched):
            return (f"set HPCT_NCCL_SOURCES=<folder of NCCL tag tarballs> or HPCT_NCCL_SOURCE=<nccl-{OLD}-1 "
                    "tarball or tree> (or run `hpct-build fetch nccl --source PATH` in the checkout) to build "
                    "the real NCCL")
        return None
    if not (fetched or _tarball(version)):
        return f"needs nccl-{version}-1.tar.gz: set HPCT_NCCL_SOURCES to the folder of NCCL tag tarballs"
    nvcc = Path(new_cuda_home()) / "bin" / "nvcc"
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout \
        if nvcc.is_file() else ""
    if "release 13.0" not in out:
        return f"NCCL {version} builds with CUDA 13.0: no nvcc 13.0 at {nvcc} (set CUDA_HOME)"
    return None


def build_args(version: str) -> tuple[list[str], dict]:
    """hpct-build's arguments and environment for the test's build of ``version``: the
    SendRecv kernels only (the others add nothing a CPU can check), one arch for 2.30.7."""
    if version == OLD:
        env = {k: v for k, v in OFFLINE.items() if k != "HPCT_NCCL_SOURCE"}
        given = os.environ.get("HPCT_NCCL_SOURCE") or (str(_tarball(OLD)) if _tarball(OLD) else "")
        if given:
            env["HPCT_NCCL_SOURCE"] = given
        if os.environ.get("CUDA_HOME"):
            env["CUDA_HOME"] = os.environ["CUDA_HOME"]
        return ["build", "nccl", "--funcs", "SendRecv", "--root", str(REPO)], env
    env = {**OFFLINE, "CUDA_HOME": new_cuda_home(), "HPCT_NCCL_SOURCES": os.environ.get("HPCT_NCCL_SOURCES", "")}
    return ["build", f"nccl={version}", "--funcs", "SendRecv", "--cuda-arch", "80", "--root", str(REPO)], env


def lock(version: str, wait_s: float):
    """Hold ``version``'s build lock (hpct-build's own kind); wait at most ``wait_s`` for a prebuild
    that holds it."""
    from hpct.builder.locks import file_lock
    return file_lock(LOCKS / f"nccl-{version}-build.lock",
                     f"NCCL {version}'s test build (the prebuild's log: build/nccl-prebuild.log)", wait_s=wait_s)


def ensure_built(version: str) -> Path:
    """The test build of ``version`` (SendRecv only), made now unless the prebuild or another
    test made it (then hpct-build only relinks); the test is skipped when it cannot run here.
    Tests in other xdist workers that need it wait on the same lock, never skip for its absence."""
    import pytest
    from util import run_cli
    reason = why_not(version)
    if reason:
        pytest.skip(reason)
    args, env = build_args(version)
    with lock(version, wait_s=3600):
        started = time.monotonic()
        proc = run_cli("hpct-build", *args, env=env, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"\nNCCL {version} (SendRecv) built in {time.monotonic() - started:.0f} s")
    return REPO / "third_party" / "build" / f"nccl-{version}" / "install"


def main() -> int:
    with contextlib.ExitStack() as held:
        # Take every lock before the first build, so that no fixture starts a build beside it.
        todo = [v for v in (NEW, OLD) if why_not(v) is None]  # the long one first
        locks = {v: held.enter_context(contextlib.ExitStack()) for v in todo}
        for v in todo:
            locks[v].enter_context(lock(v, 0))
        for v in todo:
            args, env = build_args(v)
            started = time.monotonic()
            rc = subprocess.run([sys.executable, "-m", "hpct.builder", *args], cwd=REPO,
                                env={**os.environ, **env}, timeout=3600).returncode
            print(f"nccl_prebuild: NCCL {v}: exit {rc} after {time.monotonic() - started:.0f} s", flush=True)
            locks[v].close()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))      # before the suite installs hpct: the checkout's builder
    sys.exit(main())
