"""``hpct-build wheel nccl[=VERSION]``: the patched libnccl as a drop-in NVIDIA NCCL wheel.

Each pin of third_party/nccl.toml names the distribution its wheel replaces (2.21.5:
``nvidia-nccl-cu12``, which torch 2.6.0 requires; 2.30.7: ``nvidia-nccl-cu13``, torch 2.14.1's)
and the CUDA runtime it needs.

The wheel has the layout of NVIDIA's (``nvidia/nccl/lib/libnccl.so.2``,
``nvidia/nccl/include/``, empty namespace ``__init__.py`` files), so PyTorch's
wheels, whose libraries look for NCCL at ``$ORIGIN/../../nvidia/nccl/lib``, load
it without LD_PRELOAD.  Its version is ``<version>+hpct.<series id>``: the local label
still satisfies torch's ``==<version>`` (TORCH_PINS below) and says which series it
carries; ``nvidia/nccl/hpct-series.json`` records the rest.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import zipfile
from pathlib import Path

from ..elf import ElfError, manylinux_tag, read_elf
from ..errors import BuildError, ConfigError
from .layout import Layout
from .progress import Progress
from .sources import load_manifest

# What torch's CUDA wheels require, per NCCL pin (their metadata, read 2026-11): the wheel must
# satisfy it, and tests/test_nccl_build.py checks that it does.
TORCH_PINS = {"2.21.5": ("torch==2.6.0", "nvidia-nccl-cu12==2.21.5"),
              "2.30.7": ("torch==2.14.1", "nvidia-nccl-cu13==2.30.7")}
SERIES_RECORD = "nvidia/nccl/hpct-series.json"
ROOTLESS_SYMBOLS = ("ncclCommInitRankRootless", "ncclRootlessUniqueId")   # nccl_rootless.h
HEADERS = ("nccl.h", "nccl_net.h", "nccl_rootless.h")
SCHEMA_VERSION = 1
# The newest glibc a wheel of libnccl may need: torch's CUDA wheels install on manylinux_2_28, and
# so does hpct's own wheel.  A library needing more is refused, not tagged with a newer platform.
GLIBC_LIMIT = (2, 28)
# A fixed date for every entry: the same build gives the same wheel bytes.
ZIP_DATE = (2024, 1, 1, 0, 0, 0)


def _urlsafe_sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _stamp(prefix: Path) -> dict:
    path = prefix / "hpct-series.json"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{prefix} is not an NCCL built by hpct-build (no hpct-series.json)",
                          fix="build it first: hpct-build build nccl, or pass --prefix of such a build") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} is unreadable: {err}", fix="build NCCL again: hpct-build build nccl") from None
    for key in ("series_id", "version"):
        if not isinstance(info.get(key), str) or not info[key]:
            raise ConfigError(f"{path} has no {key!r}", fix="build NCCL again: hpct-build build nccl")
    return info


def dist_name(m) -> str:
    """The distribution a pin's wheel replaces (the one torch's metadata requires)."""
    return m.extra.get("wheel", "nvidia-nccl-cu12")


def symbols_above(lib: Path, prefix: str, limit: tuple[int, ...], at_most: int = 8) -> list[str]:
    """Up to ``at_most`` undefined symbols of ``lib`` bound to ``<prefix>_X.Y`` newer than ``limit``
    (e.g. 'pthread_create@GLIBC_2.34'); empty when binutils' nm is missing."""
    import shutil
    import subprocess
    nm = shutil.which("nm")
    if not nm:
        return []
    try:
        out = subprocess.run([nm, "-D", "--undefined-only", "--with-symbol-versions", str(lib)],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = set()
    for line in out.splitlines():
        hit = re.search(rf"(\S+?)@+{re.escape(prefix)}_(\d+(?:\.\d+)*)\b", line)
        if hit and tuple(int(x) for x in hit.group(2).split(".")) > limit:
            found.add(f"{hit.group(1)}@{prefix}_{hit.group(2)}")
    return sorted(found)[:at_most]


def platform_tag(elf, lib: Path) -> str:
    """The manylinux tag from the library's GLIBC needs; refused above GLIBC_LIMIT."""
    glibc = elf.max_version("GLIBC")
    if glibc is not None and glibc[:2] > GLIBC_LIMIT:
        need, limit = ".".join(map(str, glibc)), ".".join(map(str, GLIBC_LIMIT))
        names = symbols_above(lib, "GLIBC", GLIBC_LIMIT)
        raise BuildError(f"{lib} needs GLIBC_{need} (manylinux_{need.replace('.', '_')}), newer than the "
                         f"manylinux_{limit.replace('.', '_')} the wheel must keep to"
                         + (f": {', '.join(names)}" if names else ""),
                         fix="build it with hpct-build build nccl, which links src/nccl_rootless/glibc_floor.c "
                             "(add a wrapper there for each symbol named)")
    return manylinux_tag(elf)


def build_nccl_wheel(layout: Layout, progress: Progress, prefix: Path | None = None,
                     dist: Path | None = None, version: str | None = None) -> Path:
    """Package ``prefix`` (default: hpct's NCCL build) into ``dist`` (default: ``dist/``)."""
    m = load_manifest(layout, "nccl", version)
    name = dist_name(m)
    stem = name.replace("-", "_")
    default = layout.build(m.name, m.version) / "install"
    prefix = Path(prefix) if prefix is not None else default
    info = _stamp(prefix)
    if prefix == default:
        from .patches import load_series
        current = load_series(layout, m).identity()
        if info["series_id"] != current:
            raise ConfigError(f"{prefix} was built with series {info['series_id']}, "
                              f"patches/nccl/{m.version} is now {current}",
                              fix="rebuild it: hpct-build build nccl (same options as before)")
    if info["version"] != m.version:
        raise ConfigError(f"{prefix} holds NCCL {info['version']}, this wheel is for {m.version}",
                          fix=f"build NCCL {m.version}: hpct-build build nccl")
    lib = prefix / "lib" / "libnccl.so.2"
    if not lib.is_file():
        raise ConfigError(f"{lib} is missing", fix="build NCCL again: hpct-build build nccl")
    try:
        elf = read_elf(lib)
    except (ElfError, OSError) as err:
        raise BuildError(f"{lib} is not a readable shared library: {err}",
                         fix="build NCCL again: hpct-build build nccl") from None
    if elf.soname != "libnccl.so.2" or "ncclGetVersion" not in elf.exports:
        raise BuildError(f"{lib} is not libnccl (SONAME {elf.soname}, "
                         f"{'no ' if 'ncclGetVersion' not in elf.exports else ''}ncclGetVersion)",
                         fix="build NCCL again: hpct-build build nccl")
    headers = [prefix / "include" / h for h in HEADERS if (prefix / "include" / h).is_file()]
    if not any(h.name == "nccl.h" for h in headers):
        raise ConfigError(f"{prefix / 'include' / 'nccl.h'} is missing", fix="build NCCL again: hpct-build build nccl")

    platform = platform_tag(elf, lib)
    version = f"{m.version}+hpct.{info['series_id']}"
    exports = sorted(s for s in ROOTLESS_SYMBOLS if s in elf.exports)
    record = {"schema_version": SCHEMA_VERSION, "component": "nccl", "nccl_version": m.version,
              "wheel_version": version, "series_id": info["series_id"],
              "patches": info.get("patches", []), "cuda": info.get("cuda"),
              "cuda_archs": info.get("cuda_archs"), "funcs": info.get("funcs"),
              "rootless_exports": exports, "platform_tag": platform,
              "glibc_required": ".".join(map(str, elf.max_version("GLIBC") or ())) or None,
              "needs_libcudart": m.extra.get("cudart", "libcudart.so.12") in elf.needed_versions or None}
    files: list[tuple[str, bytes, int]] = [
        ("nvidia/__init__.py", b"", 0o644), ("nvidia/nccl/__init__.py", b"", 0o644),
        ("nvidia/nccl/include/__init__.py", b"", 0o644), ("nvidia/nccl/lib/__init__.py", b"", 0o644),
        *[(f"nvidia/nccl/include/{h.name}", h.read_bytes(), 0o644) for h in headers],
        ("nvidia/nccl/lib/libnccl.so.2", lib.read_bytes(), 0o755),
        (SERIES_RECORD, (json.dumps(record, indent=2) + "\n").encode(), 0o644),
    ]
    distinfo = f"{stem}-{version}.dist-info"
    if (prefix / "LICENSE.txt").is_file():
        files.append((f"{distinfo}/LICENSE.txt", (prefix / "LICENSE.txt").read_bytes(), 0o644))
    files += [(f"{distinfo}/METADATA", _metadata(m, version, info, record).encode(), 0o644),
              (f"{distinfo}/WHEEL", (f"Wheel-Version: 1.0\nGenerator: hpct-build\nRoot-Is-Purelib: false\n"
                                     f"Tag: py3-none-{platform}\n").encode(), 0o644),
              (f"{distinfo}/top_level.txt", b"nvidia\n", 0o644)]
    rows = [f"{name},sha256={_urlsafe_sha256(data)},{len(data)}" for name, data, _ in files]
    rows.append(f"{distinfo}/RECORD,,")
    files.append((f"{distinfo}/RECORD", ("\n".join(rows) + "\n").encode(), 0o644))

    dist = Path(dist) if dist is not None else layout.root / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    wheel = dist / f"{stem}-{version}-py3-none-{platform}.whl"
    tmp = wheel.with_name(f".{wheel.name}.tmp")
    progress.step(f"writing {wheel.name} (series {info['series_id']}, {platform})")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
            for name, data, mode in files:
                entry = zipfile.ZipInfo(name, ZIP_DATE)
                entry.external_attr = (0o100000 | mode) << 16
                entry.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(entry, data)
        os.replace(tmp, wheel)
    finally:
        tmp.unlink(missing_ok=True)
    progress.step(f"wheel: {wheel} ({wheel.stat().st_size / 1e6:.1f} MB)")
    return wheel


def _metadata(m, version: str, info: dict, record: dict) -> str:
    cuda = info.get("cuda") or m.extra.get("cuda", "12.4")
    archs = ",".join(info.get("cuda_archs") or []) or "?"
    lines = ["Metadata-Version: 2.1", f"Name: {dist_name(m)}", f"Version: {version}",
             f"Summary: NCCL {record['nccl_version']} built by hpct-build with patch series "
             f"{info['series_id']} (rootless ncclCommInitRankRootless)",
             "Home-page: https://github.com/NVIDIA/nccl", "License: BSD-3-Clause",
             "Requires-Python: >=3"]
    if record.get("needs_libcudart"):
        # Built with CUDARTLIB=cudart: libcudart comes from the runtime wheel, which torch's
        # CUDA wheels require anyway; the library's RUNPATH points there.
        lines.append(f"Requires-Dist: {m.extra.get('cudart_dist', 'nvidia-cuda-runtime-cu12')}>={cuda}")
    lines += ["", f"NCCL {record['nccl_version']} for CUDA {cuda} (sm {archs}"
              f"{', collectives: ' + info['funcs'] if info.get('funcs') else ''}), "
              f"patch series {info['series_id']}: {', '.join(record['patches']) or 'none'}.", ""]
    return "\n".join(lines)


def wheel_files(layout: Layout) -> list[Path]:
    return sorted((layout.root / "dist").glob("nvidia_nccl_cu1*-*.whl"))


def install(wheel: Path, progress: Progress) -> None:
    """pip install the wheel in place of NVIDIA's; its one dependency, the CUDA
    runtime wheel, comes with torch's CUDA wheels, so pip is not asked to resolve anything."""
    import subprocess
    import sys
    progress.step(f"installing {wheel.name}")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall",
                           str(wheel)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise BuildError(f"pip install {wheel.name} failed: "
                         + " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:]),
                         fix=f"run it yourself: {sys.executable} -m pip install {wheel}")
