"""Builds: run a recipe's commands with their output in one log file.

The log path is printed at the start and named again in the error message, so a
failed build always says where to look.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from ..errors import BuildError, ToolchainError
from .layout import Layout, write_atomic
from .locks import one_at_a_time
from .patches import load_series, patch, patched_info
from .progress import Progress
from .sources import Manifest, fetch

# program -> the Debian package that provides it (named in the error's fix)
TOOLS = {"cmake": "cmake", "ninja": "ninja-build", "c++": "g++", "cc": "gcc", "patch": "patch"}


def require_tools(names: list[str], env: dict | None = None) -> dict[str, str]:
    """Absolute paths of the tools, or one ToolchainError naming all that are missing."""
    path = (env or os.environ).get("PATH", os.defpath)
    found = {n: shutil.which(n, path=path) for n in names}
    missing = [n for n, p in found.items() if not p]
    if missing:
        pkgs = " ".join(sorted({TOOLS.get(n, n) for n in missing}))
        raise ToolchainError(f"missing build tool(s): {', '.join(missing)}",
                             fix=f"apt-get install -y {pkgs}  (or run ci/setup.sh)")
    return found  # type: ignore[return-value]


def run_logged(cmd: list[str], log: Path, progress: Progress, what: str, cwd: Path | None = None,
               env: dict | None = None, timeout: float = 3 * 3600) -> None:
    """Run ``cmd`` appending to ``log``; a failure raises BuildError with the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n")
        out.flush()
        started = time.monotonic()
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=15)
                    break
                except subprocess.TimeoutExpired:
                    elapsed = time.monotonic() - started
                    if elapsed > timeout:
                        proc.kill()
                        proc.wait()
                        raise BuildError(f"{what} ran past {timeout:.0f} s", fix=f"see the log: {log}")
                    progress.step(f"{what}: still running ({elapsed:.0f} s; {_last_line(log)})")
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise
    if rc != 0:
        tail = "\n    ".join(log.read_text(errors="replace").splitlines()[-15:])
        raise BuildError(f"{what} failed (exit {rc}); last lines:\n    {tail}", fix=f"see the whole log: {log}")


def _last_line(log: Path) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 400))
            lines = f.read().decode(errors="replace").strip().splitlines()
        return lines[-1][:80] if lines else ""
    except OSError:
        return ""


@one_at_a_time
def build_gloo(layout: Layout, m: Manifest, progress: Progress, tests: bool = False,
               jobs: int | None = None) -> Path:
    """Fetch, patch, then CMake+ninja the patched Gloo into ``build/.../install``."""
    tools = require_tools(["cmake", "ninja", "c++", "patch"])
    fetch(layout, m, progress)
    src = patch(layout, m, progress)
    series = load_series(layout, m)
    out = layout.build(m.name, m.version)
    obj, prefix, log = out / "obj", out / "install", out / "build.log"
    previous = built_info(layout, m)
    if previous and previous.get("series_id") != series.identity():
        # copytree keeps the pristine mtimes, so a file a dropped patch used to touch
        # would look older than its object: start from a clean object tree instead.
        shutil.rmtree(obj, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    log.write_text(f"# hpct-build build {m.name} {m.version} (series {series.identity()})\n")
    progress.step(f"building {m.name} {m.version}{' with its tests' if tests else ''}; log: {log}")
    recipe = layout.root / "build_scripts" / f"{m.name}.cmake"
    env = {**os.environ, "CXX": tools["c++"]}
    started = time.monotonic()
    staging = out / "install.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    # Gloo installs to absolute ${CMAKE_INSTALL_PREFIX} paths (so --prefix cannot
    # relocate it): configure the staging prefix itself, then rename it into place.
    # Gloo's messages carry __FILE__: name the tree by version, not by this machine's path,
    # so users read [gloo-5354032/gloo/...] and two builds of one series are byte-identical.
    # With ccache (build_scripts/compiler_cache.cmake) the compiler sees the tree's paths relative to
    # the object folder (its base folder rewrite): map that spelling too, so the bytes are the same.
    prefix_map = (f"-ffile-prefix-map={src}={m.name}-{m.version} "
                  f"-ffile-prefix-map={os.path.relpath(src, obj)}={m.name}-{m.version}")
    # -D before -C: the recipe's compiler cache reads the tree root (build_scripts/compiler_cache.cmake).
    run_logged([tools["cmake"], "-G", "Ninja", "-S", src, "-B", obj, f"-DHPCT_CCACHE_BASEDIR={layout.root}", "-C", recipe,
                f"-DBUILD_TEST={'ON' if tests else 'OFF'}", f"-DCMAKE_INSTALL_PREFIX={staging}",
                f"-DCMAKE_CXX_FLAGS={prefix_map}"],
               log, progress, "cmake configure", env=env)
    run_logged([tools["ninja"], "-C", obj, f"-j{jobs or os.cpu_count() or 2}"], log, progress, "ninja", env=env)
    run_logged([tools["cmake"], "--install", obj], log, progress, "install", env=env)
    info = {"name": m.name, "version": m.version, "series_id": series.identity(),
            "patches": [e.patch for e in series.entries], "tests_built": tests,
            "seconds": round(time.monotonic() - started, 1)}
    write_atomic(staging / "hpct-series-id", series.identity() + "\n")
    write_atomic(staging / "hpct-series.json", json.dumps(info, indent=2) + "\n")
    shutil.rmtree(prefix, ignore_errors=True)
    os.replace(staging, prefix)
    progress.step(f"{m.name} built in {info['seconds']} s into {prefix}")
    return prefix


def gloo_test_binary(layout: Layout, m: Manifest) -> Path:
    return layout.build(m.name, m.version) / "obj" / "gloo" / "test" / "gloo_test"


def built_info(layout: Layout, m: Manifest) -> dict | None:
    stamp = layout.build(m.name, m.version) / "install" / "hpct-series.json"
    if not stamp.is_file():
        return None
    info = json.loads(stamp.read_text())
    current = patched_info(layout, m)
    info["stale"] = bool(current and current.get("series_id") != info.get("series_id"))
    return info
