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

from ..errors import BuildError, ConfigError
from . import build_cache, torch_inputs
from .builder import require_tools
from .layout import Layout
from .patches import _patch_tool, file_subset, load_series, patch
from .progress import Progress
from .sources import Manifest, fetch, load_manifest
from .torch_inputs import Target
from .torch_module import SOURCES, check_module, compile_module
from .wheelzip import rewrite

RECIPE = 1                         # bump when the same inputs should give another wheel
KEEP_CACHED = 3                    # finished wheels kept in the build cache per CPython
RECORD = "torch/_hpct_series.json"
SCHEMA_VERSION = 1
WHEEL_PART = "wheel"               # patches/pytorch/<v>/wheel: this recipe's own patches
# The recipe's own code decides the output too: its files are part of the cache key.
_RECIPE_FILES = ("hpct/builder/torch_wheel.py", "hpct/builder/torch_inputs.py", "hpct/builder/torch_module.py",
                 "hpct/builder/wheelzip.py",
                 "build_scripts/gloo.cmake", "build_scripts/compiler_cache.cmake",
                 "src/nccl_rootless/nccl_rootless.h")   # the NCCL series' header the module compiles with
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
    module, lib_dirs = compile_module(layout, m, progress, target, torch_root, work, log, jobs, tools,
                                      inputs["nccl"])
    facts = check_module(module, lib_dirs, log)
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
