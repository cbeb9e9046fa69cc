"""CUDA for building NCCL and compiling CUDA host code, without installing a CUDA toolkit.

Two products, both cached under ``third_party/cache/cuda-<version>/`` and made atomically:

* ``cuda_headers``: an include folder assembled from NVIDIA's PyPI wheels only (the runtime
  wheel's headers, the nvcc wheel's ``crt/``, the cccl wheel's ``nv/target``), enough for
  g++ to compile ``cuda_runtime.h``, ``cuda.h``, ``cuda_fp16.h`` and ``cuda_bf16.h``.
* ``cuda_toolchain``: a ``CUDA_HOME`` that NCCL's makefiles accept.  ``CUDA_HOME`` from the
  environment wins when its nvcc reports the requested release; otherwise the compiler
  drivers PyPI lacks (nvcc, cicc, cudafe++, fatbinary, nvlink) come from a Debian non-free
  ``.deb``, downloaded under a private APT configuration kept in the cache (the machine's
  own sources are never touched), and everything else from the wheels.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from ..errors import ChecksumError, ConfigError, ToolchainError
from . import build_cache
from .aptget import APT_URI_ENV, download_deb
from .layout import Layout, atomic_dir
from .progress import Progress
from .sources import sha256_of

# Every CUDA pin lives here.  Wheels: (package, version, sha256 of the x86_64 wheel file).
# ``deb``: the Debian package carrying the compiler drivers, or None when no Debian
# release carries that CUDA (then only a CUDA_HOME from the environment can build).
CUDA_PINS: dict[str, dict] = {
    "12.4": {
        "wheels": (
            ("nvidia-cuda-runtime-cu12", "12.4.127",
             "64403288fa2136ee8e467cdc9c9427e0434110899d07c779f25b5c068934faa5"),
            ("nvidia-cuda-nvcc-cu12", "12.4.131",
             "e4c9a35435c3b0e36c6397c5696334c9ea6650e524736cbd1c5d345ea099bb04"),
            # 12.4.127 itself is yanked and lacks nv/target; the .post1 carries it.
            ("nvidia-cuda-cccl-cu12", "12.4.127.post1",
             "2027fa5fc75fbee703bf24e8275a40a605cf94a3e8fef8a7187897d49b34facb"),
        ),
        # ATen/cuda's headers include cuBLAS, cuSPARSE and cuSOLVER: torch 2.6.0's pins of them,
        # for compiling PyTorch's CUDA units (headers only; the large wheels are not kept).
        "math_wheels": (
            ("nvidia-cublas-cu12", "12.4.5.8",
             "2fc8da60df463fdefa81e323eef2e36489e1c94335b5358bcb38360adf75ac9b"),
            ("nvidia-cusparse-cu12", "12.3.1.170",
             "ea4f11a2904e2a8dc4b1833cc1b5181cde564edd0d5cd33e3c168eff2d1863f1"),
            ("nvidia-cusolver-cu12", "11.6.1.9",
             "19e33fa442bcfd085b3086c4ebf7e8debc07cfe01e11513cc6d332fd918ac260"),
        ),
        # What nvcc 12.4 can target (`nvcc --list-gpu-code`), without the dot.
        "archs": ("50", "52", "53", "60", "61", "62", "70", "72", "75", "80", "86", "87", "89",
                  "90", "90a"),
        "deb": {"package": "nvidia-cuda-toolkit", "version": "12.4.131~12.4.1-2",
                "suite": "trixie", "component": "non-free",
                "sha256": "cd5fe85aee38d108b315f408a688641478f2402622a10c677478eb7a6c4e5319"},
    },
    "12.8": {
        "wheels": (
            ("nvidia-cuda-runtime-cu12", "12.8.90",
             "adade8dcbd0edf427b7204d480d6066d33902cab2a4707dcfc48a2d0fd44ab90"),
            ("nvidia-cuda-nvcc-cu12", "12.8.93",
             "2d6dc36fb7cb5ac9c0b8825bc13d193c35487a315664007287d0126531238011"),
            ("nvidia-cuda-cccl-cu12", "12.8.90",
             "575bc5cfb0fe4a1956c539215c0f1e6718821b95a68ef6b7abf226aa87e3a5ad"),
        ),
        "archs": ("50", "52", "53", "60", "61", "62", "70", "72", "75", "80", "86", "87", "89",
                  "90", "90a", "100", "100a", "101", "101a", "120", "120a"),
        "deb": None,
    },
    # NCCL 2.30.7 (torch 2.14.1's nvidia-nccl-cu13 pin).  No Debian release carries CUDA 13 and
    # PyPI lacks its compiler drivers: a CUDA 13.0 install (CUDA_HOME, or /usr/local/cuda when its
    # nvcc reports 13.0) builds it.
    "13.0": {
        "wheels": (),
        # `nvcc --list-gpu-code` of CUDA 13.0 (sm_75 is its oldest target).
        "archs": ("75", "80", "86", "87", "88", "89", "90", "100", "103", "110", "120", "121"),
        "deb": None,
    },
}
DEFAULT_CUDA = "12.4"   # the CUDA of torch 2.6.0's cu124 wheels
# Where a CUDA install lives when CUDA_HOME is unset; used only when its nvcc reports the release asked.
STANDARD_HOME = Path("/usr/local/cuda")
STAMP = ".hpct-cuda.json"
DOWNLOAD_TIMEOUT = 900
# The compiler drivers NCCL's build calls through nvcc; each must exist in the assembled bin/.
DRIVERS = ("nvcc", "cicc", "ptxas", "cudafe++", "fatbinary", "nvlink", "bin2c")


def pins(cuda: str) -> dict:
    if cuda not in CUDA_PINS:
        raise ConfigError(f"unknown CUDA version {cuda!r}",
                          fix=f"pass --cuda with one of: {', '.join(sorted(CUDA_PINS))}")
    return CUDA_PINS[cuda]


def cache_dir(layout: Layout, cuda: str) -> Path:
    return layout.cache / f"cuda-{cuda}"


def _stamp_matches(folder: Path, expected: dict) -> bool:
    try:
        return json.loads((folder / STAMP).read_text()).get("pins") == expected
    except (OSError, ValueError):
        return False



def _wheel(layout: Layout, cuda: str, package: str, version: str, sha256: str,
           progress: Progress) -> Path:
    """The pinned wheel file, downloaded with pip once, its sha256 checked every time."""
    wheels = cache_dir(layout, cuda) / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pattern = f"{package.replace('-', '_')}-{version}-*.whl"
    found = sorted(wheels.glob(pattern))
    if not found and (kept := build_cache.reuse_download(pattern, sha256, wheels)) is not None:
        progress.step(f"{package}=={version}: taken from the download cache ({build_cache.downloads()})")
        found = [kept]
    if not found:
        progress.step(f"downloading {package}=={version} from PyPI")
        tmp = wheels / f".tmp-{package}"
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(tmp), f"{package}=={version}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc = None
        got = sorted(tmp.glob(pattern)) if proc and proc.returncode == 0 else []
        if not got:
            why = (proc.stderr or proc.stdout).strip().splitlines()[-3:] if proc else \
                [f"no answer within {DOWNLOAD_TIMEOUT} s"]
            shutil.rmtree(tmp, ignore_errors=True)
            raise ToolchainError(
                f"could not download {package}=={version} with pip: " + " | ".join(why),
                fix="make PyPI reachable (pip's PIP_INDEX_URL / PIP_FIND_LINKS), or put the "
                    f"wheel into {wheels}, or set CUDA_HOME to a CUDA {cuda} install")
        os.replace(got[0], wheels / got[0].name)
        shutil.rmtree(tmp, ignore_errors=True)
        found = [wheels / got[0].name]
    actual = sha256_of(found[0])
    if actual != sha256:
        found[0].unlink()
        raise ChecksumError(f"{found[0].name}: sha256 {actual}, pinned {sha256} (file deleted)",
                            fix="run the command again to download it afresh; if it persists, "
                                "the index serves a different build of that wheel")
    build_cache.keep_download(found[0])
    return found[0]


def _unpack(wheel: Path, part: str, dest: Path) -> int:
    """Extract ``nvidia/<part>/...`` of a wheel into ``dest`` (without the prefix); skip the
    namespace ``__init__.py`` files.  Returns the number of files written."""
    prefix = f"nvidia/{part}/"
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if not name.startswith(prefix) or info.is_dir() or name.endswith("__init__.py"):
                continue
            rel = name[len(prefix):]
            if ".." in Path(rel).parts:
                raise ToolchainError(f"{wheel.name}: unsafe path {name}",
                                     fix="delete the wheel from the cache and run again")
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(target, mode)
            n += 1
    return n


def _part(package: str) -> str:
    # nvidia-cuda-runtime-cu12 -> cuda_runtime: the folder under nvidia/ in the wheel
    return package.removeprefix("nvidia-").removesuffix("-cu12").replace("-", "_")


def _headers(layout: Layout, cuda: str, key: str, folder: str, progress: Progress,
             keep_wheels: bool = True) -> Path:
    """An include folder unpacked from the wheels pinned under ``key``, made once."""
    p = pins(cuda)
    if key not in p:
        raise ConfigError(f"no {key.replace('_', ' ')} are pinned for CUDA {cuda}",
                          fix=f"use CUDA {DEFAULT_CUDA}, or add them to CUDA_PINS in hpct/builder/cuda.py")
    dest = cache_dir(layout, cuda) / folder
    expected = {key: [list(w) for w in p[key]]}
    if _stamp_matches(dest, expected):
        return dest
    wheels = [(pkg, _wheel(layout, cuda, pkg, ver, sha, progress)) for pkg, ver, sha in p[key]]
    progress.step(f"unpacking CUDA {cuda} headers into {dest}")
    with atomic_dir(dest) as tmp:
        for pkg, whl in wheels:
            _unpack(whl, f"{_part(pkg)}/include", tmp)
        (tmp / STAMP).write_text(json.dumps({"cuda": cuda, "pins": expected}, indent=2) + "\n")
    if not keep_wheels:
        for _, whl in wheels:
            whl.unlink(missing_ok=True)
    return dest


def cuda_headers(layout: Layout, cuda: str, progress: Progress) -> Path:
    """An include folder with CUDA ``cuda`` headers taken from the pinned PyPI wheels."""
    return _headers(layout, cuda, "wheels", "include", progress)


def cuda_math_headers(layout: Layout, cuda: str, progress: Progress) -> Path:
    """cuBLAS, cuSPARSE and cuSOLVER headers (what ATen/cuda includes); the wheels, hundreds
    of MB each, are deleted once their headers are out."""
    return _headers(layout, cuda, "math_wheels", "math-include", progress, keep_wheels=False)


def nvcc_release(cuda_home: Path) -> str | None:
    """The ``release X.Y`` that ``cuda_home/bin/nvcc --version`` reports, or None."""
    nvcc = cuda_home / "bin" / "nvcc"
    if not nvcc.is_file():
        return None
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def preflight(cuda: str) -> None:
    """The checks of ``cuda_toolchain`` that need no download: run before a long fetch."""
    p = pins(cuda)
    if os.environ.get("CUDA_HOME") or p["deb"] is not None or nvcc_release(STANDARD_HOME) == cuda:
        _env_home(cuda)
        return
    can = sorted(v for v, q in CUDA_PINS.items() if q["deb"])
    raise ToolchainError(
        f"no CUDA {cuda} toolchain: CUDA_HOME is not set and no Debian package carries "
        f"CUDA {cuda} (hpct-build assembles only CUDA {', '.join(can)} itself)",
        fix=f"set CUDA_HOME to a CUDA {cuda} install (bin/nvcc reporting release {cuda}), "
            f"or pass --cuda {can[0]}")


def _env_home(cuda: str) -> Path | None:
    """$CUDA_HOME when set and its nvcc reports ``cuda``; None when unset; else an error."""
    env_home = os.environ.get("CUDA_HOME")
    if not env_home:
        # No CUDA_HOME: the standard install, when it is the release asked (else assemble one).
        return STANDARD_HOME if nvcc_release(STANDARD_HOME) == cuda else None
    home = Path(env_home)
    got = nvcc_release(home)
    if got != cuda:
        said = f"reports release {got}" if got else "is missing or does not run"
        other = f", or pass --cuda {got}" if got in CUDA_PINS else ""
        raise ToolchainError(
            f"CUDA_HOME={home}: {home / 'bin' / 'nvcc'} {said}, the build asks for CUDA {cuda}",
            fix=f"point CUDA_HOME at a CUDA {cuda} install, or unset CUDA_HOME to let hpct-build "
                f"assemble CUDA {cuda} itself{other}")
    return home


def cuda_toolchain(layout: Layout, cuda: str, progress: Progress) -> Path:
    """A CUDA_HOME for ``cuda``: the environment's if it matches, else one assembled here."""
    preflight(cuda)
    p = pins(cuda)
    home = _env_home(cuda)
    if home is not None:
        progress.step(f"CUDA {cuda} from CUDA_HOME={home}")
        return home
    deb = p["deb"]
    dest = cache_dir(layout, cuda) / "toolchain"
    expected = {"wheels": [list(w) for w in p["wheels"]], "deb": deb}
    if _stamp_matches(dest, expected):
        return dest
    debfile = download_deb(layout, cache_dir(layout, cuda) / "debs", deb, progress,
                           fix=f"set CUDA_HOME to a CUDA {cuda} install (bin/nvcc reporting release "
                               f"{cuda}), or make the Debian archive reachable (set {APT_URI_ENV} to a "
                               f"Debian mirror)", what=f"no CUDA {cuda} toolchain: CUDA_HOME is not set and")
    headers = cuda_headers(layout, cuda, progress)
    runtime = next(_wheel(layout, cuda, pkg, ver, sha, progress)
                   for pkg, ver, sha in p["wheels"] if pkg == "nvidia-cuda-runtime-cu12")
    progress.step(f"assembling a CUDA {cuda} toolchain in {dest}")
    with atomic_dir(dest) as tmp:
        _assemble(tmp, debfile, headers, runtime)
        got = nvcc_release(tmp)
        if got != cuda:
            raise ToolchainError(f"the assembled nvcc reports release {got}, expected {cuda}",
                                 fix=f"delete {cache_dir(layout, cuda)} and run again")
        _smoke(tmp)
        (tmp / STAMP).write_text(json.dumps(
            {"cuda": cuda, "pins": expected, "nvcc_release": got, "drivers": list(DRIVERS)},
            indent=2) + "\n")
    return dest


def _assemble(home: Path, debfile: Path, headers: Path, runtime_wheel: Path) -> None:
    unpacked = home / "_deb"
    subprocess.run(["dpkg-deb", "-x", str(debfile), str(unpacked)], check=True, timeout=600)
    tk = unpacked / "usr" / "lib" / "nvidia-cuda-toolkit"
    # usr/bin/nvcc is Debian's shell wrapper around the real one under usr/lib.
    where = {"nvcc": tk / "bin", "cicc": tk / "bin"}
    bin_ = home / "bin"
    bin_.mkdir()
    for tool in DRIVERS:
        src = where.get(tool, unpacked / "usr" / "bin") / tool
        if not src.is_file():
            raise ToolchainError(f"{debfile.name} has no {tool} where expected ({src.parent})",
                                 fix="the pinned package changed layout; set CUDA_HOME instead")
        shutil.copy2(src, bin_ / tool)
    shutil.copytree(tk / "bin" / "crt", bin_ / "crt")
    (home / "nvvm").mkdir()
    shutil.copytree(tk / "libdevice", home / "nvvm" / "libdevice")
    # nvcc reads this beside itself: point it at this folder instead of Debian's /usr paths.
    (bin_ / "nvcc.profile").write_text(
        "TOP = $(_HERE_)/..\n"
        "NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice\n"
        "PATH += $(_HERE_):\n"
        'INCLUDES += "-I$(TOP)/include" $(_SPACE_)\n'
        'LIBRARIES =+ $(_SPACE_) "-L$(TOP)/lib64"\n')
    shutil.copytree(headers, home / "include", ignore=shutil.ignore_patterns(STAMP))
    lib = home / "lib64"
    _unpack(runtime_wheel, "cuda_runtime/lib", lib)
    if not (lib / "libcudart.so.12").is_file():
        raise ToolchainError(f"{runtime_wheel.name} carries no lib/libcudart.so.12",
                             fix="set CUDA_HOME to a CUDA install instead")
    # The link step asks for -lcudart (CUDARTLIB=cudart): the unversioned name must exist.
    os.symlink("libcudart.so.12", lib / "libcudart.so")
    shutil.rmtree(unpacked)


def _smoke(home: Path) -> None:
    """Compile one tiny kernel: proves every driver nvcc calls is present and runs."""
    work = home / "_smoke"
    work.mkdir()
    (work / "k.cu").write_text("__global__ void k(int *p) { p[threadIdx.x] = 1; }\n")
    proc = subprocess.run([str(home / "bin" / "nvcc"), "-c", "-gencode=arch=compute_80,code=sm_80",
                           "-o", str(work / "k.o"), str(work / "k.cu")],
                          capture_output=True, text=True, timeout=300)
    shutil.rmtree(work)
    if proc.returncode != 0:
        raise ToolchainError("the assembled CUDA toolchain cannot compile a kernel: "
                             + " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-4:]),
                             fix="set CUDA_HOME to a working CUDA install")
