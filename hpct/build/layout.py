"""Where things live in an hpct checkout, and where fetched and built trees go.

Everything under ``third_party/{cache,src,patched,build}`` is generated and
ignored by git; the manifests and ``patches/`` are the only inputs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import SourceError


def find_root(start: Path | None = None) -> Path:
    """The checkout that holds ``third_party/*.toml`` and ``patches/``."""
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "third_party").is_dir() and (candidate / "patches").is_dir():
            return candidate
    raise SourceError(
        f"{here} is not inside an hpct checkout (no third_party/ and patches/ above it)",
        fix="run hpct-build from the hpct repository, or pass --root PATH")


@dataclass(frozen=True)
class Layout:
    root: Path

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
