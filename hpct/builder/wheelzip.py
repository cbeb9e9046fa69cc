"""Rewrite a wheel: some members replaced or added, the dist-info folder renamed, RECORD remade.

A torch wheel holds 1.5 GB of libraries in 0.77 GB of deflate.  Decompressing and compressing
it again would take minutes for the few files hpct changes, so every member that is not
changed is copied as it lies in the archive: its local header is written anew (with the new
name, when it moves) and its compressed bytes follow unchanged.  Changed and new members are
compressed here.  RECORD lists every member: an unchanged one keeps its line of the input's
RECORD (the input wheel is sha256-pinned, so its RECORD is the pin's), a changed one gets its
new digest.  The result is written beside ``dest`` and renamed, so ``dest`` is never half-written.

Only what wheels use is supported: no ZIP64 (the format's 4 GiB and 65,535-entry limits),
no encryption; anything else is refused with a BuildError.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Callable, Mapping

from ..errors import BuildError

_LOCAL = struct.Struct("<4s5H3L2H")        # local file header, without name and extra
_CENTRAL = struct.Struct("<4s6H3L5H2L")    # central directory entry, without name, extra, comment
_END = struct.Struct("<4s4H2LH")           # end of central directory record
_LOCAL_SIG, _CENTRAL_SIG, _END_SIG = b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06"
_DESCRIPTOR_FLAG = 0x08                    # sizes follow the data: not written by us
_UTF8_FLAG = 0x800
_LIMIT = 0xFFFFFFFF
CHUNK = 1 << 20
ZIP_DATE = (2024, 1, 1, 0, 0, 0)           # every member this module writes: same inputs, same bytes


def record_hash(data: bytes) -> str:
    """``sha256=<urlsafe base64, unpadded>``, as a wheel's RECORD writes it."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def read_record(z: zipfile.ZipFile, dist_info: str) -> dict[str, tuple[str, str]]:
    """name -> (hash, size) of a wheel's RECORD."""
    text = z.read(f"{dist_info}/RECORD").decode()
    return {row[0]: (row[1], row[2]) for row in csv.reader(io.StringIO(text)) if row}


def _dos_time(date_time: tuple) -> tuple[int, int]:
    y, mo, d, h, mi, s = date_time
    return (h << 11) | (mi << 5) | (s // 2), ((y - 1980) << 9) | (mo << 5) | d


class _Writer:
    """Local headers and data go out as they come; the central directory is written at close."""

    def __init__(self, out):
        self.out = out
        self.central: list[bytes] = []

    def _entry(self, name: str, *, flags: int, method: int, dostime: int, dosdate: int, crc: int, csize: int,
               usize: int, version: int, made_by: int, external: int) -> None:
        encoded = name.encode()
        offset = self.out.tell()
        if max(offset, csize, usize) >= _LIMIT or len(self.central) >= 0xFFFF:
            raise BuildError(f"{name}: the wheel outgrows the ZIP format without ZIP64",
                             fix="hpct-build writes wheels of at most 4 GiB and 65,535 files")
        flags = (flags & ~_DESCRIPTOR_FLAG) | (_UTF8_FLAG if not name.isascii() else 0)
        self.out.write(_LOCAL.pack(_LOCAL_SIG, version, flags, method, dostime, dosdate, crc, csize, usize,
                                   len(encoded), 0) + encoded)
        self.central.append(_CENTRAL.pack(_CENTRAL_SIG, made_by, version, flags, method, dostime, dosdate, crc,
                                          csize, usize, len(encoded), 0, 0, 0, 0, external, offset) + encoded)

    def copy_raw(self, src, info: zipfile.ZipInfo, name: str) -> None:
        src.seek(info.header_offset)
        head = _LOCAL.unpack(src.read(_LOCAL.size))
        if head[0] != _LOCAL_SIG or info.flag_bits & 0x1:
            raise BuildError(f"{info.filename}: not a plain member of a ZIP archive",
                             fix="hand over the wheel as PyPI serves it")
        src.seek(info.header_offset + _LOCAL.size + head[9] + head[10])
        dostime, dosdate = _dos_time(info.date_time)
        self._entry(name, flags=info.flag_bits, method=info.compress_type, dostime=dostime, dosdate=dosdate,
                    crc=info.CRC, csize=info.compress_size, usize=info.file_size, version=info.extract_version,
                    made_by=(info.create_system << 8) | info.create_version, external=info.external_attr)
        left = info.compress_size
        while left:
            chunk = src.read(min(CHUNK, left))
            if not chunk:
                raise BuildError(f"{info.filename}: the archive ends inside it", fix="download the wheel again")
            self.out.write(chunk)
            left -= len(chunk)

    def add(self, name: str, data: bytes, mode: int = 0o644) -> None:
        packer = zlib.compressobj(9, zlib.DEFLATED, -15)
        packed = packer.compress(data) + packer.flush()
        dostime, dosdate = _dos_time(ZIP_DATE)
        self._entry(name, flags=0, method=zipfile.ZIP_DEFLATED, dostime=dostime, dosdate=dosdate,
                    crc=zlib.crc32(data), csize=len(packed), usize=len(data), version=20,
                    made_by=(3 << 8) | 20, external=((0o100000 | mode) << 16))
        self.out.write(packed)

    def close(self) -> None:
        start = self.out.tell()
        for entry in self.central:
            self.out.write(entry)
        size = self.out.tell() - start
        n = len(self.central)
        self.out.write(_END.pack(_END_SIG, 0, 0, n, n, size, start, 0))


def rewrite(src: Path, dest: Path, *, dist_info: str, new_dist_info: str, changes: Mapping[str, bytes],
            modes: Mapping[str, int] | None = None, rename: Callable[[str], str] = lambda n: n) -> Path:
    """Write ``dest`` from wheel ``src``: ``changes`` (name -> bytes, named as in the result)
    replace or add members, ``dist_info`` becomes ``new_dist_info``, ``rename`` maps every other
    name, RECORD is remade.  Returns ``dest``."""
    modes = dict(modes or {})
    record_name = f"{new_dist_info}/RECORD"
    tmp = dest.with_name(f".{dest.name}.tmp")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(src) as z, open(src, "rb") as raw, open(tmp, "wb") as out:
            old_record = read_record(z, dist_info)
            writer, lines, written = _Writer(out), [], set()

            def moved(name: str) -> str:
                if name.startswith(dist_info + "/"):
                    return new_dist_info + name[len(dist_info):]
                return rename(name)

            for info in z.infolist():
                name = moved(info.filename)
                if info.is_dir() or name == record_name or name in changes:
                    continue
                if info.filename not in old_record:
                    raise BuildError(f"{src.name}: {info.filename} is not in its RECORD",
                                     fix="hand over the wheel as PyPI serves it")
                writer.copy_raw(raw, info, name)
                digest, size = old_record[info.filename]
                lines.append((name, digest, size))
                written.add(name)
            for name, data in changes.items():
                writer.add(name, data, modes.get(name, 0o644))
                lines.append((name, record_hash(data), str(len(data))))
                written.add(name)
            buf = io.StringIO()
            rows = csv.writer(buf, lineterminator="\n")
            for line in lines:
                rows.writerow(line)
            rows.writerow((record_name, "", ""))
            writer.add(record_name, buf.getvalue().encode())
            writer.close()
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest
