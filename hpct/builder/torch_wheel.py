"""``hpct-build wheel torch=2.6.0``: PyPI's torch wheel with hpct's PyTorch series, without a torch build.

A full PyTorch build needs hours on a large machine (``hpct-build build pytorch``).  The series
changes little of torch, so this recipe starts from PyPI's sha256-pinned wheel for the target
CPython and changes only that:

1. the series' Python changes (``patches/pytorch/<v>/series``, then the recipe's own
   ``patches/pytorch/<v>/wheel/series``) are applied with ``patch`` to the wheel's own files;
2. the series' changed C++ units (ProcessGroupGloo, GlooDeviceFactory, ProcessGroupNCCL,
   NCCLUtils, and the FlightRecorder torch does not export) are compiled from the patched
   Debian tree against the wheel's headers, with hpct's patched Gloo, into one module,
   ``torch/_hpct_c10d`` (``src/torch_c10d/``: the bindings and the CMake project);
3. the module is checked: every symbol it needs is defined by the libraries it will load, and
   it shares torch's pybind11 internals;
4. the wheel is written as ``torch-<v>+hpct.<series id>-<tag>-<tag>-<platform>.whl``: version,
   RECORD and ``torch/_hpct_series.json`` (the record of this build) rewritten, every other
   member copied as it lies (``wheelzip``); the platform is the one the module's glibc needs.

Finished wheels are kept in the build cache (``build_cache``) under a key of every input, so a
second run, or another clone, takes the wheel in seconds.  The build log is
``third_party/build/torch-wheel-<v>/<tag>/build.log``; errors name it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import zipfile
from pathlib import Path

from ..elf import manylinux_tag, read_elf
from ..errors import BuildError, ConfigError
from . import build_cache, torch_inputs
from .builder import require_tools, run_logged
from .layout import Layout
from .patches import _patch_tool, file_subset, load_series, patch
from .progress import Progress
from .sources import Manifest, fetch, load_manifest
from .torch_inputs import Target
from .wheelzip import rewrite

RECIPE = 1                         # bump when the same inputs should give another wheel
KEEP_CACHED = 3                    # finished wheels kept in the build cache per CPython
MODULE = "_hpct_c10d"
RECORD = "torch/_hpct_series.json"
SCHEMA_VERSION = 1
WHEEL_PART = "wheel"               # patches/pytorch/<v>/wheel: this recipe's own patches
SOURCES = "src/torch_c10d"         # the module's bindings and CMake project
# The recipe's own code decides the output too: its files are part of the cache key.
_RECIPE_FILES = ("hpct/builder/torch_wheel.py", "hpct/builder/torch_inputs.py", "hpct/builder/wheelzip.py",
                 "build_scripts/gloo.cmake", "build_scripts/compiler_cache.cmake",
                 "src/nccl_rootless/nccl_rootless.h")   # the NCCL series' header the module compiles with
# Where the installed module finds torch/lib and the NVIDIA wheels' libraries (libtorch_cuda's own way).
RUNPATH = "$ORIGIN/lib:$ORIGIN/../nvidia/cuda_runtime/lib:$ORIGIN/../nvidia/nccl/lib"
# Libraries any Linux provides; the module's other needs must be met by what the wheel brings.
_SYSTEM_LIBS = ("libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "libpthread.so.0", "libdl.so.2",
                "librt.so.1", "ld-linux-x86-64.so.2")


def local_version(m: Manifest, series_id: str) -> str:
    return f"{m.version}+hpct.{series_id}"


def build(layout: Layout, m: Manifest, progress: Progress, specs: list[str], *, dist: Path | None = None,
          given: Path | None = None, jobs: int | None = None, nccl: bool = True) -> list[Path]:
    """Build one wheel per target interpreter into ``dist``; returns their paths."""
    if m.name != "pytorch":
        raise ConfigError(f"wheel torch=... builds from the pytorch manifest, not {m.name}", fix="use torch=VERSION")
    tools = require_tools(["cmake", "ninja", "c++", "patch", "nm"])
    found = torch_inputs.targets(m, specs)
    if given is not None:
        if len(found) != 1:
            raise ConfigError("--torch-wheel is one CPython's wheel", fix="pass exactly one --python with it")
        torch_inputs.fetch_wheel(layout, m, found[0], progress, given)      # a wrong file fails first
    gloo = load_manifest(layout, "gloo")
    for component in (m, gloo):
        fetch(layout, component, progress)
        patch(layout, component, progress)
    series = [load_series(layout, m), load_series(layout, m, WHEEL_PART)]
    gloo_series = load_series(layout, gloo)
    inputs = {"series_id": series[0].identity(), "wheel_series_id": series[1].identity(),
              "gloo_series_id": gloo_series.identity(), "recipe": RECIPE, "nccl": nccl,
              "sources": _digest(layout, [SOURCES, *_RECIPE_FILES]), "compiler": _compiler(tools["c++"]),
              "pins": {k: v for k, v in m.extra["wheel"].items() if k != "files"}}
    dist = Path(dist or layout.dist)
    out = []
    for target in found:
        out.append(_one(layout, m, progress, target, series, inputs, dist, given, jobs, tools))
    return out


def _one(layout: Layout, m: Manifest, progress: Progress, target: Target, series, inputs: dict, dist: Path,
         given: Path | None, jobs: int | None, tools: dict) -> Path:
    wheel = torch_inputs.fetch_wheel(layout, m, target, progress, given)
    key_inputs = {**inputs, "wheel": target.pin["sha256"], "tag": target.tag}
    key = build_cache.key(key_inputs)
    name = f"torch-wheel-{m.version}"
    cached = Path(tempfile.mkdtemp(prefix=".torch-wheel-", dir=_mkdir(dist)))
    try:
        if build_cache.enabled() and build_cache.take(name, target.tag, key, cached / "w"):
            got = next((cached / "w").glob("*.whl"))
            os.replace(got, dist / got.name)
            progress.step(f"{got.name}: taken from the build cache (key {key})")
            return dist / got.name
    finally:
        shutil.rmtree(cached, ignore_errors=True)
    started = time.monotonic()
    work = layout.build("torch-wheel", m.version) / target.tag
    log = work / "build.log"
    work.mkdir(parents=True, exist_ok=True)
    log.write_text(f"# hpct-build wheel torch={m.version} for {target.tag} (series {inputs['series_id']})\n")
    progress.step(f"building torch {m.version} for {target.tag}; log: {log}")
    torch_root = torch_inputs.unpack_wheel(wheel, target.pin["sha256"], work / "wheel", progress)
    module, lib_dirs = _compile(layout, m, progress, target, torch_root, work, log, jobs, tools, inputs["nccl"])
    facts = _check_module(module, lib_dirs, log)
    built = _assemble(layout, m, target, wheel, series, module, facts, {**inputs, "key": key}, dist,
                      time.monotonic() - started)
    progress.step(f"wheel: {built} ({built.stat().st_size / 1e6:.0f} MB) in {time.monotonic() - started:.0f} s")
    if build_cache.enabled():
        with tempfile.TemporaryDirectory(prefix=".torch-wheel-", dir=dist) as tmp:
            os.link(built, Path(tmp) / built.name)
            build_cache.store(name, target.tag, key, Path(tmp), key_inputs)
        # 0.8 GB an entry, one per change of any input: the newest few stay.
        kept = sorted(build_cache.root().glob(f"{name}-{target.tag}-*"), key=lambda p: p.stat().st_mtime)
        for old in kept[:-KEEP_CACHED]:
            shutil.rmtree(old, ignore_errors=True)
    return built


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _digest(layout: Layout, names: list[str]) -> str:
    h = hashlib.sha256()
    base = Path(__file__).resolve().parents[2]          # the tree this recipe runs from
    for name in names:
        root = layout.root / name if (layout.root / name).exists() else base / name
        for path in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if path.is_file() and "__pycache__" not in path.parts:
                h.update(f"{path.relative_to(root.parent).as_posix()}\0".encode() + path.read_bytes())
    return h.hexdigest()[:16]


def _compiler(cxx: str) -> str:
    proc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    return proc.stdout.splitlines()[0] if proc.stdout else cxx


C10D = "torch/csrc/distributed/c10d"


def _snapshot(patched: Path, series, torch_root: Path, dest: Path) -> Path:
    """What the compile takes from the patched tree, copied aside (a later ``hpct-build patch``
    cannot change it under a running build): the c10d units (src/torch_c10d/CMakeLists.txt compiles
    some), the series' changed headers (first on
    the include path, ahead of the wheel's stock copies) and the c10d headers the wheel lacks
    (control_plane/, for FlightRecorder).  Nothing else of the tree: a stock header of the tree would
    shadow the wheel's own, which the wheel's libraries were built with."""
    from .patches import touched_files
    shutil.rmtree(dest, ignore_errors=True)
    wheel_include = torch_root / "include"
    wanted = [rel for rel in touched_files(series) if rel.endswith((".h", ".hpp"))]
    wanted += [p.relative_to(patched).as_posix() for p in sorted((patched / C10D).glob("*.cpp"))]
    wanted += [p.relative_to(patched).as_posix() for p in sorted((patched / C10D).rglob("*.h*"))
               if not (wheel_include / p.relative_to(patched)).exists()]
    for rel in sorted(set(wanted)):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(patched / rel, dest / rel)
    return dest


def _compile(layout: Layout, m: Manifest, progress: Progress, target: Target, torch_root: Path, work: Path,
             log: Path, jobs: int | None, tools: dict, nccl: bool) -> tuple[Path, list[Path]]:
    gloo = load_manifest(layout, "gloo")
    tree = _snapshot(layout.patched(m.name, m.version), load_series(layout, m), torch_root, work / "src")
    gloo_tree = work / "gloo-src"
    shutil.rmtree(gloo_tree, ignore_errors=True)
    shutil.copytree(layout.patched(gloo.name, gloo.version), gloo_tree)
    internals, abi = torch_inputs.pybind11_abi(torch_root / "lib" / "libtorch_python.so")
    defs = {"HPCT_TORCH_ROOT": torch_root, "HPCT_TREE": tree, "HPCT_GLOO_SOURCE": gloo_tree,
            "HPCT_PYTHON_INCLUDE": target.include, "HPCT_PYBIND11_ABI": abi,
            "HPCT_CXX11_ABI": _cxx11_abi(torch_root / "lib" / "libc10.so"),
            "HPCT_EXTRA_INCLUDE": torch_inputs.extra_headers(layout, m, progress) if nccl else tree,
            "HPCT_MODULE_SUFFIX": target.suffix, "HPCT_WITH_NCCL": "ON" if nccl else "OFF",
            "HPCT_CCACHE_BASEDIR": layout.root}
    lib_dirs = [torch_root / "lib"]
    if nccl:
        include, lib = torch_inputs.nccl_inputs(layout, m, progress)
        cuda_includes, cudart = torch_inputs.cudart(layout, progress)
        defs.update(HPCT_NCCL_INCLUDES=include, HPCT_NCCL_LIBRARY=lib, HPCT_CUDART_LIBRARY=cudart,
                    HPCT_CUDA_INCLUDES=";".join(map(str, cuda_includes)))
        lib_dirs += [cudart.parent, lib.parent]
    obj = work / "obj"
    # __FILE__ in messages names the trees by version, not by this machine's paths; with ccache the
    # compiler sees them relative to the build folder (its base folder rewrite): map that spelling too.
    maps = " ".join(f"-ffile-prefix-map={spelling}={label}" for path, label in
                    ((gloo_tree, f"gloo-{gloo.version}"), (tree, f"pytorch-{m.version}"))
                    for spelling in (path, os.path.relpath(path, obj)))
    run_logged([tools["cmake"], "-G", "Ninja", "-S", _source_dir(layout), "-B", obj, "-DCMAKE_BUILD_TYPE=Release",
                f"-DCMAKE_CXX_FLAGS={maps}", *(f"-D{k}={v}" for k, v in defs.items())],
               log, progress, "cmake configure")
    run_logged([tools["ninja"], "-C", obj, f"-j{jobs or os.cpu_count() or 2}", MODULE], log, progress,
               f"compiling the c10d units for {target.tag}")
    module = obj / f"{MODULE}{target.suffix}"
    if not module.is_file():
        raise BuildError(f"the build made no {module.name}", fix=f"see the log: {log}")
    return module, lib_dirs


def _cxx11_abi(libc10: Path) -> str:
    """The wheel's libstdc++ string ABI, read from how libc10 spells c10's check-failure function,
    which takes a std::string: ``Ss`` under the old ABI, ``__cxx11`` under the new one."""
    names = _symbols(str(libc10), "--defined-only")
    if "_ZN3c106detail14torchCheckFailEPKcS2_jRKSs" in names:
        return "0"
    if any(n.startswith("_ZN3c106detail14torchCheckFail") and "cxx11" in n for n in names):
        return "1"
    raise BuildError(f"{libc10} does not say which C++ string ABI it uses", fix="use the pinned torch wheel")


def _source_dir(layout: Layout) -> Path:
    here = layout.root / SOURCES
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / SOURCES


def _check_module(module: Path, lib_dirs: list[Path], log: Path) -> dict:
    """Every symbol the module needs is defined by a library it names (as --no-undefined would
    say, the interpreter's own C API aside), its RUNPATH finds torch's and NVIDIA's libraries
    where the wheel installs them, and what it needs of the system (glibc, libstdc++)."""
    dyn = subprocess.run(["objdump", "-p", str(module)], capture_output=True, text=True, timeout=120).stdout
    needed = re.findall(r"^\s*NEEDED\s+(\S+)", dyn, re.MULTILINE)
    runpath = re.findall(r"^\s*(?:RUNPATH|RPATH)\s+(\S+)", dyn, re.MULTILINE)
    if runpath != [RUNPATH]:
        raise BuildError(f"{module.name} has RUNPATH {runpath}, not {RUNPATH}", fix=f"see the log: {log}")
    # The libraries these need in turn (cuDNN, cuBLAS, ...) come with torch's NVIDIA wheels at run
    # time and are not here: only the module's own NEEDED entries must resolve.
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(map(str, lib_dirs))}
    ldd = subprocess.run(["ldd", str(module)], capture_output=True, text=True, timeout=120, env=env).stdout
    where = dict(re.findall(r"^\s*(\S+) => (/\S+)", ldd, re.MULTILINE))
    where.update((Path(p).name, p) for p in re.findall(r"^\s*(/\S+) \(", ldd, re.MULTILINE))   # the loader
    missing = [n for n in needed if n not in where]
    if missing:
        raise BuildError(f"{module.name} needs libraries that are not there: {', '.join(missing)}",
                         fix=f"see the log: {log}")
    defined: set[str] = set()
    for name in needed:
        defined.update(_symbols(where[name], "--defined-only"))
    wanted = _symbols(str(module), "--undefined-only", strong=True)
    unresolved = sorted(s for s in wanted if s not in defined and not s.startswith(("Py", "_Py")))
    if unresolved:
        raise BuildError(f"{module.name} needs {len(unresolved)} symbol(s) no library it names defines, first: "
                         + ", ".join(unresolved[:5]), fix=f"see the log: {log}")
    info = read_elf(module)
    glibcxx = info.max_version("GLIBCXX")
    needs = [f"glibc {'.'.join(map(str, info.max_version('GLIBC')))}"]
    if glibcxx:
        needs.append(f"libstdc++ with GLIBCXX_{'.'.join(map(str, glibcxx))}")
    return {"platform": manylinux_tag(info), "needs": needs, "links": sorted(set(needed) - set(_SYSTEM_LIBS)),
            "symbols_resolved": len(wanted)}


def _symbols(path: str, which: str, strong: bool = False) -> set[str]:
    proc = subprocess.run(["nm", "-D", which, path], capture_output=True, text=True, timeout=300)
    out = set()
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and (not strong or parts[-2] == "U"):
            out.add(parts[-1].split("@")[0])
    return out


def python_changes(series, wheel: Path, scratch: Path) -> dict[str, bytes]:
    """The wheel's Python files as the series (in order) changes them, applied with ``patch``."""
    py = lambda name: name.endswith(".py")       # noqa: E731
    names = {n for s in series for p in s.paths for n in _names(p) if py(n)}
    with zipfile.ZipFile(wheel) as z:
        present = set(z.namelist())
        for name in sorted(names & present):
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            (scratch / name).write_bytes(z.read(name))
    for s in series:
        for path in s.paths:
            text = file_subset(path, py)
            if not text:
                continue
            proc = subprocess.run([_patch_tool(), "-p1", "--batch", "--forward", "--fuzz=0",
                                   "--no-backup-if-mismatch", "--reject-file=-", "-d", str(scratch)],
                                  input=text, capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise BuildError(f"{path.name} does not apply to the wheel's files: {proc.stdout.strip()[-300:]}",
                                 fix="the series' base must be the wheel's own torch version")
    return {name: (scratch / name).read_bytes() for name in sorted(names)}


def _names(path: Path) -> list[str]:
    return re.findall(r"^diff --git a/\S+ b/(\S+)$", path.read_text(), re.MULTILINE)


def _assemble(layout: Layout, m: Manifest, target: Target, wheel: Path, series, module: Path, facts: dict,
              inputs: dict, dist: Path, seconds: float) -> Path:
    version = local_version(m, inputs["series_id"])
    platform = facts["platform"]
    dist_info, new_dist_info = f"torch-{m.version}.dist-info", f"torch-{version}.dist-info"
    with tempfile.TemporaryDirectory(prefix="torch-py-") as tmp:
        changes = python_changes(series, wheel, Path(tmp))
    with zipfile.ZipFile(wheel) as z:
        version_py = _sub(z.read("torch/version.py").decode(), r"^__version__ = '[^']*'$",
                          f"__version__ = '{version}'", "torch/version.py")
        metadata = _sub(z.read(f"{dist_info}/METADATA").decode(), rf"^Version: {re.escape(m.version)}$",
                        f"Version: {version}", "METADATA")
        wheel_file = _sub(z.read(f"{dist_info}/WHEEL").decode(), r"^Tag: .*$",
                          f"Tag: {target.tag}-{target.tag}-{platform}", "WHEEL")
    record = {"schema_version": SCHEMA_VERSION, "torch": m.version, "version": version, "python": target.tag,
              "series_id": inputs["series_id"], "wheel_series_id": inputs["wheel_series_id"],
              "gloo_series_id": inputs["gloo_series_id"],
              "patches": [e.patch for s in series for e in s.entries], "base_wheel": dict(target.pin),
              "module": {"file": f"torch/{module.name}", "nccl": inputs["nccl"], **facts},
              "recipe": {"key": inputs["key"], "compiler": inputs["compiler"], "seconds": round(seconds, 1)}}
    changes.update({"torch/version.py": version_py.encode(), f"{new_dist_info}/METADATA": metadata.encode(),
                    f"{new_dist_info}/WHEEL": wheel_file.encode(), f"torch/{module.name}": module.read_bytes(),
                    RECORD: (json.dumps(record, indent=2) + "\n").encode()})
    dest = dist / f"torch-{version}-{target.tag}-{target.tag}-{platform}.whl"
    return rewrite(wheel, dest, dist_info=dist_info, new_dist_info=new_dist_info, changes=changes,
                   modes={f"torch/{module.name}": 0o755})


def _sub(text: str, pattern: str, repl: str, what: str) -> str:
    out, n = re.subn(pattern, repl, text, count=1, flags=re.MULTILINE)
    if n != 1:
        raise BuildError(f"the wheel's {what} has no line matching {pattern!r}",
                         fix="this recipe knows the pinned torch wheels only")
    return out
