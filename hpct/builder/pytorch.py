"""The PyTorch 2.6.0 recipe: a wheel built from the patched tree with the patched Gloo inside.

``plan()`` computes everything a build does (the environment, each command, where
the patched Gloo goes, the wheel's local version) without touching the disk, so
``hpct-build build pytorch --dry-run`` prints exactly what ``build()`` runs and
tests can check it.  ``build()`` executes that plan, logging into
``third_party/build/pytorch-<version>/build.log``.

A real build needs the upstream release tarball (``pytorch-v2.6.0.tar.gz``, with
its ``third_party/`` submodules): Debian's dfsg repack strips them and can only be
patched and have its changed units compiled.  docs/pytorch-build.md lists the
resources a real build needs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, SourceError, ToolchainError
from .builder import require_tools, run_logged
from .cuda import DEFAULT_CUDA as TORCH_CUDA   # torch 2.6.0's cu124 wheels
from .layout import Layout, write_atomic
from .locks import one_at_a_time
from .patches import load_series
from .progress import Progress
from .sources import Manifest, fetch, fetched_info, load_manifest

UPSTREAM_TARBALL = "pytorch-v{version}.tar.gz"

# Submodule folders a build needs (relative to third_party/); the dfsg repack has none.
# third_party/gloo is not listed: the recipe replaces it with the patched Gloo.
CPU_SUBMODULES = (
    "pybind11", "fmt", "sleef", "cpuinfo", "pthreadpool", "FP16", "FXdiv", "psimd",
    "XNNPACK", "NNPACK", "fbgemm", "ideep", "onnx", "protobuf", "flatbuffers", "kineto",
    "tensorpipe", "cpp-httplib", "nlohmann", "pocketfft", "googletest",
)
CUDA_SUBMODULES = ("cutlass", "cudnn_frontend", "NVTX")
BUNDLED_NCCL = "nccl/nccl"

# Python modules setup.py imports before it starts CMake (requirements.txt of 2.6.0).
PYTHON_REQUIREMENTS = {"yaml": "pyyaml", "typing_extensions": "typing-extensions",
                       "setuptools": "setuptools", "wheel": "wheel", "numpy": "numpy"}
TOOLS = ("cmake", "ninja", "c++", "cc", "patch")

ARCH_RE = re.compile(r"^\d+\.\d+a?(\+PTX)?$")
DEFAULT_CUDA_ARCH = "8.0;9.0"   # A100 and H100, HyperPod's GPUs
# The header hpct's NCCL series installs beside nccl.h; ProcessGroupNCCL's rootless path
# (patches 0009-0011) is compiled in only when the NCCL include folder has it.
ROOTLESS_HEADER = "nccl_rootless.h"


@dataclass
class Step:
    what: str
    cmd: list[str]
    cwd: str | None = None

    def shell(self) -> str:
        line = " ".join(_quote(c) for c in self.cmd)
        return f"(cd {_quote(self.cwd)} && {line})" if self.cwd else line


@dataclass
class Plan:
    version: str
    local_version: str
    series_id: str
    gloo_series_id: str
    source: dict
    patched: str
    gloo_patched: str
    work_tree: str
    gloo_placement: str
    dist: str
    wheel_glob: str
    log: str
    cuda: bool
    nccl: dict
    env: dict[str, str]
    steps: list[Step] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    blockers: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "version", "local_version", "series_id", "gloo_series_id", "source", "patched",
            "gloo_patched", "work_tree", "gloo_placement", "dist", "wheel_glob", "log", "cuda",
            "nccl", "env")}
        d["steps"] = [{"what": s.what, "cmd": s.cmd, "cwd": s.cwd} for s in self.steps]
        d["warnings"] = list(self.warnings)
        d["blockers"] = list(self.blockers)
        d["ready"] = not self.blockers
        return d

    def render(self) -> str:
        out = [f"# hpct-build build pytorch --dry-run: torch {self.local_version}",
               f"# series {self.series_id} (pytorch) + {self.gloo_series_id} (gloo); "
               f"{'CUDA' if self.cuda else 'CPU only'}",
               f"# NCCL: {_nccl_line(self.nccl)}",
               f"# source: {self.source['path']} (provider: {self.source['provider'] or 'not fetched'})"]
        for w in self.warnings:
            out.append(f"# WARNING: {w}")
        for b in self.blockers:
            out.append(f"# BLOCKER: {b}")
        out.append("")
        out.append("# environment of setup.py")
        out += [f"export {k}={_quote(v)}" for k, v in self.env.items()]
        out.append("")
        for n, step in enumerate(self.steps, 1):
            out.append(f"# {n}. {step.what}")
            out.append(step.shell())
        out.append("")
        out.append(f"# wheel: {self.dist}/{self.wheel_glob}")
        out.append(f"# log:   {self.log}")
        return "\n".join(out)


def _nccl_line(nccl: dict) -> str:
    kind = nccl.get("kind")
    if kind is None:
        return "none (CPU build: USE_NCCL=0)"
    if kind == "bundled":
        return "PyTorch's bundled, unpatched NCCL (USE_SYSTEM_NCCL=0); no rootless ProcessGroupNCCL"
    what = (f"hpct's patched NCCL {nccl.get('version')}" + (f", built with CUDA {nccl['cuda']}" if nccl.get("cuda")
                                                          else "") if kind == "hpct" else "the NCCL")
    rootless = "rootless ProcessGroupNCCL" if nccl.get("rootless") else f"no {ROOTLESS_HEADER}: no rootless path"
    return f"{what} at {nccl['prefix']} (USE_SYSTEM_NCCL=1); {rootless}"


def _quote(s: str | None) -> str:
    s = "" if s is None else str(s)
    return s if re.fullmatch(r"[A-Za-z0-9_./:=+,@%-]+", s) else "'" + s.replace("'", "'\\''") + "'"


def parse_cuda_arch(text: str) -> str:
    """'8.0;9.0' or '8.0 9.0+PTX' -> '8.0;9.0+PTX', or a ConfigError naming --cuda-arch."""
    items = [a for a in re.split(r"[;\s,]+", text.strip()) if a]
    bad = [a for a in items if not ARCH_RE.match(a)]
    if not items or bad:
        raise ConfigError(f"--cuda-arch {text!r}: {', '.join(bad) or 'empty'} is not a compute capability",
                          fix="give capabilities such as --cuda-arch '8.0;9.0' (optionally with +PTX)")
    return ";".join(items)


def _nccl_choice(layout: Layout, nccl: str | None) -> dict:
    """Which NCCL a CUDA build links: hpct's patched build (default), PyTorch's bundled one, or a prefix.

    ``rootless`` says whether the prefix has hpct's ``nccl_rootless.h`` (then the torch's
    ProcessGroupNCCL has its rootless path); ``cuda`` is the CUDA hpct's NCCL was built with.
    """
    choice = nccl or "hpct"
    if choice == "bundled":
        return {"kind": "bundled", "prefix": None, "rootless": False}
    if choice == "hpct":
        m = load_manifest(layout, "nccl")
        prefix = layout.build(m.name, m.version) / "install"
        from .nccl import built_info          # the stamp of `hpct-build build nccl`
        stamp = built_info(layout, m) or {}
        return {"kind": "hpct", "prefix": str(prefix), "version": m.version,
                "rootless": (prefix / "include" / ROOTLESS_HEADER).is_file(), "cuda": stamp.get("cuda"),
                "series_id": stamp.get("series_id")}
    prefix = Path(choice).expanduser().resolve()
    return {"kind": "prefix", "prefix": str(prefix), "rootless": (prefix / "include" / ROOTLESS_HEADER).is_file()}


def plan(layout: Layout, m: Manifest, *, cuda: bool = False, cuda_arch: str | None = None,
         nccl: str | None = None, jobs: int | None = None, python: str | None = None) -> Plan:
    """Everything ``build()`` would do, computed without touching the disk."""
    if not cuda and (cuda_arch is not None or nccl is not None):
        raise ConfigError("--cuda-arch and --nccl apply to a CUDA build only", fix="add --cuda, or drop them")
    python = python or sys.executable
    gloo = load_manifest(layout, "gloo")
    series, gloo_series = load_series(layout, m), load_series(layout, gloo)
    series_id, gloo_id = series.identity(), gloo_series.identity()
    local_version = f"{m.version}+hpct.{series_id}"
    src = layout.source(m.name, m.version)
    fetched = fetched_info(layout, m)
    out = layout.build(m.name, m.version)
    work = out / "src"
    patched = layout.patched(m.name, m.version)
    gloo_patched = layout.patched(gloo.name, gloo.version)
    tarball = UPSTREAM_TARBALL.format(version=m.version)

    warnings: list[str] = []
    blockers: list[str] = []
    provider = (fetched or {}).get("provider")
    if fetched is None:
        blockers.append(f"pytorch {m.version} is not fetched; for a real build: "
                        f"hpct-build fetch pytorch --source {tarball}")
    else:
        wanted = CPU_SUBMODULES + (CUDA_SUBMODULES if cuda else ())
        if cuda and _nccl_choice(layout, nccl)["kind"] == "bundled":
            wanted += (BUNDLED_NCCL,)
        missing = [d for d in wanted if not _non_empty(src / "third_party" / d)]
        if provider == "debian":
            warnings.append(
                f"the fetched tree is Debian's dfsg repack ({fetched.get('archive')}): it has no third_party/ "
                f"submodules, so it can be patched and its changed units compiled, but not built into a wheel; "
                f"a real build needs the upstream release tarball: "
                f"hpct-build fetch pytorch --force --source {tarball}")
        if missing:
            blockers.append(f"the source tree lacks {len(missing)} third_party submodule(s) "
                            f"({', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''}); "
                            f"fetch the upstream release tarball: hpct-build fetch pytorch --force --source {tarball}")

    env: dict[str, str] = {
        "PYTORCH_BUILD_VERSION": local_version,
        "PYTORCH_BUILD_NUMBER": "1",
        "MAX_JOBS": str(jobs or os.cpu_count() or 1),
        "CMAKE_BUILD_TYPE": "Release",
        "BUILD_TEST": "0",
        "USE_DISTRIBUTED": "1",
        "USE_GLOO": "1",
        "USE_SYSTEM_GLOO": "0",
        "USE_MPI": "0",
        "USE_ROCM": "0",
        "USE_XPU": "0",
        "USE_CUDA": "1" if cuda else "0",
    }
    nccl_info: dict = {"kind": None, "prefix": None, "rootless": False}
    if cuda:
        env["TORCH_CUDA_ARCH_LIST"] = parse_cuda_arch(DEFAULT_CUDA_ARCH if cuda_arch is None else cuda_arch)
        env["USE_NCCL"] = "1"
        nccl_info = _nccl_choice(layout, nccl)
        if nccl_info["kind"] == "bundled":
            env["USE_SYSTEM_NCCL"] = "0"
            warnings.append("--nccl bundled links PyTorch's own, unpatched NCCL: no rootless NCCL start-up")
        else:
            prefix = Path(nccl_info["prefix"])
            env.update({"USE_SYSTEM_NCCL": "1", "NCCL_ROOT": str(prefix),
                        "NCCL_INCLUDE_DIR": str(prefix / "include"), "NCCL_LIB_DIR": str(prefix / "lib")})
            if not (prefix / "include" / "nccl.h").is_file():
                blockers.append(f"no NCCL at {prefix} (include/nccl.h missing): "
                                + ("build hpct's patched NCCL first (hpct-build fetch nccl --source ...; "
                                   "hpct-build build nccl)"
                                   if nccl_info["kind"] == "hpct" else "pass --nccl PREFIX of an NCCL install"))
            elif not nccl_info["rootless"]:
                missing = (f"the NCCL at {prefix} has no include/{ROOTLESS_HEADER}, so the torch gets no "
                           "rootless ProcessGroupNCCL (HPCT_USE_ROOTLESS=1 with backend nccl will be refused)")
                if nccl_info["kind"] == "hpct":
                    blockers.append(f"{missing}; rebuild hpct's NCCL: hpct-build build nccl")
                else:
                    warnings.append(f"{missing}; for rootless NCCL use --nccl hpct")
    else:
        env["USE_NCCL"] = "0"

    hpct_build = [python, "-m", "hpct.builder"]
    dist = out / "dist"
    steps = [
        Step("apply the pytorch series (third_party/patched)", hpct_build + ["patch", "pytorch", "--root", str(layout.root)]),
        Step("apply the gloo series (third_party/patched)", hpct_build + ["patch", "gloo", "--root", str(layout.root)]),
        Step("remove the previous work tree and wheel", ["rm", "-rf", str(work), str(dist)]),
        Step("work tree: a copy of the patched pytorch tree (setup.py builds in place)",
             ["cp", "-a", str(patched), str(work)]),
        Step("remove the Gloo the tree vendors", ["rm", "-rf", str(work / "third_party" / "gloo")]),
        Step("put the patched Gloo where PyTorch's CMake expects it (cmake/Dependencies.cmake: "
             "add_subdirectory(third_party/gloo) when USE_SYSTEM_GLOO=0)",
             ["cp", "-a", str(gloo_patched), str(work / "third_party" / "gloo")]),
        Step("build the wheel (no build isolation: the environment above is the build's)",
             [python, "setup.py", "bdist_wheel", "--dist-dir", str(dist)], cwd=str(work)),
    ]
    missing_py = [pkg for mod, pkg in PYTHON_REQUIREMENTS.items() if importlib.util.find_spec(mod) is None]
    if missing_py:
        blockers.append(f"missing Python build requirement(s): {', '.join(missing_py)} "
                        f"(pip install {' '.join(missing_py)})")
    try:
        require_tools(list(TOOLS))
    except ToolchainError as err:     # a blocker to list, not an error: --dry-run still prints the plan
        blockers.append(f"{err.problem} ({err.fix})")
    if cuda and shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        blockers.append(f"no CUDA toolkit (nvcc not on PATH and CUDA_HOME unset); torch {m.version}'s own "
                        f"wheels use CUDA {TORCH_CUDA}: set CUDA_HOME to a CUDA {TORCH_CUDA} toolkit with cuDNN")
    if cuda and nccl_info.get("cuda") and nccl_info["cuda"] != TORCH_CUDA:
        warnings.append(f"hpct's NCCL was built with CUDA {nccl_info['cuda']}, torch {m.version}'s wheels "
                        f"use CUDA {TORCH_CUDA}: build torch with the same CUDA as its NCCL")

    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return Plan(
        version=m.version, local_version=local_version, series_id=series_id, gloo_series_id=gloo_id,
        source={"path": str(src), "provider": provider, "archive": (fetched or {}).get("archive")
                or (fetched or {}).get("path"), "upstream_tarball": tarball},
        patched=str(patched), gloo_patched=str(gloo_patched), work_tree=str(work),
        gloo_placement=str(work / "third_party" / "gloo"), dist=str(out / "dist"),
        wheel_glob=f"torch-{local_version}-{tag}-{tag}-linux_*.whl", log=str(out / "build.log"),
        cuda=cuda, nccl=nccl_info, env=env, steps=steps, warnings=warnings, blockers=blockers)


def _non_empty(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


@one_at_a_time
def build(layout: Layout, m: Manifest, progress: Progress, *, cuda: bool = False, cuda_arch: str | None = None,
          nccl: str | None = None, jobs: int | None = None) -> Path:
    """Run the plan's steps in order (patch both trees, lay out the work tree, setup.py bdist_wheel)."""
    fetch(layout, m, progress)
    p = plan(layout, m, cuda=cuda, cuda_arch=cuda_arch, nccl=nccl, jobs=jobs)
    if p.blockers:
        source_problem = any("submodule" in b or "not fetched" in b or "no NCCL" in b for b in p.blockers)
        kind = SourceError if source_problem else ToolchainError
        raise kind("cannot build torch " + p.local_version + ":\n  - " + "\n  - ".join(p.blockers),
                   fix=f"see `hpct-build build pytorch --dry-run` and docs/pytorch-build.md; the usual fix is "
                       f"hpct-build fetch pytorch --force --source {p.source['upstream_tarball']}")
    log = Path(p.log)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"# hpct-build build pytorch {p.local_version}\n" + json.dumps(p.as_dict(), indent=2) + "\n")
    env = {**os.environ, **p.env}
    started = time.monotonic()
    progress.step(f"building torch {p.local_version} ({p.env['MAX_JOBS']} jobs); log: {log}")
    for step in p.steps:     # exactly the commands --dry-run prints
        progress.step(step.what)
        run_logged(step.cmd, log, progress, step.what.split(" (")[0], cwd=Path(step.cwd) if step.cwd else None,
                   env=env, timeout=16 * 3600)
    wheels = sorted(Path(p.dist).glob(p.wheel_glob))
    if not wheels:
        from ..errors import BuildError
        raise BuildError(f"setup.py finished but no {p.wheel_glob} is in {p.dist}", fix=f"see the log: {log}")
    info = {**p.as_dict(), "wheel": str(wheels[-1]), "seconds": round(time.monotonic() - started, 1)}
    write_atomic(Path(p.dist) / "hpct-build.json", json.dumps(info, indent=2) + "\n")
    progress.step(f"torch {p.local_version} built in {info['seconds']} s: {wheels[-1]}")
    return wheels[-1]
