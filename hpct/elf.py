"""Read what a shared library exports and needs without loading it.

Loading a CUDA library to ask it a question needs its dependencies (libcudart)
on the search path and runs its constructors; reading the ELF file needs
neither.  Only what hpct asks is read: the SONAME, the defined dynamic symbols
and the symbol versions required from other libraries (``GLIBC_2.34``...), of
64-bit little-endian objects (x86_64, aarch64), the only ones hpct builds.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

_SHT_DYNSYM, _SHT_DYNAMIC, _SHT_VERNEED = 11, 6, 0x6FFFFFFE
_DT_SONAME = 14
_STB_GLOBAL, _STB_WEAK = 1, 2
_SHN_UNDEF, _SHN_ABS = 0, 0xFFF1     # ABS symbols are version names (GLIBC_2.2.5), not code


class ElfError(ValueError):
    """The file is not a 64-bit little-endian ELF object, or is truncated."""


@dataclass
class ElfInfo:
    path: str
    soname: str | None = None
    exports: set[str] = field(default_factory=set)      # defined global/weak dynamic symbols
    needed_versions: dict[str, set[str]] = field(default_factory=dict)   # library -> {GLIBC_2.34, ...}

    def max_version(self, prefix: str) -> tuple[int, ...] | None:
        """The newest ``<prefix>_X.Y`` required from any library, e.g. (2, 34) for GLIBC."""
        found = [tuple(int(x) for x in m.group(1).split("."))
                 for names in self.needed_versions.values() for n in names
                 if (m := re.fullmatch(rf"{re.escape(prefix)}_(\d+(?:\.\d+)*)", n))]
        return max(found) if found else None


def _cstr(blob: bytes, offset: int) -> str:
    end = blob.find(b"\0", offset)
    return blob[offset:end if end >= 0 else len(blob)].decode(errors="replace")


def read_elf(path: str | Path) -> ElfInfo:
    with open(path, "rb") as f:
        ident = f.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF":
            raise ElfError(f"{path} is not an ELF file")
        if ident[4] != 2 or ident[5] != 1:
            raise ElfError(f"{path} is not a 64-bit little-endian ELF object")
        shoff, = struct.unpack_from("<Q", ident, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", ident, 0x3A)
        if not shoff or shentsize < 64:
            raise ElfError(f"{path} has no section headers")
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        if len(table) < shentsize * shnum:
            raise ElfError(f"{path} is truncated (section headers)")
        sections = []
        for i in range(shnum):
            (_, sh_type, _, _, off, size, link, _, _, entsize) = struct.unpack_from(
                "<IIQQQQIIQQ", table, i * shentsize)
            sections.append((sh_type, off, size, link, entsize))

        def data(index: int) -> bytes:
            _, off, size, _, _ = sections[index]
            f.seek(off)
            blob = f.read(size)
            if len(blob) < size:
                raise ElfError(f"{path} is truncated (section {index})")
            return blob

        info = ElfInfo(str(path))
        for idx, (sh_type, _, _, link, entsize) in enumerate(sections):
            if sh_type == _SHT_DYNSYM:
                syms, names = data(idx), data(link)
                for off in range(0, len(syms) - 23, entsize or 24):
                    st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", syms, off)
                    if st_shndx not in (_SHN_UNDEF, _SHN_ABS) and st_info >> 4 in (_STB_GLOBAL, _STB_WEAK) and st_name:
                        info.exports.add(_cstr(names, st_name))
            elif sh_type == _SHT_DYNAMIC:
                dyn, names = data(idx), data(link)
                for off in range(0, len(dyn) - 15, 16):
                    tag, val = struct.unpack_from("<qQ", dyn, off)
                    if tag == _DT_SONAME:
                        info.soname = _cstr(names, val)
            elif sh_type == _SHT_VERNEED:
                _read_verneed(data(idx), data(link), info)
        return info


def _read_verneed(blob: bytes, names: bytes, info: ElfInfo) -> None:
    off = 0
    while off + 16 <= len(blob):
        _, cnt, file_, aux, nxt = struct.unpack_from("<HHIII", blob, off)
        versions = info.needed_versions.setdefault(_cstr(names, file_), set())
        a = off + aux
        for _ in range(cnt):
            if a + 16 > len(blob):
                break
            _, _, _, vname, anext = struct.unpack_from("<IHHII", blob, a)
            versions.add(_cstr(names, vname))
            if not anext:
                break
            a += anext
        if not nxt:
            break
        off += nxt


def manylinux_tag(info: ElfInfo, arch: str = "x86_64") -> str:
    """The manylinux platform tag the glibc symbol versions allow (never below 2.17)."""
    glibc = info.max_version("GLIBC") or (2, 17)
    major, minor = max(glibc[:2], (2, 17))
    return f"manylinux_{major}_{minor}_{arch}"
