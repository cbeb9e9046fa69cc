"""Where things live in an hpct checkout, and where fetched and built trees go.

Everything under ``third_party/{cache,src,patched,build}`` is generated and
ignored by git; the manifests, ``patches/`` and ``build_scripts/`` are the only
inputs.  Outside a checkout (hpct installed from a wheel, or the extension's own
CMake build) hpct-build works in a *work folder*: ``--workdir`` or
``HPCT_BUILD_DIR``.  The folder gets a copy of the inputs (from the checkout, or
the copy the wheel carries in ``hpct/_build_inputs``) and then has the layout
of a checkout, so every verb works there unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import ConfigError, SourceError

WORKDIR_ENV = "HPCT_BUILD_DIR"
# plus third_party/*.toml; src/: NCCL's shared ring core, the out-of-tree torch module's sources
INPUT_DIRS = ("patches", "build_scripts", "src/nccl_rootless", "src/torch_c10d")
INPUTS_STAMP = ".hpct-inputs.json"


def find_root(start: Path | None = None) -> Path:
    """The checkout that holds ``third_party/*.toml`` and ``patches/``."""
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "third_party").is_dir() and (candidate / "patches").is_dir():
            return candidate
    raise SourceError(
        f"{here} is not inside an hpct checkout (no third_party/ and patches/ above it)",
        fix=f"pass --workdir PATH or set {WORKDIR_ENV}=PATH (a folder hpct-build may fill), "
            "or run hpct-build inside the hpct repository (or pass --root PATH)")


def _is_checkout(path: Path) -> bool:
    return (path / "third_party").is_dir() and (path / "patches").is_dir()


def packaged_inputs() -> Path | None:
    """The manifests, series and recipes an installed wheel carries, if this is one."""
    here = Path(__file__).resolve().parents[1] / "_build_inputs"
    return here if _is_checkout(here) else None


def _input_files(src: Path) -> list[Path]:
    files = sorted(p for p in (src / "third_party").glob("*.toml") if p.is_file())
    for name in INPUT_DIRS:
        files += sorted(p for p in (src / name).rglob("*")
                        if p.is_file() and "__pycache__" not in p.parts)
    return files


def inputs_digest(src: Path) -> str:
    h = hashlib.sha256()
    for path in _input_files(src):
        h.update(f"{path.relative_to(src).as_posix()}\0".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def sync_inputs(src: Path, work: Path) -> None:
    """Make ``work``'s manifests, series and recipes a copy of ``src``'s.

    Generated trees stay: the fetch, patch and build stamps notice a changed pin
    or series by themselves.  A folder that holds inputs hpct-build did not put
    there (a checkout, say) is refused rather than overwritten.
    """
    stamp = work / INPUTS_STAMP
    if not stamp.is_file() and ((work / "patches").exists() or any((work / "third_party").glob("*.toml"))):
        raise ConfigError(
            f"work folder {work} already holds manifests or patches that hpct-build did not copy there",
            fix=f"use an empty folder (or one an earlier hpct-build filled) for --workdir/{WORKDIR_ENV}; "
                "to build inside a checkout, use --root instead")
    digest = inputs_digest(src)
    try:
        if json.loads(stamp.read_text()).get("digest") == digest:
            return
    except (OSError, ValueError):
        pass
    (work / "third_party").mkdir(parents=True, exist_ok=True)
    for name in INPUT_DIRS:
        with atomic_dir(work / name) as scratch:
            if (src / name).is_dir():
                shutil.copytree(src / name, scratch, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
    wanted = {p.name for p in (src / "third_party").glob("*.toml")}
    for old in (work / "third_party").glob("*.toml"):
        if old.name not in wanted:
            old.unlink()
    for name in sorted(wanted):
        write_atomic(work / "third_party" / name, (src / "third_party" / name).read_text())
    # Written last: an interrupted copy is redone by the next run.
    write_atomic(stamp, json.dumps({"from": str(src), "digest": digest}, indent=2) + "\n")


def resolve_layout(root: Path | None = None, workdir: Path | None = None) -> Layout:
    """The layout hpct-build works in.

    No work folder: the checkout (``root``, or found from the current directory),
    as always.  A work folder (``workdir``, else ``HPCT_BUILD_DIR``): the inputs of
    that checkout, or of the installed wheel when there is none, copied into it.
    """
    if workdir is None and os.environ.get(WORKDIR_ENV):
        workdir = Path(os.environ[WORKDIR_ENV])
    if workdir is None:
        checkout = find_root(root)
        return Layout(checkout, checkout=checkout)
    checkout = find_root(root) if root is not None else _checkout_here()
    inputs = checkout or packaged_inputs()
    if inputs is None:
        raise SourceError(
            "this hpct carries no manifests or patches to build from, and no checkout was given",
            fix="reinstall hpct from its wheel, or pass --root CHECKOUT")
    work = Path(workdir).expanduser().resolve()
    if work.exists() and not work.is_dir():
        raise ConfigError(f"work folder {work} is not a directory",
                          fix=f"point --workdir/{WORKDIR_ENV} at a folder (it is created if missing)")
    if work != inputs:
        work.mkdir(parents=True, exist_ok=True)
        sync_inputs(inputs, work)
    return Layout(work, checkout=checkout)


def _checkout_here() -> Path | None:
    try:
        return find_root(None)
    except SourceError:
        return None


@dataclass(frozen=True)
class Layout:
    root: Path
    # The source checkout (or unpacked sdist) when there is one: what the hpct
    # wheel is built from.  None when hpct-build runs from an installed wheel.
    checkout: Path | None = None

    @property
    def project(self) -> Path | None:
        """The tree that ``pip wheel`` builds hpct from, if this layout has one."""
        for candidate in (self.checkout, self.root):
            if candidate is not None and (candidate / "pyproject.toml").is_file() \
                    and (candidate / "CMakeLists.txt").is_file():
                return candidate
        return None

    @property
    def dist(self) -> Path:
        return self.root / "dist"

    @property
    def manifests(self) -> Path:
        return self.root / "third_party"

    @property
    def cache(self) -> Path:
        return self.root / "third_party" / "cache"

    def source(self, name: str, version: str) -> Path:
        """The pristine, verified upstream tree."""
        return self.root / "third_party" / "src" / f"{name}-{version}"

    def patched(self, name: str, version: str) -> Path:
        """A copy of the pristine tree with the whole series applied."""
        return self.root / "third_party" / "patched" / f"{name}-{version}"

    def build(self, name: str, version: str) -> Path:
        return self.root / "third_party" / "build" / f"{name}-{version}"

    def series_dir(self, name: str, version: str) -> Path:
        return self.root / "patches" / name / version


@contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """Yield a scratch folder beside ``dest``; rename it to ``dest`` on success.

    An interruption leaves only a ``.tmp-*`` folder, which the next run removes,
    never a half-written ``dest``.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".tmp-{dest.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
    try:
        yield scratch
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(scratch, dest)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)


def write_atomic(path: Path, text: str) -> None:
    """Write a small file through a temporary name, so readers never see half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
