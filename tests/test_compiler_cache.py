"""hpct-build's compiler cache (build_scripts/compiler_cache.cmake): with ccache installed, a tree
at another path builds Gloo from the first tree's objects, and the library is the same bytes as
with the cache and without it.
CI leans on it (every fresh clone, sdist and wheel of the suite rebuilds Gloo), so a cache that
quietly stopped hitting would cost minutes per run without failing anything but this."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from util import run_cli, seed_checkout

pytestmark = pytest.mark.slow

needs_ccache = pytest.mark.skipif(shutil.which("ccache") is None or shutil.which("cmake") is None,
                                  reason="needs ccache and cmake (bash ci/setup.sh installs them)")
LIBGLOO = Path("third_party/build/gloo-5354032/install/lib/libgloo.a")


def _stats(env: dict) -> dict[str, int]:
    out = subprocess.run(["ccache", "--print-stats"], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return {k: int(v) for k, v in (line.split("\t") for line in out.splitlines() if "\t" in line)
            if v.isdigit()}


@needs_ccache
def test_a_tree_at_another_path_builds_gloo_from_the_cache_byte_identical(tmp_path, repo, gloo_archive):
    env = {"CCACHE_DIR": str(tmp_path / "ccache")}    # cold: this test's own cache
    first = seed_checkout(tmp_path / "a" / "checkout", repo, gloo_archive)
    second = seed_checkout(tmp_path / "deeper" / "b" / "checkout", repo, gloo_archive)
    proc = run_cli("hpct-build", "build", "gloo", "--root", str(first), env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr
    cold = _stats(env)
    compiles = cold["cache_miss"]
    assert compiles >= 30 and cold.get("direct_cache_hit", 0) + cold.get("preprocessed_cache_hit", 0) == 0, cold
    launcher = (first / "third_party/build/gloo-5354032/obj/CMakeCache.txt").read_text()
    assert f"CMAKE_CXX_COMPILER_LAUNCHER:STRING=env;CCACHE_BASEDIR={first};CCACHE_NOHASHDIR=1;" in launcher

    proc = run_cli("hpct-build", "build", "gloo", "--root", str(second), env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr
    warm = _stats(env)
    hits = warm.get("direct_cache_hit", 0) + warm.get("preprocessed_cache_hit", 0)
    assert (hits, warm["cache_miss"]) == (compiles, compiles), warm     # every object from the cache
    lib = (first / LIBGLOO).read_bytes()
    assert (second / LIBGLOO).read_bytes() == lib
    # The cache changes no byte: the same tree built without it (ccache passes the compiler the
    # tree's absolute paths, not the relative ones) is the same library.  Gloo's messages name
    # their file by the tree's version, never by a path of the machine that built it.
    third = seed_checkout(tmp_path / "plain" / "checkout", repo, gloo_archive)
    proc = run_cli("hpct-build", "build", "gloo", "--root", str(third), env={**env, "CCACHE_DISABLE": "1"},
                   timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert _stats(env)["cache_miss"] == compiles                        # it went around the cache
    assert (third / LIBGLOO).read_bytes() == lib
    assert b"gloo-5354032/gloo/transport/tcp/" in lib and b"../patched" not in lib and str(tmp_path).encode() not in lib


def _configure(tmp_path: Path, name: str, env: dict) -> str:
    """A one-file project that includes the recipe; returns its CMakeCache.txt."""
    src = tmp_path / name
    src.mkdir()
    (src / "x.cc").write_text("int x() { return 1; }\n")
    recipe = Path(__file__).resolve().parents[1] / "build_scripts" / "compiler_cache.cmake"
    (src / "CMakeLists.txt").write_text(
        f'cmake_minimum_required(VERSION 3.19)\nproject(t LANGUAGES CXX)\ninclude("{recipe}")\n'
        'add_library(t STATIC x.cc)\n')
    proc = subprocess.run(["cmake", "-G", "Ninja", "-S", str(src), "-B", str(src / "obj")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return (src / "obj" / "CMakeCache.txt").read_text()


@pytest.mark.unit
@needs_ccache
def test_the_recipe_uses_ccache_when_installed_and_keeps_a_launcher_the_user_set(tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CMAKE_", "CCACHE_"))}
    cache = _configure(tmp_path, "found", base)
    assert f"CMAKE_CXX_COMPILER_LAUNCHER:STRING=env;CCACHE_BASEDIR={tmp_path / 'found'};" in cache
    # A launcher the user chose (sccache, distcc, ...; here env(1)) wins over ours.
    env_tool = shutil.which("env")
    cache = _configure(tmp_path, "user", {**base, "CMAKE_CXX_COMPILER_LAUNCHER": env_tool})
    assert f"CMAKE_CXX_COMPILER_LAUNCHER:STRING={env_tool}\n" in cache and "CCACHE_BASEDIR" not in cache
    # No ccache on PATH: no launcher, and the build still configures.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("c++", "g++", "cc", "gcc", "ld", "as", "ar", "ranlib", "ninja", "cmake"):
        if shutil.which(tool):
            os.symlink(shutil.which(tool), bindir / tool)
    cache = _configure(tmp_path, "absent", {**base, "PATH": str(bindir)})
    assert "CMAKE_CXX_COMPILER_LAUNCHER:STRING=\n" in cache and "HPCT_CCACHE:FILEPATH=HPCT_CCACHE-NOTFOUND" in cache
