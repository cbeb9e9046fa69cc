"""The compiled half of ``hpct-build wheel torch=VERSION``: ``torch/_hpct_c10d`` and its checks.

The series' changed c10d units (and FlightRecorder, which torch does not export) are compiled with
hpct's patched Gloo against the unpacked torch wheel by ``src/torch_c10d/CMakeLists.txt``; what the
compile reads of the patched trees is copied aside first.  The module is then checked as a linker
with ``--no-undefined`` would (the interpreter's C API aside), its RUNPATH is the one the installed
wheel needs, and its glibc and libstdc++ needs are read for the wheel's platform tag and record.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from ..elf import manylinux_tag, read_elf
from ..errors import BuildError
from . import torch_inputs
from .builder import run_logged
from .layout import Layout
from .patches import load_series
from .progress import Progress
from .sources import Manifest, load_manifest
from .torch_inputs import Target

MODULE = "_hpct_c10d"
SOURCES = "src/torch_c10d"         # the module's bindings and CMake project

# Where the installed module finds torch/lib and the NVIDIA wheels' libraries (libtorch_cuda's own way).
RUNPATH = "$ORIGIN/lib:$ORIGIN/../nvidia/cuda_runtime/lib:$ORIGIN/../nvidia/nccl/lib"
# Libraries any Linux provides; the module's other needs must be met by what the wheel brings.
_SYSTEM_LIBS = ("libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "libpthread.so.0", "libdl.so.2",
                "librt.so.1", "ld-linux-x86-64.so.2")
C10D = "torch/csrc/distributed/c10d"


def _snapshot(patched: Path, series, torch_root: Path, dest: Path) -> Path:
    """What the compile takes from the patched tree, copied aside (a later ``hpct-build patch``
    cannot change it under a running build): the c10d units (src/torch_c10d/CMakeLists.txt compiles
    some), the series' changed headers (first on the include path, ahead of the wheel's stock
    copies) and the c10d headers the wheel lacks (control_plane/, for FlightRecorder).  Nothing else
    of the tree: a stock header of the tree would shadow the wheel's own, which the wheel's
    libraries were built with."""
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


def compile_module(layout: Layout, m: Manifest, progress: Progress, target: Target, torch_root: Path, work: Path,
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


def check_module(module: Path, lib_dirs: list[Path], log: Path) -> dict:
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
