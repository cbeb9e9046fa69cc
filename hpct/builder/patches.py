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
from .locks import one_at_a_time
from .progress import Progress
from .sources import STAMP, Manifest, sha256_of

PATCHED_STAMP = ".hpct-patched.json"
DEP3_FIELDS = ("Description", "Origin", "Forwarded", "Last-Update")
# Beside a series: the sha256 of every file it touches, as the patched pin must have them.
TOUCHED_SHA256 = "touched.sha256"
_DIFF = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


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
    # (path in the patched tree, project file): placed before the first patch, for every pin
    # that names them in its manifest ([series.project_files]); one copy shared by all pins.
    project_files: tuple[tuple[str, Path], ...] = ()

    @property
    def paths(self) -> list[Path]:
        return [self.directory / e.patch for e in self.entries]

    def identity(self) -> str:
        """sha256 over the series order and every patch's bytes: the build's series id."""
        h = hashlib.sha256()
        for entry, path in zip(self.entries, self.paths):
            h.update(entry.patch.encode() + b"\0" + path.read_bytes() + b"\0")
        for rel, path in self.project_files:
            data = path.read_bytes() if path.is_file() else b"(missing)"
            h.update(b"project\0" + rel.encode() + b"\0" + data + b"\0")
        return h.hexdigest()[:16]


def _project_file(layout: Layout, src: str) -> Path:
    """``src`` in the layout's root, else in the inputs an installed hpct carries, else in the
    checkout this hpct runs from (a scratch root with only manifests and patches still works)."""
    from .layout import _checkout_here, packaged_inputs
    module_checkout = Path(__file__).resolve().parents[2]
    for base in (layout.root, packaged_inputs(), _checkout_here(), module_checkout):
        if base is not None and (Path(base) / src).is_file():
            return Path(base) / src
    return layout.root / src


def project_files(layout: Layout, m: Manifest) -> tuple[tuple[str, Path], ...]:
    """The manifest's ``[series.project_files]``: (tree path, project file), sorted by tree path."""
    return tuple((rel, _project_file(layout, src))
                 for rel, src in sorted(m.extra.get("series", {}).get("project_files", {}).items()))


def load_series(layout: Layout, m: Manifest, part: str | None = None) -> Series:
    """The series of ``m``, or of its sub-folder ``part`` (patches/pytorch/2.6.0/wheel: a recipe's
    own patches, applied after the series; project files belong to the main series only)."""
    directory = layout.series_dir(m.name, m.version)
    if part is not None:
        directory = directory / part
    path = directory / "series"
    placed = project_files(layout, m) if part is None else ()
    if not path.is_file():
        return Series(m.name, m.version, directory, (), placed)
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
    return Series(m.name, m.version, directory, tuple(entries), placed)


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


def _file_diffs(text: str) -> list[tuple[str, str]]:
    """(path, diff body) for each file of a patch, in order."""
    starts = list(_DIFF.finditer(text))
    ends = [m.start() for m in starts[1:]] + [len(text)]
    return [(m.group(2), text[m.end():end]) for m, end in zip(starts, ends)]


def lint_insertion_only(path: Path) -> list[str]:
    """Problems that stop a patch from being new files plus zero-context insertions.

    Such a patch carries no line of the upstream tree: each hunk of a changed
    file is ``@@ -L,0 +M,K @@`` followed by K added lines and nothing else.
    """
    problems = []
    # git format-patch ends with a "-- \n<version>" signature that is no hunk line.
    text = path.read_text(errors="replace").split("\n-- \n", 1)[0]
    for name, body in _file_diffs(text):
        new = "\nnew file mode " in "\n" + body.split("\n@@", 1)[0]
        if re.search(r"^(deleted file mode|rename from|copy from|similarity index)", body, re.MULTILINE):
            problems.append(f"{name}: deletes, renames or copies a file")
        lines = body.split("\n")
        i = 0
        while i < len(lines):
            m = _HUNK.match(lines[i])
            if not m:
                i += 1
                continue
            old_len = int(m.group(2) if m.group(2) is not None else 1)
            new_len = int(m.group(4) if m.group(4) is not None else 1)
            if lines[i][m.end():].strip():
                problems.append(f"{name}: hunk header {lines[i]!r} carries upstream text after '@@' "
                                "(make the patch with a diff driver whose xfuncname never matches)")
            if old_len != 0:
                problems.append(f"{name}: hunk {lines[i].split(' @@')[0]} @@ removes or keeps "
                                f"{old_len} upstream line(s)")
            i += 1
            added = 0
            while i < len(lines) and not _HUNK.match(lines[i]):
                line = lines[i]
                if line.startswith("+"):
                    added += 1
                elif line.startswith((" ", "-")):
                    problems.append(f"{name}: line {line[:40]!r} is context or a removal")
                elif line and not line.startswith("\\"):
                    break
                i += 1
            if added != new_len:
                problems.append(f"{name}: hunk adds {added} line(s), its header says {new_len}")
        if not new and "@@" not in body:
            problems.append(f"{name}: no hunk")
    return problems


def new_files(path: Path) -> dict[str, str]:
    """The files a patch creates, path -> content (from its ``--- /dev/null`` diffs)."""
    text = path.read_text().split("\n-- \n", 1)[0]
    out = {}
    for name, body in _file_diffs(text):
        if "\n--- /dev/null\n" not in body:
            continue
        lines, content = body.split("\n"), []
        for line in lines[next(i for i, ln in enumerate(lines) if _HUNK.match(ln)):]:
            if line.startswith("+"):
                content.append(line[1:] + "\n")
            elif line.startswith("\\") and content:
                content[-1] = content[-1][:-1]   # "\ No newline at end of file"
        out[name] = "".join(content)
    return out


def extract_new_file(layout: Layout, m: Manifest, relpath: str, dest_dir: Path) -> Path:
    """Write the file that ``m``'s series adds at ``relpath`` into ``dest_dir``.

    The series is the one home of the project-owned sources it carries (for
    NCCL: the rootless ring and its header), so tests and compile checks take
    them from there and never need the upstream tree.
    """
    series = load_series(layout, m)
    for rel, src in series.project_files:
        if rel == relpath:
            dest = Path(dest_dir) / Path(relpath).name
            write_atomic(dest, src.read_text())
            return dest
    for path in series.paths:
        files = new_files(path)
        if relpath in files:
            dest = Path(dest_dir) / Path(relpath).name
            write_atomic(dest, files[relpath])
            return dest
    raise PatchError(f"no patch or project file of {m.name} {m.version} adds {relpath}",
                     fix=f"check the path against patches/{m.name}/{m.version}/")


def file_subset(path: Path, keep) -> str:
    """The diffs of patch ``path`` whose file ``keep(name)`` accepts, as a patch ``patch`` reads."""
    return "".join(f"diff --git a/{name} b/{name}{body}" for name, body in _file_diffs(path.read_text())
                   if keep(name))


def touched_files(series: Series) -> list[str]:
    """Every path the series changes or adds, sorted."""
    names = set()
    for path in series.paths:
        names.update(n for n, _ in _file_diffs(path.read_text(errors="replace")))
    return sorted(names)


def record_touched(series: Series, tree: Path) -> Path:
    """Write ``touched.sha256`` for ``tree`` (a freshly patched pin) beside the series."""
    out = series.directory / TOUCHED_SHA256
    lines = [f"{sha256_of(tree / name)}  {name}" for name in touched_files(series)]
    write_atomic(out, "\n".join(lines) + "\n")
    return out


def verify_touched(series: Series, tree: Path) -> int:
    """Compare every touched file of a patched tree with ``touched.sha256``; return the count.

    Zero-context hunks are placed by line number alone, so ``patch`` cannot tell
    a right place from a wrong one; the recorded digests can.
    """
    listing = series.directory / TOUCHED_SHA256
    if not listing.is_file():
        return 0
    expected = dict(reversed(ln.split(None, 1)) for ln in listing.read_text().splitlines() if ln.strip())
    missing = sorted(set(touched_files(series)) - set(expected))
    if missing:
        raise PatchError(f"{listing} lists no sha256 for {', '.join(missing)}",
                         fix=f"re-record it: hpct-build patch {series.component} --record-sha256")
    for name, want in sorted(expected.items()):
        got = sha256_of(tree / name) if (tree / name).is_file() else "missing"
        if got != want:
            raise PatchError(
                f"after applying the {series.component} {series.version} series, {name} has sha256 {got}, "
                f"the series expects {want}: the tree is not the pinned source or a hunk landed elsewhere",
                fix=f"fetch the pinned source again (hpct-build fetch {series.component} --force); if the "
                    f"series changed on purpose, re-record: hpct-build patch {series.component} --record-sha256")
    return len(expected)


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


def apply_series(series: Series, tree: Path, progress: Progress, insertion_only: bool = False,
                 verify: bool = True) -> None:
    """Apply every patch in order; stop at the first that fails, naming it.

    ``insertion_only`` (set by the manifest's ``[series] insertion_only``) refuses
    any patch that would carry an upstream line; the touched files are then
    checked against ``touched.sha256`` when it exists.
    """
    tool = _patch_tool()
    place_project_files(series, tree, progress)
    for entry, path in zip(series.entries, series.paths):
        problems = lint_patch(path) + (lint_insertion_only(path) if insertion_only else [])
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
    checked = verify_touched(series, tree) if verify else 0
    if checked:
        progress.step(f"{checked} touched files match {TOUCHED_SHA256}")


def place_project_files(series: Series, tree: Path, progress: Progress) -> None:
    """Copy the project files into ``tree``; a path upstream already has is refused (never overwritten)."""
    missing = [str(src) for _, src in series.project_files if not src.is_file()]
    if missing:
        raise PatchError(f"the {series.component} series needs the project file(s) {', '.join(missing)}, "
                         "which do not exist",
                         fix="restore them from the hpct checkout (git checkout -- src/nccl_rootless), or run "
                             "hpct-build from a checkout with --root")
    taken = [rel for rel, _ in series.project_files if (tree / rel).exists()]
    if taken:
        raise PatchError(f"{series.component} {series.version} already has {', '.join(taken)}: a project file "
                         "may only add a file, never replace an upstream one",
                         fix=f"give the project file another name in third_party/{series.component}.toml "
                             "[series.project_files]")
    for rel, src in series.project_files:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, tree / rel)
    if series.project_files:
        progress.step(f"placed {len(series.project_files)} project files "
                      f"({', '.join(rel for rel, _ in series.project_files)})")


def insertion_only(m: Manifest) -> bool:
    return bool(m.extra.get("series", {}).get("insertion_only", False))


def _copy_pristine(layout: Layout, m: Manifest, into: Path) -> None:
    src = layout.source(m.name, m.version)
    if not (src / STAMP).is_file():
        raise SourceError(f"{m.name} {m.version} is not fetched", fix=f"run `hpct-build fetch {m.name}`")
    shutil.copytree(src, into, dirs_exist_ok=True, symlinks=True, ignore=shutil.ignore_patterns(STAMP))


def check(layout: Layout, m: Manifest, progress: Progress, record: bool = False) -> Series:
    """Apply the series to a scratch copy of the pristine tree and throw it away.

    ``record`` writes the touched files' sha256 (``touched.sha256``) instead of
    checking them: for a series that changed on purpose.
    """
    series = load_series(layout, m)
    with tempfile.TemporaryDirectory(prefix=f"hpct-check-{m.name}-") as tmp:
        _copy_pristine(layout, m, Path(tmp))
        apply_series(series, Path(tmp), progress, insertion_only(m), verify=not record)
        if record:
            progress.step(f"recorded {record_touched(series, Path(tmp))}")
    return series


@one_at_a_time
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
        apply_series(series, scratch, progress, insertion_only(m))
        write_atomic(scratch / PATCHED_STAMP, json.dumps(
            {"name": m.name, "version": m.version, "series_id": ident,
             "patches": [e.patch for e in series.entries]}, indent=2) + "\n")
    progress.step(f"{m.name} {m.version}: {len(series.entries)} patches applied (series {ident})")
    return dest


def patched_info(layout: Layout, m: Manifest) -> dict | None:
    stamp = layout.patched(m.name, m.version) / PATCHED_STAMP
    return json.loads(stamp.read_text()) if stamp.is_file() else None
