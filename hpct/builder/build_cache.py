"""A content-addressed cache of finished builds, under the user's cache folder (never the checkout).

An NCCL build takes 20-30 minutes of nvcc on two cores and gives the same bytes for the same
inputs.  ``key()`` hashes every input that decides the output: the pinned tree's digest (fetch
checks every tree against it), the series id, the compiler's and nvcc's ``--version`` text, the
architectures, the function set, the link settings and this recipe's version.  A finished build's
install prefix is stored as ``<cache>/hpct/builds/<name>-<version>-<key>/`` with a manifest of
every file's size and sha256 (symlinks as links); a hit is used only when every file still matches
its manifest, anything else is a miss (and the entry is removed).  Entries are written to a
temporary folder and renamed into place, so a half-written entry never exists.

``HPCT_BUILD_CACHE=0`` turns the cache off for one run (CI measures a cold run that way).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .sources import sha256_of

RECIPE = 1                  # bump when a recipe's output changes for the same inputs
CACHE_VAR = "HPCT_BUILD_CACHE"
MANIFEST = "hpct-build-cache.json"


def enabled(env=None) -> bool:
    return (os.environ if env is None else env).get(CACHE_VAR, "1") != "0"


def root(env=None) -> Path:
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME", "~"), ".cache")
    return Path(base).expanduser() / "hpct" / "builds"


def key(inputs: dict) -> str:
    text = json.dumps({"recipe": RECIPE, **inputs}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def entry(name: str, version: str, k: str, env=None) -> Path:
    return root(env) / f"{name}-{version}-{k}"


def _files(prefix: Path) -> dict:
    out = {}
    for p in sorted(prefix.rglob("*")):
        rel = str(p.relative_to(prefix))
        if p.is_symlink():
            out[rel] = {"link": os.readlink(p)}
        elif p.is_file():
            out[rel] = {"size": p.stat().st_size, "sha256": sha256_of(p)}
    return out


def verified(path: Path) -> bool:
    """Whether a cache entry's files are exactly those its manifest lists."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        return _files(path / "install") == manifest["files"]
    except (OSError, ValueError, KeyError):
        return False


def take(name: str, version: str, k: str, prefix: Path, env=None) -> bool:
    """Copy a verified entry into ``prefix`` (replacing it); False on a miss."""
    path = entry(name, version, k, env)
    if not path.is_dir():
        return False
    if not verified(path):
        shutil.rmtree(path, ignore_errors=True)
        return False
    staging = prefix.with_name(prefix.name + ".cache-tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(path / "install", staging, symlinks=True)
    shutil.rmtree(prefix, ignore_errors=True)
    os.replace(staging, prefix)
    return True


def store(name: str, version: str, k: str, prefix: Path, inputs: dict, env=None) -> Path | None:
    """Store a finished ``prefix`` under its key (atomically); None when the cache is not writable."""
    path = entry(name, version, k, env)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        shutil.copytree(prefix, scratch / "install", symlinks=True)
        (scratch / MANIFEST).write_text(json.dumps({"inputs": inputs, "files": _files(scratch / "install")},
                                                   indent=1) + "\n")
        shutil.rmtree(path, ignore_errors=True)
        os.replace(scratch, path)
        return path
    except OSError:
        return None


# ---- pinned downloads (the CUDA 12.4 toolchain's wheels and .deb), kept for every checkout ----
# A fresh clone would fetch them again from PyPI and Debian on every run; a verified copy under
# <cache>/hpct/downloads makes such a run independent of the network.  The sha256 is the pin's,
# checked on every use, so a copy that changed is ignored (and removed).

def downloads(env=None) -> Path:
    return root(env).parent / "downloads"


def reuse_download(pattern: str, sha256: str, dest: Path, env=None) -> Path | None:
    """A kept download matching ``pattern`` with the pinned ``sha256``, copied into ``dest``."""
    if not enabled(env):
        return None
    for kept in sorted(downloads(env).glob(pattern)):
        if sha256_of(kept) != sha256:
            kept.unlink(missing_ok=True)
            continue
        dest.mkdir(parents=True, exist_ok=True)
        staging = dest / f".{kept.name}.cache-tmp"
        shutil.copy2(kept, staging)
        os.replace(staging, dest / kept.name)
        return dest / kept.name
    return None


def keep_download(path: Path, env=None) -> None:
    """Keep a verified download for later runs (written aside, then renamed); best effort."""
    if not enabled(env):
        return
    folder = downloads(env)
    try:
        kept = folder / path.name
        if kept.is_file() and kept.stat().st_size == path.stat().st_size:
            return                        # kept already (its sha256 is checked when it is used)
        folder.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=folder)
        os.close(fd)
        shutil.copy2(path, staging)
        os.replace(staging, folder / path.name)
    except OSError:
        pass
