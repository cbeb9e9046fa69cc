"""Pinned upstream sources: manifests, providers, sha256 checks, unpacking.

A manifest (``third_party/<name>.toml``) pins one version and lists providers in
the order they are tried.  Every archive is checked against its sha256 before it
is unpacked; a mismatch deletes the archive and is an error, never a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, its origin (scikit-build-core depends on it there)
    tomllib = None
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ChecksumError, ConfigError, SourceError, ToolchainError
from .layout import Layout, atomic_dir, write_atomic
from .locks import one_at_a_time
from .progress import Progress

STAMP = ".hpct-source.json"


@dataclass(frozen=True)
class Provider:
    kind: str                     # "debian" | "url"
    file: str
    sha256: str
    strip_components: int = 1
    url: str = ""
    package: str = ""
    debian_version: str = ""
    size: int = 0


@dataclass(frozen=True)
class Manifest:
    name: str
    version: str
    license: str
    upstream_url: str
    identity: dict
    providers: tuple[Provider, ...]
    note: str = ""
    extra: dict = field(default_factory=dict)

    def known_sha256(self) -> dict[str, Provider]:
        return {p.sha256: p for p in self.providers}


def components(layout: Layout) -> list[str]:
    return sorted(p.stem for p in layout.manifests.glob("*.toml"))


def _pins(data: dict) -> list[dict]:
    """The pins of a manifest: its ``[[pins]]`` tables, or the top level as the one pin."""
    return data.get("pins") or [data]


def pinned_versions(layout: Layout, name: str) -> list[str]:
    """Every version ``third_party/<name>.toml`` pins, the default first."""
    path = layout.manifests / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"unknown component {name!r}", fix=f"choose one of: {', '.join(components(layout))}")
    data = _toml().loads(path.read_text())
    versions = [p["version"] for p in _pins(data)]
    default = data.get("default", versions[0])
    return [default] + [v for v in versions if v != default]


def load_manifest(layout: Layout, name: str, version: str | None = None) -> Manifest:
    """The manifest of ``name`` at ``version`` (default: the manifest's ``default`` pin).

    A manifest pins one version at its top level, or several as ``[[pins]]`` tables
    (NCCL: one per PyTorch it serves); top-level keys other than ``pins`` and
    ``default`` are shared by every pin.
    """
    path = layout.manifests / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"unknown component {name!r}",
                          fix=f"choose one of: {', '.join(components(layout))}")
    data = _toml().loads(path.read_text())
    pins = _pins(data)
    pinned = [p["version"] for p in pins]
    want = version or data.get("default") or pinned[0]
    if want not in pinned:
        raise ConfigError(f"{name} version {want!r} is not pinned (pinned: {', '.join(pinned)})",
                          fix=f"use {' or '.join(f'{name}={v}' for v in pinned)}, or add a pin to "
                              f"third_party/{name}.toml and patches/{name}/{want}/")
    pin = dict(next(p for p in pins if p["version"] == want))
    shared = {k: v for k, v in data.items() if k not in ("pins", "default")} if "pins" in data else {}
    merged = {**shared, **pin}
    providers = tuple(Provider(**p) for p in merged.pop("providers", []))
    return Manifest(name=merged.pop("name"), version=merged.pop("version"), license=merged.pop("license"),
                    upstream_url=merged.pop("upstream_url"), identity=merged.pop("identity", {}),
                    providers=providers, note=merged.pop("note", ""), extra=merged)


def _toml():
    if tomllib is not None:
        return tomllib
    try:
        import tomli
    except ModuleNotFoundError:
        raise ToolchainError("hpct-build reads its manifests with tomllib (Python 3.11+) or tomli, "
                             "and this Python 3.10 has neither",
                             fix="python3 -m pip install tomli  (or run hpct-build with Python 3.11+)") from None
    return tomli


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_digest(root: Path) -> str:
    """sha256 over every regular file's relative path and content, sorted.

    Stable across archive formats and compressions, so a tree unpacked from any
    provider, or a checkout handed over with --source, can be recognised.
    """
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = path.relative_to(root).as_posix()
        if rel == STAMP or rel.startswith(".git/"):
            continue
        h.update(f"{rel}\0{sha256_of(path)}\n".encode())
    return h.hexdigest()


def check_identity(m: Manifest, tree: Path, label: str | None = None) -> None:
    """Raise SourceError unless ``tree`` is the pinned version of ``m``."""
    ident = m.identity
    label = label or str(tree)
    # The version first: for a tree of another version it is the message that helps.
    if "version_file" in ident:
        vf = tree / ident["version_file"]
        text = vf.read_text(errors="replace") if vf.is_file() else ""
        if not re.search(ident["version_regex"], text, re.MULTILINE):
            found = text.strip().splitlines()[0] if text.strip() else "no such file"
            raise SourceError(
                f"{label} is not {m.name} {m.version} ({ident['version_file']}: {found})",
                fix=f"hand over the pinned version ({m.upstream_url})")
    if "tree_sha256" in ident:
        actual = tree_digest(tree)
        if actual != ident["tree_sha256"]:
            raise SourceError(
                f"{label} is not {m.name} {m.version}: its tree digest is {actual}, "
                f"the pin is {ident['tree_sha256']}",
                fix=f"hand over the pinned tree ({m.upstream_url})")


def verify_archive(archive: Path, expected: str) -> None:
    actual = sha256_of(archive)
    if actual != expected:
        archive.unlink(missing_ok=True)
        raise ChecksumError(
            f"sha256 mismatch for {archive.name}: expected {expected}, got {actual}; "
            "the archive has been deleted",
            fix="fetch again; if it persists the provider serves a different file than the pin")


def _apt_download(p: Provider, dest_dir: Path) -> None:
    if not shutil.which("apt-get"):
        raise SourceError("apt-get is not available to fetch a Debian source package",
                          fix="run on Debian or Ubuntu")
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        # apt exits 100 when the .dsc is gone from the pool even after it saved the
        # tarballs, so success is judged by the file and its sha256, not the code.
        proc = subprocess.run(["apt-get", "source", "--download-only", f"{p.package}={p.debian_version}"],
                              cwd=tmp, capture_output=True, text=True, timeout=600)
        got = Path(tmp) / p.file
        if got.is_file():
            got.replace(dest_dir / p.file)
            return
        out = proc.stderr + proc.stdout
        if "deb-src" in out or "Unable to find a source package" in out:
            raise SourceError(
                f"no deb-src entry lets apt find {p.package}={p.debian_version}",
                fix="run `ci/setup.sh` (it adds the deb-src entry and runs apt-get update)")
        last = out.strip().splitlines()[-1] if out.strip() else f"exit {proc.returncode}"
        raise SourceError(f"apt-get source {p.package}={p.debian_version} failed: {last}",
                          fix="check the network and run `apt-get update`")


def _url_download(p: Provider, dest: Path, progress: Progress) -> None:
    import urllib.error
    import urllib.request
    tmp = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(p.url, timeout=20) as resp, open(tmp, "wb") as out:
            total = int(resp.headers.get("Content-Length") or 0)
            done = 0
            for chunk in iter(lambda: resp.read(1 << 20), b""):
                out.write(chunk)
                done += len(chunk)
                progress.bytes(done, total)
        tmp.replace(dest)
    except (urllib.error.URLError, OSError) as err:
        tmp.unlink(missing_ok=True)
        raise SourceError(f"cannot download {p.url}: {err}",
                          fix="check the network")


def obtain_archive(layout: Layout, m: Manifest, progress: Progress) -> tuple[Path, Provider]:
    """The verified archive from the first provider that has it (cache first)."""
    layout.cache.mkdir(parents=True, exist_ok=True)
    errors: list[SourceError] = []
    for p in m.providers:
        archive = layout.cache / p.file
        if archive.is_file() and sha256_of(archive) == p.sha256:
            progress.step(f"{archive.name}: cached, sha256 ok")
            return archive, p
        progress.step(f"downloading {p.file} ({p.kind})")
        try:
            if p.kind == "debian":
                _apt_download(p, layout.cache)
            else:
                _url_download(p, archive, progress)
        except SourceError as err:
            errors.append(err)
            continue
        verify_archive(archive, p.sha256)
        progress.step(f"{archive.name}: sha256 ok")
        return archive, p
    env = f"HPCT_{m.name.upper()}_SOURCE"
    fixes = [e.fix for e in errors if e.fix and "--source" not in e.fix]
    fixes.append(f"download {m.upstream_url} yourself and pass it with --source PATH or {env}=PATH "
                 "(a tarball or an unpacked tree)")
    raise SourceError(
        f"no provider could supply {m.name} {m.version}: "
        + "; ".join([e.problem for e in errors] or ["none listed"]),
        fix="; or ".join(fixes))


def _unpack(archive: Path, into: Path, strip: int) -> None:
    with tarfile.open(archive) as tar:
        members = []
        for member in tar.getmembers():
            parts = Path(member.name).parts[strip:]
            if not parts:
                continue
            member.name = str(Path(*parts))
            members.append(member)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(into, members=members, filter="data")
            return
        # Python < 3.11.4 (Debian 12's 3.11.2) has no extraction filters: refuse by hand what
        # the "data" filter refuses, so an archive can never write outside ``into``.  A link is
        # judged by where it resolves, as the filter judges it, one member at a time against what
        # is on disk already: PyTorch's tree holds relative links that climb and stay inside
        # (functorch/docs/source/notebooks -> ../../notebooks), which a refusal of every ".." refused.
        root = os.path.realpath(into)

        def inside(path: str) -> bool:
            return os.path.commonpath([root, os.path.realpath(path)]) == root
        for member in members:
            parts = Path(member.name).parts
            if member.name.startswith("/") or ".." in parts or member.isdev() \
                    or not inside(os.path.join(into, member.name)):
                raise SourceError(f"{archive.name}: unsafe member {member.name!r}",
                                  fix="use the pinned archive; this one is not it")
            if member.issym() or member.islnk():
                base = os.path.dirname(member.name) if member.issym() else ""
                if member.linkname.startswith("/") or not inside(os.path.join(into, base, member.linkname)):
                    raise SourceError(f"{archive.name}: link {member.name!r} points outside the tree",
                                      fix="use the pinned archive; this one is not it")
            tar.extract(member, into)


def _strip_for_unknown(archive: Path) -> int:
    """A tarball with one top folder is stripped of it, as upstream tag tarballs are."""
    with tarfile.open(archive) as tar:
        tops = {Path(n).parts[0] for n in tar.getnames() if Path(n).parts}
    return 1 if len(tops) == 1 else 0


@one_at_a_time
def fetch(layout: Layout, m: Manifest, progress: Progress, source: Path | None = None,
          force: bool = False) -> Path:
    """Make ``third_party/src/<name>-<version>`` the verified pinned tree."""
    dest = layout.source(m.name, m.version)
    if (dest / STAMP).is_file() and not force:
        progress.step(f"{m.name} {m.version}: already fetched at {dest}")
        return dest
    started = time.monotonic()
    origin: dict
    with atomic_dir(dest) as scratch:
        if source is not None:
            origin = _from_local(m, Path(source), scratch, progress)
        else:
            archive, p = obtain_archive(layout, m, progress)
            progress.step(f"unpacking {archive.name}")
            _unpack(archive, scratch, p.strip_components)
            origin = {"provider": p.kind, "archive": archive.name, "sha256": p.sha256}
        check_identity(m, scratch, str(source) if source is not None else None)
        write_atomic(scratch / STAMP, json.dumps(
            {"name": m.name, "version": m.version, **origin}, indent=2) + "\n")
    progress.step(f"{m.name} {m.version}: fetched into {dest} in {time.monotonic() - started:.1f} s")
    return dest


def _from_local(m: Manifest, source: Path, scratch: Path, progress: Progress) -> dict:
    if not source.exists():
        raise SourceError(f"--source {source} does not exist", fix="pass an existing tarball or directory")
    if source.is_dir():
        progress.step(f"copying tree {source}")
        shutil.copytree(source, scratch, dirs_exist_ok=True, symlinks=True,
                        ignore=shutil.ignore_patterns(".git", STAMP))
        return {"provider": "local-tree", "path": str(source)}
    digest = sha256_of(source)
    pinned = m.known_sha256().get(digest)
    progress.step(f"unpacking {source.name}")
    try:
        _unpack(source, scratch, pinned.strip_components if pinned else _strip_for_unknown(source))
    except (tarfile.TarError, EOFError, OSError) as err:  # lzma/gzip truncation surfaces as EOFError
        raise SourceError(f"--source {source} is not a readable tarball: {err}",
                          fix="pass a .tar.gz/.tar.xz archive or an unpacked tree")
    return {"provider": "local-archive", "path": str(source), "sha256": digest,
            "sha256_pinned": bool(pinned)}


def fetched_info(layout: Layout, m: Manifest) -> dict | None:
    stamp = layout.source(m.name, m.version) / STAMP
    return json.loads(stamp.read_text()) if stamp.is_file() else None
