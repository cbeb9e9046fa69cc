"""Patch series: parse, lint (DEP-3 fields), identify, and apply to a tree.

A series lives in ``patches/<component>/<version>/series``: one patch file per
line, each followed by ``# why``.  Patches are ``git format-patch`` files whose
message carries the DEP-3 fields Description, Origin, Forwarded, Last-Update.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import PatchError, SourceError, ToolchainError
from .layout import Layout, atomic_dir, write_atomic
from .progress import Progress
from .sources import STAMP, Manifest

PATCHED_STAMP = ".hpct-patched.json"
DEP3_FIELDS = ("Description", "Origin", "Forwarded", "Last-Update")


@dataclass(frozen=True)
class SeriesEntry:
    patch: str
    why: str
    line: int


@dataclass(frozen=True)
class Series:
    component: str
    version: str
    directory: Path
    entries: tuple[SeriesEntry, ...]

    @property
    def paths(self) -> list[Path]:
        return [self.directory / e.patch for e in self.entries]

    def identity(self) -> str:
        """sha256 over the series order and every patch's bytes: the build's series id."""
        h = hashlib.sha256()
        for entry, path in zip(self.entries, self.paths):
            h.update(entry.patch.encode() + b"\0" + path.read_bytes() + b"\0")
        return h.hexdigest()[:16]


def load_series(layout: Layout, m: Manifest) -> Series:
    directory = layout.series_dir(m.name, m.version)
    path = directory / "series"
    if not path.is_file():
        return Series(m.name, m.version, directory, ())
    entries = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, _, why = line.partition("#")
        name = name.strip()
        if not why.strip():
            raise PatchError(f"{path}:{n}: {name} has no '# why' comment",
                             fix="say after '#' why the patch exists")
        if not (directory / name).is_file():
            raise PatchError(f"{path}:{n}: series names {name}, which does not exist in {directory}",
                             fix="add the patch file or remove the line")
        entries.append(SeriesEntry(name, why.strip(), n))
    return Series(m.name, m.version, directory, tuple(entries))


def lint_patch(path: Path) -> list[str]:
    """Problems with one patch's form; an empty list means it is well-formed."""
    text = path.read_text(errors="replace")
    problems = []
    if not text.startswith("From ") or "\nSubject: " not in text:
        problems.append("not a git format-patch file (no 'From ' line or Subject:)")
    header = text.split("\n---\n", 1)[0]
    for name in DEP3_FIELDS:
        if not re.search(rf"^{name}: \S", header, re.MULTILINE):
            problems.append(f"missing DEP-3 field {name}:")
    m = re.search(r"^Last-Update: (\S+)", header, re.MULTILINE)
    if m and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", m.group(1)):
        problems.append(f"Last-Update {m.group(1)!r} is not YYYY-MM-DD")
    if "\ndiff --git " not in text:
        problems.append("carries no diff")
    return problems


def _patch_tool() -> str:
    tool = shutil.which("patch")
    if not tool:
        raise ToolchainError("GNU patch is not installed", fix="apt-get install patch")
    return tool


def _failure_report(patch: Path, output: str) -> str:
    """Turn GNU patch's output into 'file: hunk #n at line' phrases."""
    found, current = [], None
    for line in output.splitlines():
        m = re.match(r"(?:patching|checking) file (.+)", line)
        if m:
            current = m.group(1).strip()
        m = re.match(r"Hunk #(\d+) FAILED at (\d+)", line)
        if m:
            found.append(f"{current}: hunk #{m.group(1)} (at line {m.group(2)})")
        if "can't find file to patch" in line or "No file to patch" in line:
            found.append(f"{current or '?'}: file not found")
    if not found:
        found = [output.strip().splitlines()[-1] if output.strip() else "no output from patch"]
    where = "; ".join(found)
    return f"{patch.name} does not apply: {where}"


def apply_series(series: Series, tree: Path, progress: Progress) -> None:
    """Apply every patch in order; stop at the first that fails, naming it."""
    tool = _patch_tool()
    for entry, path in zip(series.entries, series.paths):
        problems = lint_patch(path)
        if problems:
            raise PatchError(f"{path}: " + "; ".join(problems),
                             fix="regenerate it with git format-patch and add the DEP-3 fields")
        base = [tool, "-p1", "--batch", "--forward", "--fuzz=0", "--no-backup-if-mismatch",
                "--reject-file=-", "-d", str(tree), "-i", str(path)]
        # A dry run first, so a failing patch leaves the tree exactly as it was.
        for extra in (["--dry-run"], []):
            proc = subprocess.run(base + extra, capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise PatchError(_failure_report(path, proc.stdout + proc.stderr),
                                 fix=f"rebase {path.name} onto {series.component} {series.version}")
        progress.step(f"applied {entry.patch}")


def _copy_pristine(layout: Layout, m: Manifest, into: Path) -> None:
    src = layout.source(m.name, m.version)
    if not (src / STAMP).is_file():
        raise SourceError(f"{m.name} {m.version} is not fetched", fix=f"run `hpct-build fetch {m.name}`")
    shutil.copytree(src, into, dirs_exist_ok=True, symlinks=True, ignore=shutil.ignore_patterns(STAMP))


def check(layout: Layout, m: Manifest, progress: Progress) -> Series:
    """Apply the series to a scratch copy of the pristine tree and throw it away."""
    series = load_series(layout, m)
    with tempfile.TemporaryDirectory(prefix=f"hpct-check-{m.name}-") as tmp:
        _copy_pristine(layout, m, Path(tmp))
        apply_series(series, Path(tmp), progress)
    return series


def patch(layout: Layout, m: Manifest, progress: Progress, force: bool = False) -> Path:
    """Make ``third_party/patched/<name>-<version>`` the pristine tree plus the series."""
    series = load_series(layout, m)
    dest = layout.patched(m.name, m.version)
    ident = series.identity()
    current = patched_info(layout, m)
    if current and current.get("series_id") == ident and not force:
        progress.step(f"{m.name} {m.version}: series {ident} already applied at {dest}")
        return dest
    with atomic_dir(dest) as scratch:
        _copy_pristine(layout, m, scratch)
        apply_series(series, scratch, progress)
        write_atomic(scratch / PATCHED_STAMP, json.dumps(
            {"name": m.name, "version": m.version, "series_id": ident,
             "patches": [e.patch for e in series.entries]}, indent=2) + "\n")
    progress.step(f"{m.name} {m.version}: {len(series.entries)} patches applied (series {ident})")
    return dest


def patched_info(layout: Layout, m: Manifest) -> dict | None:
    stamp = layout.patched(m.name, m.version) / PATCHED_STAMP
    return json.loads(stamp.read_text()) if stamp.is_file() else None
