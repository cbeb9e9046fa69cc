"""Download one pinned .deb with ``apt-get download`` under a private APT configuration.

The configuration (one ``sources.list`` line, its own lists, cache and an empty
dpkg status) lives in ``third_party/cache/apt/``; the machine's sources, lists
and installed packages are never read or changed, and nothing is installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from ..errors import ChecksumError, ToolchainError
from . import build_cache
from .layout import Layout
from .progress import Progress
from .sources import sha256_of

# For tests and mirrors: the Debian archive the private configuration points at
# (default: the archive this machine's own `deb` entries already use).
APT_URI_ENV = "HPCT_CUDA_APT_URI"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
TIMEOUT = 900



def apt_uri() -> str | None:
    """$HPCT_CUDA_APT_URI, else the first ``.../debian`` archive (not debian-security) this
    machine's own ``deb`` entries name."""
    if os.environ.get(APT_URI_ENV):
        return os.environ[APT_URI_ENV]
    etc = Path("/etc/apt")
    for path in [etc / "sources.list", *sorted((etc / "sources.list.d").glob("*.sources")),
                 *sorted((etc / "sources.list.d").glob("*.list"))]:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.suffix == ".sources":
            uris = [u for block in re.split(r"\n\s*\n", text)
                    if re.search(r"^Types:.*\bdeb\b(?!-)", block, re.M)
                    for line in re.findall(r"^URIs:(.*)$", block, re.M) for u in line.split()]
        else:
            uris = [ln.split("]")[-1].split()[0] if "[" in ln else ln.split()[1]
                    for ln in text.splitlines() if ln.startswith("deb ") and len(ln.split()) > 2]
        for uri in uris:
            if uri.rstrip("/").endswith("/debian"):
                return uri
    return None


def download_deb(layout: Layout, dest: Path, deb: dict, progress: Progress, *, fix: str, what: str) -> Path:
    """``deb`` = {package, version, suite, component, sha256}: the verified file in ``dest``.

    ``what`` starts the error message ("no CUDA 12.4 toolchain: ..."), ``fix`` ends it.
    """
    dest.mkdir(parents=True, exist_ok=True)
    name = f"{deb['package']}=={deb['version']}"
    for cached in dest.glob(f"{deb['package']}_*.deb"):
        if sha256_of(cached) == deb["sha256"]:
            return cached
    if (kept := build_cache.reuse_download(f"{deb['package']}_*.deb", deb["sha256"], dest)) is not None:
        progress.step(f"{name}: taken from the download cache ({build_cache.downloads()})")
        return kept
    uri = apt_uri()
    if not uri:
        raise ToolchainError(f"{what} this machine lists no Debian archive to fetch {name} from", fix=fix)
    apt = layout.cache / "apt"
    for d in ("lists/partial", "archives/partial", "parts"):
        (apt / d).mkdir(parents=True, exist_ok=True)
    (apt / "status").touch()
    (apt / "sources.list").write_text(f"deb [signed-by={KEYRING}] {uri} {deb['suite']} {deb['component']}\n")
    opts = [f"-oDir::Etc::SourceList={apt / 'sources.list'}", f"-oDir::Etc::SourceParts={apt / 'parts'}",
            f"-oDir::State::Lists={apt / 'lists'}", f"-oDir::State::status={apt / 'status'}",
            f"-oDir::Cache={apt}", "-oDebug::NoLocking=1", "-oAPT::Sandbox::User=root",
            "-oAcquire::Retries=1", "-oAcquire::http::Timeout=60"]
    where = f"{uri} {deb['suite']} {deb['component']}"
    progress.step(f"downloading {deb['package']} {deb['version']} from {where} "
                  f"(private APT configuration in {apt})")
    tmp = dest / ".tmp-download"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    said: list[str] = []
    try:
        for args, cwd in ((["update"], None), (["download", f"{deb['package']}={deb['version']}"], tmp)):
            try:
                proc = subprocess.run(["apt-get", *opts, *args], cwd=cwd, capture_output=True,
                                      text=True, timeout=TIMEOUT)
            except FileNotFoundError:
                raise ToolchainError(f"{what} apt-get is missing", fix=fix) from None
            except subprocess.TimeoutExpired:
                raise ToolchainError(f"{what} apt-get {args[0]} gave no answer within {TIMEOUT} s",
                                     fix=fix) from None
            # apt-get update exits 0 after failing to fetch: keep its warnings for the message.
            said += [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln[:2] in ("E:", "W:")]
            if proc.returncode != 0:
                break
        got = sorted(tmp.glob(f"{deb['package']}_*.deb"))
        if not got:
            raise ToolchainError(f"{what} apt-get could not download {name} from {where}: "
                                 + " | ".join(said[-3:]), fix=fix)
        actual = sha256_of(got[0])
        if actual != deb["sha256"]:
            raise ChecksumError(f"{got[0].name}: sha256 {actual}, pinned {deb['sha256']} (deleted)",
                                fix="run again; if it persists, the archive serves another build")
        os.replace(got[0], dest / got[0].name)
        build_cache.keep_download(dest / got[0].name)
        return dest / got[0].name
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
