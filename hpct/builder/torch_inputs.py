"""The inputs of ``hpct-build wheel torch=VERSION``, each pinned and verified before use.

* PyPI's torch wheel for the target CPython (``third_party/pytorch.toml``'s ``[wheel.files]``);
  its headers and libraries are what the module compiles and links against.
* The NCCL that torch pins (``[wheel.nccl]``): ``nccl.h`` and the library to link, plus hpct's
  ``nccl_rootless.h`` as the NCCL series adds it.
* CUDA 12.4 headers and ``libcudart.so.12`` from NVIDIA's PyPI wheels (``hpct.builder.cuda``).
* Debian's header-only packages the wheel lacks (``[[wheel.debs]]``).

Everything lands under ``third_party/cache`` (downloads) and the recipe's build folder, written
aside and renamed, so an interrupted run leaves nothing half-made.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ChecksumError, ConfigError, SourceError
from . import build_cache, cuda
from .aptget import download_deb
from .layout import Layout, atomic_dir, write_atomic
from .progress import Progress
from .sources import Manifest, load_manifest, sha256_of
from .wheel import Interpreter, find_pythons

DOWNLOAD_TIMEOUT = 1800
CUDA = "12.4"                                   # torch 2.6.0's cu124 wheels
# What the module compiles against and links with, from the unpacked torch wheel.
WHEEL_PARTS = ("torch/include/", "torch/lib/")
_INTERNALS = re.compile(rb"__pybind11_internals_v(\d+)(_[a-z]+)(_[a-z0-9]+)(_cxxabi\d+)__")
_TARGET_PROBE = ("import json, sys, sysconfig\n"
                 "print(json.dumps({'include': sysconfig.get_paths()['include'],"
                 " 'suffix': sysconfig.get_config_var('EXT_SUFFIX')}))\n")


@dataclass(frozen=True)
class Target:
    """One CPython to build for, and the torch wheel pinned for it."""
    python: Path
    tag: str                # cp311
    version: str            # 3.11
    include: str            # the interpreter's Python.h folder
    suffix: str             # .cpython-311-x86_64-linux-gnu.so
    pin: dict               # file, sha256, size


def wheel_pins(m: Manifest) -> dict[str, dict]:
    files = m.extra.get("wheel", {}).get("files", {})
    if not files:
        raise ConfigError(f"third_party/{m.name}.toml pins no torch wheels for {m.name} {m.version}",
                          fix="add a [wheel.files] table (one entry per CPython tag) to the manifest")
    return files


def _cpythons(pins: dict) -> str:
    return ", ".join(f"{t[2]}.{t[3:]}" for t in sorted(pins, key=lambda t: int(t[3:])))


def pin_for(m: Manifest, version: tuple[int, ...]) -> dict:
    """The pinned wheel for CPython ``version``, or a ConfigError naming the CPythons torch has."""
    pins = wheel_pins(m)
    tag = f"cp{version[0]}{version[1]}"
    if tag not in pins:
        raise ConfigError(f"torch {m.version} has no wheel for CPython {version[0]}.{version[1]}; "
                          f"it has wheels for CPython {_cpythons(pins)}",
                          fix="pass --python with one of those (a path, or a version such as 3.11)")
    return pins[tag]


def targets(m: Manifest, specs: list[str]) -> list[Target]:
    """The interpreters named by ``specs`` (paths, versions such as 3.11, or ``all``: each CPython
    found here that torch has a wheel for)."""
    found: list[Interpreter] = find_pythons(specs, floor="")
    if specs == ["all"]:
        found = [it for it in found if it.tag in wheel_pins(m)]
        if not found:
            raise ConfigError(f"no CPython here that torch {m.version} has a wheel for "
                              f"({_cpythons(wheel_pins(m))})", fix="install one of them, or pass --python")
    out = []
    for it in found:
        pin = pin_for(m, it.version)
        proc = subprocess.run([str(it.path), "-c", _TARGET_PROBE], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise ConfigError(f"{it.path} does not say where its headers are: {proc.stderr.strip()[-300:]}",
                              fix="pass another --python")
        info = json.loads(proc.stdout)
        if not Path(info["include"], "Python.h").is_file():
            raise ConfigError(f"{it.path} has no Python.h in {info['include']}",
                              fix=f"install Python {it.minor}'s headers (Debian: python{it.minor}-dev)")
        out.append(Target(it.path, it.tag, it.minor, info["include"], info["suffix"], pin))
    return out


def _check(path: Path, want: str, what: str) -> None:
    got = sha256_of(path)
    if got != want:
        raise ChecksumError(f"{path}: sha256 {got}, but {what} is pinned at sha256 {want}",
                            fix=f"hand over the file PyPI serves as {path.name} (or let hpct-build download it)")


def fetch_wheel(layout: Layout, m: Manifest, target: Target, progress: Progress, given: Path | None = None) -> Path:
    """The verified torch wheel for ``target``: ``given`` (checked), or downloaded with pip once."""
    pin = target.pin
    what = f"torch {m.version}'s {target.tag} wheel"
    if given is not None:
        given = Path(given).expanduser().resolve()
        if not given.is_file():
            raise SourceError(f"--torch-wheel {given}: no such file", fix="pass the path of the downloaded wheel")
        _check(given, pin["sha256"], what)
        return given
    dest = layout.cache / "torch-wheels"
    kept = dest / pin["file"]
    if kept.is_file() and kept.stat().st_size == pin.get("size", kept.stat().st_size):
        _check(kept, pin["sha256"], what)
        return kept
    if build_cache.reuse_download(pin["file"], pin["sha256"], dest) is not None:
        progress.step(f"{pin['file']}: taken from the download cache ({build_cache.downloads()})")
        return kept
    _pip_download(f"torch=={m.version}", target, dest, progress, what)
    _check(kept, pin["sha256"], what)
    build_cache.keep_download(kept)
    return kept


def _pip_download(requirement: str, target: Target | None, dest: Path, progress: Progress, what: str) -> None:
    tmp = dest / ".tmp-download"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    platform = []
    if target is not None:
        platform = ["--python-version", target.version, "--implementation", "cp", "--abi", target.tag,
                    "--platform", "manylinux1_x86_64"]
    progress.step(f"downloading {requirement} from PyPI ({what})")
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               *platform, requirement, "-d", str(tmp)], capture_output=True, text=True,
                              timeout=DOWNLOAD_TIMEOUT)
        got = sorted(tmp.glob("*.whl"))
        if proc.returncode != 0 or not got:
            raise SourceError(f"pip could not download {requirement} ({what}): "
                              f"{(proc.stderr or proc.stdout).strip()[-400:]}",
                              fix="check the connection to PyPI, or download the wheel and pass --torch-wheel")
        for wheel in got:
            os.replace(wheel, dest / wheel.name)
    except subprocess.TimeoutExpired:
        raise SourceError(f"pip download {requirement} gave no answer within {DOWNLOAD_TIMEOUT} s",
                          fix="check the connection to PyPI") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def unpack_wheel(wheel: Path, sha256: str, dest: Path, progress: Progress) -> Path:
    """``torch/include`` and ``torch/lib`` of the wheel under ``dest`` (kept while the wheel is the same)."""
    stamp = dest / ".hpct-wheel.json"
    try:
        if json.loads(stamp.read_text()).get("sha256") == sha256:
            return dest / "torch"
    except (OSError, ValueError):
        pass
    progress.step(f"unpacking the headers and libraries of {wheel.name}")
    with atomic_dir(dest) as scratch, zipfile.ZipFile(wheel) as z:
        z.extractall(scratch, [n for n in z.namelist() if n.startswith(WHEEL_PARTS)])
        write_atomic(scratch / stamp.name, json.dumps({"wheel": wheel.name, "sha256": sha256}) + "\n")
    return dest / "torch"


def pybind11_abi(libtorch_python: Path) -> tuple[str, str]:
    """(internals id, ABI suffix such as ``_cxxabi1011``) that torch's pybind11 was built with."""
    found = _INTERNALS.search(libtorch_python.read_bytes())
    if not found:
        raise SourceError(f"{libtorch_python} names no pybind11 internals: not a torch library this recipe knows",
                          fix="use the pinned torch wheel")
    return found.group(0).decode(), found.group(4).decode()


def nccl_inputs(layout: Layout, m: Manifest, progress: Progress) -> tuple[Path, Path]:
    """(include folder with nccl.h and nccl_rootless.h, libnccl.so.2) of the NCCL torch pins."""
    pin = m.extra["wheel"]["nccl"]
    # Its own folder: hpct's header goes beside nccl.h here, and the tests keep the bare wheel's headers
    # in <package>-<version>, which must stay without it.
    dest = layout.cache / f"{pin['package']}-{pin['version']}+hpct-header"
    include, lib = dest / "include", dest / "lib" / "libnccl.so.2"
    if not (lib.is_file() and (include / "nccl.h").is_file()):
        wheels = layout.cache / "torch-wheels"
        wheel = wheels / pin["file"]
        if not wheel.is_file() and build_cache.reuse_download(pin["file"], pin["sha256"], wheels) is None:
            _pip_download(f"{pin['package']}=={pin['version']}", None, wheels, progress, "torch's NCCL pin")
        _check(wheel, pin["sha256"], f"{pin['package']} {pin['version']}")
        build_cache.keep_download(wheel)
        with atomic_dir(dest) as scratch, zipfile.ZipFile(wheel) as z:
            for name, sub in (("nvidia/nccl/lib/libnccl.so.2", "lib"), ("nvidia/nccl/include/nccl.h", "include"),
                              ("nvidia/nccl/include/nccl_net.h", "include")):
                (scratch / sub).mkdir(parents=True, exist_ok=True)
                (scratch / sub / Path(name).name).write_bytes(z.read(name))
    # hpct's header as the NCCL series has it now (written anew every time: the series may change).
    from .patches import extract_new_file
    extract_new_file(layout, load_manifest(layout, "nccl", pin["version"]), "src/include/nccl_rootless.h", include)
    return include, lib


def cudart(layout: Layout, progress: Progress) -> tuple[list[Path], Path]:
    """(CUDA 12.4 include folders, libcudart.so.12) from NVIDIA's wheels."""
    includes = [cuda.cuda_headers(layout, CUDA, progress), cuda.cuda_math_headers(layout, CUDA, progress)]
    lib = layout.cache / f"cuda-{CUDA}" / "lib" / "libcudart.so.12"
    if not lib.is_file():
        package, version, sha256 = next(w for w in cuda.pins(CUDA)["wheels"] if w[0] == "nvidia-cuda-runtime-cu12")
        wheel = cuda._wheel(layout, CUDA, package, version, sha256, progress)
        with atomic_dir(lib.parent) as scratch, zipfile.ZipFile(wheel) as z:
            (scratch / lib.name).write_bytes(z.read("nvidia/cuda_runtime/lib/libcudart.so.12"))
    return includes, lib


def extra_headers(layout: Layout, m: Manifest, progress: Progress) -> Path:
    """Debian's header-only packages the wheel lacks, unpacked into one include folder."""
    debs = m.extra.get("wheel", {}).get("debs", [])
    dest = layout.cache / f"torch-{m.version}-extra-include"
    wanted = {d["sha256"] for d in debs}
    try:
        if set(json.loads((dest / ".hpct-debs.json").read_text())) == wanted:
            return dest
    except (OSError, ValueError):
        pass
    files = [download_deb(layout, layout.cache / "debs", d, progress, what=f"no {d['package']}:",
                          fix="run ci/setup.sh (it adds the Debian entries), then try again") for d in debs]
    with atomic_dir(dest) as scratch:
        root = scratch / "root"
        for deb in files:
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=300)
        for entry in (root / "usr" / "include").iterdir():
            os.replace(entry, scratch / entry.name)
        shutil.rmtree(root)
        write_atomic(scratch / ".hpct-debs.json", json.dumps(sorted(wanted)) + "\n")
    return dest
