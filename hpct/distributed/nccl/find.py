"""Which libnccl hpct uses, and opening it once per process (``load()``).

In order:
1. the libnccl that torch already loaded (read from /proc/self/maps), when it exports
   ``ncclCommInitRankRootless`` (hpct's drop-in nvidia-nccl wheel replaced NVIDIA's);
2. else ``HPCT_NCCL_LIBRARY`` (a path to libnccl.so.2, e.g. a tree built by
   ``hpct-build build nccl``: third_party/build/nccl-<ver>/install/lib/libnccl.so.2);
3. else an nvidia-nccl wheel's library found on sys.path (nvidia/nccl/lib/libnccl.so.2).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from pathlib import Path
from typing import Mapping

from .library import (_OURS, LIBRARY_VAR, RTLD_LOCAL, RTLD_NOLOAD, RTLD_NOW, ROOTLESS_SYMBOL, NcclLibrary,
                       NcclLibraryError)

def torch_loaded_libnccl(maps: str = "/proc/self/maps") -> str | None:
    """The libnccl this process has mapped already (torch's, when a CUDA torch is imported);
    a library hpct opened itself does not count."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and "/libnccl.so" in parts[5]:
            path = parts[5].strip().removesuffix(" (deleted)")
            if os.path.realpath(path) not in _OURS:
                return path
    return None


def wheel_candidates(sys_path=None) -> list[str]:
    out = []
    for entry in (sys.path if sys_path is None else sys_path):
        for name in ("libnccl.so.2", "libnccl.so"):
            p = Path(entry or ".") / "nvidia" / "nccl" / "lib" / name
            if p.is_file() and str(p) not in out:
                out.append(str(p))
                break
    return out


def exports(path: str, symbol: str) -> bool:
    """Whether an already-mapped library exports ``symbol`` (dlopen of a mapped file adds nothing)."""
    try:
        lib = ctypes.CDLL(path, mode=RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)
    except OSError:
        return False
    return hasattr(lib, symbol)


def choose(env: Mapping[str, str] | None = None, *, loaded: str | None = None,
           sys_path=None) -> tuple[str, str, bool]:
    """(path, how, shared_with_torch) of the libnccl hpct should use; see the module doc."""
    env = os.environ if env is None else env
    loaded = torch_loaded_libnccl() if loaded is None else (loaded or None)
    if loaded and exports(loaded, ROOTLESS_SYMBOL):
        return loaded, "loaded by torch", True
    explicit = env.get(LIBRARY_VAR, "")
    if explicit:
        return explicit, LIBRARY_VAR, bool(loaded) and os.path.realpath(explicit) == os.path.realpath(loaded)
    if loaded:
        return loaded, "loaded by torch", True
    wheels = wheel_candidates(sys_path)
    if wheels:
        return wheels[0], "nvidia-nccl wheel", False
    raise NcclLibraryError("no libnccl found: torch has none loaded, HPCT_NCCL_LIBRARY is unset and no "
                           "nvidia-nccl wheel is on sys.path",
                           fix=f"install hpct's nvidia-nccl wheel (hpct-build wheel nccl) or set {LIBRARY_VAR}")


_cache: dict[str, NcclLibrary] = {}
_cache_lock = threading.Lock()


def load(env: Mapping[str, str] | None = None, *, require_rootless: bool = True) -> NcclLibrary:
    """The libnccl hpct uses (opened once per path per process)."""
    path, how, shared = choose(env)
    with _cache_lock:
        lib = _cache.get(path)
        if lib is None:
            lib = _cache[path] = NcclLibrary(path, how=how, shared_with_torch=shared)
    if require_rootless:
        lib.require_rootless()
    return lib


def built_libraries(root: str | os.PathLike) -> list[str]:
    """libnccl.so.2 files that ``hpct-build build nccl`` left under third_party/build."""
    return sorted(glob.glob(os.path.join(str(root), "third_party", "build", "nccl-*", "install", "lib",
                                         "libnccl.so.2")))
