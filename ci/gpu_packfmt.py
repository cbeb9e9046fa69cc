"""The GPU proof's pack format: one definition for its writer (ci/gpu_pack.py, on the CPU machine)
and its reader (ci/gpu_device.py, on the device).

A pack is DIR/manifest.json plus DIR/call-N/ folders, one per device call, each holding a copy of the
manifest and the stored parts it carries.  A file is stored xz-compressed where that pays, cut into
parts when it does not fit one call; the manifest gives each file's size and sha256, and each part's
path, size, sha256 and call, so the reader verifies before it trusts and reassembles bit for bit.
Standard library only: the reader runs on the device before anything is installed.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "manifest.json"
SCHEMA = 1
CHUNK = 1 << 20
MIB = 1 << 20
LIMIT_MIB = 64            # the device tool's carry limit per call (working tree + carried paths)
XZ_PRESET = 9
MIN_SAVING = 0.05         # store a file as it is unless xz saves at least this fraction
MANIFEST_ALLOWANCE = 256 * 1024     # each call carries a manifest copy


class Refused(Exception):
    """A pack that cannot be made or used: the problem, and the fix."""

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(problem, fix)
        self.problem, self.fix = problem, fix

    def __str__(self) -> str:
        return self.problem


@dataclass
class Problem:
    what: str
    detail: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}: {self.detail}\n    fix: {self.fix}"


# ------------------------------------------------------------------------------ the manifest
def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def load_manifest(pack: Path) -> dict:
    """The pack's manifest: DIR/manifest.json, else the copy in each carried call-N/ folder
    (a pack split across calls carries one folder per call, each with the same manifest)."""
    copies = [pack / MANIFEST] if (pack / MANIFEST).is_file() else sorted(pack.glob(f"call-*/{MANIFEST}"))
    if not copies:
        raise Refused(f"no pack at {pack} (no {MANIFEST}, nor call-*/{MANIFEST})")
    texts = {c.read_text() for c in copies}
    if len(texts) != 1:
        raise Refused(f"the manifests in {pack} differ ({', '.join(str(c) for c in copies)}): parts of "
                      "two different packs")
    try:
        manifest = json.loads(texts.pop())
    except ValueError as err:
        raise Refused(f"{copies[0]} is not JSON ({err})") from None
    if manifest.get("schema") != SCHEMA:
        raise Refused(f"{copies[0]}: schema {manifest.get('schema')!r}, this script reads {SCHEMA}")
    return manifest


def verify_stored(pack: Path, manifest: dict) -> list[Problem]:
    """Every stored file (each part of each file) present with its size and sha256."""
    problems = []
    fix_damaged = "the pack was damaged or changed after packing: build it again (ci/gpu.sh --pack) and carry it"
    for entry in manifest["files"]:
        for part in entry["parts"]:
            p = pack / part["path"]
            if not p.is_file():
                problems.append(Problem("pack", f"{p} is missing (part of {entry['path']}, carried by call "
                                        f"{part['call']})", f"carry {pack}/call-{part['call']} in this call"))
                continue
            size = p.stat().st_size
            if size != part["size"]:
                problems.append(Problem("pack", f"{p}: {size} bytes, the manifest says {part['size']}", fix_damaged))
                continue
            digest = sha256_of(p)
            if digest != part["sha256"]:
                problems.append(Problem("pack", f"{p}: sha256 {digest}, the manifest says {part['sha256']}",
                                        fix_damaged))
    return problems


def unpack_file(pack: Path, entry: dict, dest: Path) -> Path:
    """Reassemble one file from its parts, decompress, verify size and sha256; write atomically."""
    out = dest / entry["path"]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    h, size = hashlib.sha256(), 0
    dec = lzma.LZMADecompressor() if entry["codec"] == "xz" else None
    if entry["codec"] not in ("xz", "none"):
        raise Refused(f"{entry['path']}: unknown codec {entry['codec']!r} (this script knows xz, none)")
    with open(tmp, "wb") as f:
        for part in entry["parts"]:
            with open(pack / part["path"], "rb") as src:
                for block in iter(lambda: src.read(CHUNK), b""):
                    data = dec.decompress(block) if dec else block
                    h.update(data)
                    size += len(data)
                    f.write(data)
    if dec is not None and not dec.eof:
        tmp.unlink()
        raise Refused(f"{entry['path']}: the xz stream ends early (a part is missing or cut)")
    if size != entry["size"] or h.hexdigest() != entry["sha256"]:
        tmp.unlink()
        raise Refused(f"{entry['path']}: unpacked {size} bytes with sha256 {h.hexdigest()}, the manifest "
                      f"says {entry['size']} bytes, {entry['sha256']}")
    os.chmod(tmp, entry.get("mode", 0o644))
    os.replace(tmp, out)
    return out


# ------------------------------------------------------------------------------ writing
@dataclass
class Source:
    """One logical file of the pack."""
    path: str                # where it lands on the device (under the install's files/)
    src: Path
    role: str
    module: str | None = None
    mode: int = 0o644


@dataclass
class Stored:
    source: Source
    size: int
    sha256: str
    codec: str
    blob: Path               # the stored form (compressed or a copy)
    blob_size: int
    seconds: float = 0.0
    parts: list = field(default_factory=list)


def xz(src: Path, dst: Path, preset: int = XZ_PRESET) -> float:
    t0 = time.monotonic()
    comp = lzma.LZMACompressor(format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=preset)
    with open(src, "rb") as f, open(dst, "wb") as out:
        for block in iter(lambda: f.read(CHUNK), b""):
            out.write(comp.compress(block))
        out.write(comp.flush())
    return time.monotonic() - t0


def store(source: Source, work: Path, compress: bool = True) -> Stored:
    """The stored form of one file: xz when that saves MIN_SAVING, else the file as it is."""
    size, digest = source.src.stat().st_size, sha256_of(source.src)
    work.mkdir(parents=True, exist_ok=True)
    blob = work / (hashlib.sha256(source.path.encode()).hexdigest()[:16] + ".blob")
    seconds = 0.0
    if compress and size > 4096:
        seconds = xz(source.src, blob)
        if blob.stat().st_size <= size * (1 - MIN_SAVING):
            return Stored(source, size, digest, "xz", blob, blob.stat().st_size, seconds)
    shutil.copyfile(source.src, blob)
    return Stored(source, size, digest, "none", blob, size, seconds)


def plan_calls(stored: list[Stored], budget: int, max_calls: int) -> int:
    """Cut stored blobs into parts of at most ``budget - MANIFEST_ALLOWANCE`` bytes and place
    them into calls (first fit, largest first); returns the number of calls.  Refuses, naming
    the largest files, when more than ``max_calls`` would be needed."""
    room = budget - MANIFEST_ALLOWANCE
    total = sum(s.blob_size for s in stored)
    largest = sorted(stored, key=lambda s: s.blob_size, reverse=True)[:3]
    names = ", ".join(f"{s.source.path} ({s.blob_size / MIB:.1f} MiB stored, {s.size / MIB:.1f} MiB unpacked)"
                      for s in largest)
    if room <= 0:
        raise Refused(f"no room for a pack: the budget per call is {budget / MIB:.1f} MiB",
                      "carry a smaller working tree, or lower --margin-mib")
    pieces = []
    for s in stored:
        s.parts = []
        offsets = range(0, max(s.blob_size, 1), room)
        for i, off in enumerate(offsets):
            piece = {"stored": s, "index": i, "offset": off, "size": min(room, s.blob_size - off),
                     "split": len(offsets) > 1}
            s.parts.append(piece)
            pieces.append(piece)
    calls: list[int] = []
    for piece in sorted(pieces, key=lambda p: p["size"], reverse=True):
        for i, used in enumerate(calls):
            if used + piece["size"] <= room:
                calls[i] += piece["size"]
                piece["call"] = i + 1
                break
        else:
            calls.append(piece["size"])
            piece["call"] = len(calls)
    if len(calls) > max_calls:
        raise Refused(f"the pack is {total / MIB:.1f} MiB stored, more than {max_calls} call(s) of "
                      f"{budget / MIB:.1f} MiB each carry ({LIMIT_MIB} MiB per call less the working tree and "
                      f"the margin); largest: {names}",
                      "build only the proof's functions (--funcs proof), or split across back-to-back calls "
                      f"(--max-calls {len(calls)})")
    return len(calls)


def carry_path(dest: Path, root: Path = ROOT) -> str:
    """How a device call names ``dest``: relative to the checkout's root (the tool's carry)."""
    try:
        return str(dest.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(dest)


def write_pack(stored: list[Stored], dest: Path, n_calls: int, meta: dict) -> dict:
    """Write the parts and the manifest into a staging folder, then rename it into ``dest``."""
    if dest.exists() and not (dest / MANIFEST).is_file() and any(dest.iterdir()):
        raise Refused(f"{dest} exists and is not a pack (no {MANIFEST})",
                      "name a new or empty folder, e.g. build/gpu-pack")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    files = []
    for s in stored:
        suffix = ".xz" if s.codec == "xz" else ""
        parts = []
        with open(s.blob, "rb") as blob:
            for piece in s.parts:
                rel = f"call-{piece['call']}/{s.source.path}{suffix}" + (f".part{piece['index']:03d}" if piece["split"] else "")
                out = staging / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                blob.seek(piece["offset"])
                out.write_bytes(blob.read(piece["size"]))
                parts.append({"path": rel, "size": piece["size"], "sha256": sha256_of(out), "call": piece["call"]})
        entry = {"path": s.source.path, "size": s.size, "sha256": s.sha256, "codec": s.codec, "role": s.source.role,
                 "mode": s.source.mode, "stored_size": s.blob_size, "parts": parts}
        if s.source.module:
            entry["module"] = s.source.module
        files.append(entry)
    ident = hashlib.sha256(json.dumps([[f["path"], f["sha256"]] for f in files]).encode()).hexdigest()[:16]
    calls = [{"call": c, "bytes": sum(p["size"] for f in files for p in f["parts"] if p["call"] == c),
              "carry": f"{carry_path(dest)}/call-{c}"} for c in range(1, n_calls + 1)]
    manifest = {"schema": SCHEMA, "pack_id": ident, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **meta, "files": files, "calls": calls,
                "total_bytes": sum(f["size"] for f in files),
                "total_stored_bytes": sum(f["stored_size"] for f in files)}
    text = json.dumps(manifest, indent=1) + "\n"
    _write_atomic(staging / MANIFEST, text)
    for c in range(1, n_calls + 1):
        _write_atomic(staging / f"call-{c}" / MANIFEST, text)
    for c in calls:       # the invariant the device tool's limit needs, checked on what was written
        carried = sum(p.stat().st_size for p in (staging / f"call-{c['call']}").rglob("*") if p.is_file())
        if carried > meta.get("budget_bytes", carried):
            shutil.rmtree(staging, ignore_errors=True)
            raise Refused(f"call {c['call']} would carry {carried} bytes, over the budget of {meta['budget_bytes']} "
                          f"(its manifest copy is larger than the {MANIFEST_ALLOWANCE} bytes set aside)",
                          "raise MANIFEST_ALLOWANCE in ci/gpu_pack.py")
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    if dest.exists():
        os.replace(dest, old)
    os.replace(staging, dest)
    shutil.rmtree(old, ignore_errors=True)
    return manifest


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def pack(sources: list[Source], dest: Path, *, limit: int, tree: int, margin: int, max_calls: int,
         meta: dict, work: Path, compress: bool = True) -> dict:
    """Store, plan, write: the whole packing step, for real files or a test's small ones."""
    budget = limit - tree - margin
    stored = [store(s, work, compress) for s in sources]
    n_calls = plan_calls(stored, budget, max_calls)
    meta = {**meta, "limit_bytes": limit, "tree_bytes": tree, "margin_bytes": margin, "budget_bytes": budget,
            "compress_seconds": round(sum(s.seconds for s in stored), 1)}
    try:
        return write_pack(stored, dest, n_calls, meta)
    finally:
        shutil.rmtree(work, ignore_errors=True)
