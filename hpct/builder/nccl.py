"""Recipe: build the patched NCCL with its own makefiles against a pinned CUDA.

``hpct-build build nccl`` fetches (sha256-checked), applies the series, finds or
assembles CUDA (hpct/builder/cuda.py), runs ``make src.build`` with the object tree
under ``third_party/build/nccl-<version>/obj`` and moves ``lib/`` and ``include/``
into ``.../install`` only once the build succeeded, with a stamp
(``hpct-series.json``) saying what was built and how.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import time
from pathlib import Path

from ..errors import BuildError, ConfigError
from . import build_cache
from .builder import require_tools, run_logged
from .cuda import DEFAULT_CUDA, cuda_toolchain, pins, preflight
from .layout import Layout, write_atomic
from .locks import one_at_a_time
from .patches import _project_file, load_series, patch
from .progress import Progress
from .sources import Manifest, fetch, sha256_of

DEFAULT_ARCHS = "80,90"   # A100 and H100: the GPUs hpct's jobs run on
# The collectives NCCL's device code generator knows (the first word of an ONLY_FUNCS entry).
COLLECTIVES = ("AllGather", "AllReduce", "Broadcast", "Reduce", "ReduceScatter", "SendRecv")
STAMP = "hpct-series.json"
# The header the series installs beside nccl.h; looked for in the patched tree when the
# series does not add it to NCCL's own list of exported headers.
ROOTLESS_HEADER = "nccl_rootless.h"
# The library links libcudart.so.<major> dynamically; in a wheel it sits in nvidia/nccl/lib and
# the runtime wheel's copy where that wheel puts it (the pin's cudart_runpath: cu12 wheels in
# nvidia/cuda_runtime/lib, CUDA 13 wheels in nvidia/cu13/lib), so it loads without torch too.
RUNPATH = "$ORIGIN/../../cuda_runtime/lib"      # 2.21.5's; a pin's manifest says its own
# libnccl's glibc floor (as the hpct extension's src/compat/glibc_floor.c): every reference to a
# function whose version is newer than GLIBC_2.28 is wrapped (--wrap) onto its oldest version, so
# the library keeps to manylinux_2_28 although it is built on a newer glibc.  Linked through
# LDFLAGS: no upstream edit.  x86_64 only.
GLIBC_FLOOR = "src/nccl_rootless/glibc_floor.c"


def runpath_of(m: Manifest) -> str:
    return m.extra.get("cudart_runpath", RUNPATH)


def ldflags(runpath: str, floor: Path | None = None, wraps: list[str] | None = None) -> str:
    """LDFLAGS for NCCL's link ($$: make would read $ORIGIN as its own variable; the quotes keep
    the shell off it), plus the glibc-floor object and its --wrap options."""
    flags = ["-Wl,-rpath,'" + runpath.replace("$", "$$") + "'"]
    if floor is not None:
        # libstdc++ linked in (as the hpct extension does): the build machine's
        # libstdc++.so needs GLIBCXX versions newer than manylinux_2_28 allows.
        flags += ["-static-libstdc++"]
        flags += [f"-Wl,--wrap={name}" for name in wraps or []] + [str(floor)]
    return " ".join(flags)


LDFLAGS_ENV = ldflags(RUNPATH)


def glibc_floor_wraps(source: Path) -> list[str]:
    """The names src/compat/glibc_floor.c wraps (each defines __wrap_NAME)."""
    text = source.read_text()
    return sorted(set(re.findall(r"^HPCT_FORWARD\((\w+),", text, re.MULTILINE))
                  | set(re.findall(r"\b__wrap_(\w+)\s*[\(=]", text)))


def compile_glibc_floor(layout: Layout, out: Path, log: Path) -> tuple[Path, list[str]]:
    source = _project_file(layout, GLIBC_FLOOR)
    if not source.is_file():
        raise BuildError(f"{GLIBC_FLOOR} is missing, and libnccl needs it to keep to manylinux_2_28",
                         fix="reinstall hpct (its wheel carries hpct/_build_inputs/src/nccl_rootless/) "
                             "or build from an hpct checkout (--root)")
    obj = out / "hpct_glibc_floor.o"
    cc = require_tools(["cc"])["cc"]
    run_logged([cc, "-O2", "-fPIC", "-fvisibility=hidden", "-c", str(source), "-o", str(obj)], log,
               Progress(quiet=True), "cc glibc floor")
    return obj, glibc_floor_wraps(source)


def parse_archs(value: str | None, cuda: str) -> list[str]:
    """'80,90' -> ['80', '90'], each checked against what that CUDA's nvcc can target."""
    known = pins(cuda)["archs"]
    raw = DEFAULT_ARCHS if value is None else value
    archs = [a.strip().removeprefix("sm_") for a in raw.replace(";", ",").split(",") if a.strip()]
    bad = [a for a in archs if a not in known]
    if not archs or bad:
        what = f"{', '.join(map(repr, bad))} in " if bad else ""
        raise ConfigError(f"bad --cuda-arch {what}{raw!r} for CUDA {cuda}",
                          fix=f"a comma-separated list of compute capabilities without the dot, e.g. "
                              f"80,90; CUDA {cuda} knows {','.join(known)}")
    return sorted(set(archs), key=archs.index)


def gencode(archs: list[str]) -> str:
    """NVCC_GENCODE: SASS for each arch, plus PTX of the newest so later GPUs can JIT it."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    top = max(archs, key=lambda a: (int(a.rstrip("a")), a))
    flags.append(f"-gencode=arch=compute_{top},code=compute_{top}")
    return " ".join(flags)


def check_funcs(funcs: str | None) -> str | None:
    if funcs is None:
        return None
    entries = [e.split() for e in funcs.split("|")]
    bad = [" ".join(e) or "(empty)" for e in entries if not e or e[0] not in COLLECTIVES]
    if bad:
        raise ConfigError(f"bad --funcs entry {', '.join(map(repr, bad))} in {funcs!r}",
                          fix=f"'|'-separated entries, each starting with one of {', '.join(COLLECTIVES)}, "
                              "e.g. \"SendRecv\" or \"AllReduce Sum f32 * *|SendRecv\"")
    return funcs


def source_for(m: Manifest) -> Path | None:
    from .main_fetch import source_for as lookup
    return lookup(m, None)


def built_info(layout: Layout, m: Manifest) -> dict | None:
    stamp = layout.build(m.name, m.version) / "install" / STAMP
    try:
        return json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None


@one_at_a_time
def build_nccl(layout: Layout, m: Manifest, progress: Progress, tests: bool = False,
               jobs: int | None = None, cuda: str | None = None, cuda_arch: str | None = None,
               funcs: str | None = None) -> Path:
    """Build ``libnccl.so`` from the patched tree; return the install prefix."""
    cuda = cuda or m.extra.get("cuda", DEFAULT_CUDA)
    pins(cuda)
    archs = parse_archs(cuda_arch, cuda)
    funcs = check_funcs(funcs)
    if tests:
        raise ConfigError("--tests: NCCL's own tests are a separate repository (nccl-tests)",
                          fix="build nccl without --tests")
    tools = require_tools(["make", "c++"])
    preflight(cuda)
    fetch(layout, m, progress, source=source_for(m))
    home = cuda_toolchain(layout, cuda, progress)
    src = patch(layout, m, progress)
    series = load_series(layout, m)
    out = layout.build(m.name, m.version)
    obj, prefix, log = out / "obj", out / "install", out / "build.log"
    config = {"series_id": series.identity(), "cuda": cuda, "cuda_archs": archs, "funcs": funcs,
              "runpath": runpath_of(m), "glibc_floor": platform.machine() == "x86_64"}
    cache_inputs = {**config, "name": m.name, "version": m.version, "tree": m.identity.get("tree_sha256"),
                    "nvcc": _version_text(home / "bin" / "nvcc"), "cxx": _version_text(Path(tools["c++"])),
                    "gencode": gencode(archs), "floor": _file_digest(_project_file(layout, GLIBC_FLOOR))}
    cache_key = build_cache.key(cache_inputs)
    if build_cache.enabled() and build_cache.take(m.name, m.version, cache_key, prefix):
        entry = build_cache.entry(m.name, m.version, cache_key)
        progress.step(f"{m.name} {m.version}: taken from the build cache ({entry}; {build_cache.CACHE_VAR}=0 "
                      "builds it anyway)")
        return prefix
    previous = built_info(layout, m)
    incremental = bool(previous and {k: previous.get(k) for k in config} == config and obj.is_dir())
    if not incremental:
        # NCCL regenerates its device sources only when they are missing: another
        # ONLY_FUNCS, arch list or series must start from an empty object tree.
        shutil.rmtree(obj, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    log.write_text(f"# hpct-build build {m.name} {m.version} (series {series.identity()}, "
                   f"CUDA {cuda}, archs {','.join(archs)}, funcs {funcs or 'all'})\n")
    progress.step(f"building {m.name} {m.version} for sm_{',sm_'.join(archs)} with CUDA {cuda}"
                  f"{f' (only {funcs})' if funcs else ' (all collectives: 16+ min on 2 cores)'}; log: {log}")
    cmd = [tools["make"], f"-j{jobs or os.cpu_count() or 2}", "src.build", f"BUILDDIR={obj}",
           f"CUDA_HOME={home}", "CUDARTLIB=cudart", f"NVCC_GENCODE={gencode(archs)}", f"CXX={tools['c++']}"]
    if funcs:
        cmd.append(f"ONLY_FUNCS={funcs}")
    if not any(int(a.rstrip("af")) >= 100 for a in archs):
        # 2.30's symmetric fp8 LDMC kernels are compiled for sm_100f whatever NVCC_GENCODE says
        # (NVCC_GENCODE_LDMC_FP8, src/device/Makefile), and their bodies exist for sm_100+ only.
        # With no such arch asked for, compile them for the build's own archs (empty bodies, the
        # host stubs still defined).  Empty NVCC_GENCODE_LDMC_FP8 would leave them undefined.
        cmd.append(f"NVCC_GENCODE_LDMC_FP8={gencode(archs)}")
    floor, wraps = compile_glibc_floor(layout, out, log) if platform.machine() == "x86_64" else (None, [])
    started = time.monotonic()
    # LDFLAGS through the environment: NCCL's makefiles append their own (-lcudart...) to it,
    # where a command-line LDFLAGS would replace them.
    run_logged(cmd, log, progress, "make", cwd=src,
               env={**os.environ, "LDFLAGS": ldflags(runpath_of(m), floor, wraps)})
    seconds = round(time.monotonic() - started, 1)
    staging = out / "install.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    _collect(obj, src, staging, log)
    info = {"name": m.name, "version": m.version, **config,
            "patches": [e.patch for e in series.entries], "cuda_home": str(home),
            "nvcc_gencode": gencode(archs), "seconds": seconds, "incremental": incremental}
    write_atomic(staging / STAMP, json.dumps(info, indent=2) + "\n")
    shutil.rmtree(prefix, ignore_errors=True)
    os.replace(staging, prefix)
    progress.step(f"{m.name} built in {seconds} s into {prefix}")
    if build_cache.enabled():
        stored = build_cache.store(m.name, m.version, cache_key, prefix, cache_inputs)
        progress.step(f"{m.name} {m.version}: stored in the build cache ({stored})" if stored else
                      f"{m.name} {m.version}: the build cache ({build_cache.root()}) is not writable; not stored")
    return prefix


def _version_text(tool: Path) -> str:
    """A tool's ``--version`` output (part of the build cache's key); empty when it cannot say."""
    try:
        return subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _file_digest(path: Path) -> str | None:
    return sha256_of(path) if path.is_file() else None


def _collect(obj: Path, src: Path, staging: Path, log: Path) -> None:
    """Copy the built library (with its symlinks) and exported headers into ``staging``."""
    libs = sorted((obj / "lib").glob("libnccl.so*"))
    if not any(p.name == "libnccl.so.2" for p in libs):
        raise BuildError(f"make finished but {obj / 'lib'} holds no libnccl.so.2", fix=f"see the log: {log}")
    (staging / "lib").mkdir(parents=True)
    for lib in libs:
        shutil.copy2(lib, staging / "lib" / lib.name, follow_symlinks=False)
    shutil.copytree(obj / "include", staging / "include")
    if (src / "LICENSE.txt").is_file():     # BSD-3: binary redistribution carries the notice
        shutil.copy2(src / "LICENSE.txt", staging / "LICENSE.txt")
    if not (staging / "include" / ROOTLESS_HEADER).exists():
        found = sorted(src.glob(f"src/**/{ROOTLESS_HEADER}"))
        if found:
            shutil.copy2(found[0], staging / "include" / ROOTLESS_HEADER)


def library(prefix: Path) -> Path:
    return prefix / "lib" / "libnccl.so.2"


def nccl_version_of(prefix: Path) -> str | None:
    """'2.21.5' from the installed nccl.h."""
    try:
        text = (prefix / "include" / "nccl.h").read_text()
    except OSError:
        return None
    parts = [re.search(rf"#define NCCL_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(p.group(1) for p in parts) if all(parts) else None

