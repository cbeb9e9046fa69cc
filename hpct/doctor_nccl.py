"""The doctor's NCCL rows: which libnccl torch loads and which one hpct's CUDA half uses, whether it
is hpct's (the rootless init, the abort flag) and fits torch's pin, and the nvidia-nccl wheel
that holds it.

Decision on the NCCL row: a libnccl without ``ncclCommInitRankRootless`` is a
*warning*, because stock PyTorch and hpct's Gloo backend never call it.  It is a
*failure* only when the run would call it: ``HPCT_USE_ROOTLESS=1`` with a
PyTorch that carries hpct's c10d patches and has NCCL.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

from .doctor import Probe, Row
from .doctor_c10d import series_of
from .requirements import NCCL_WHEEL, nccl_fix, nccl_pin_of, pip_command

NCCL_PIN = "2.21.5"                     # what PyTorch 2.6.0 pins
ROOTLESS_SYMBOL = "ncclCommInitRankRootless"
RAISE_ABORT_SYMBOL = "ncclCommRaiseAbortFlag"     # hpct's NCCL patch: blocking comms abort by NCCL's rules
PROBE_TIMEOUT_S = 30.0


def torch_is_patched(torch) -> bool:
    """hpct's PyTorch builds carry "hpct" in the local version (e.g. 2.6.0+hpct.<series>)."""
    return series_of(str(getattr(torch, "__version__", ""))) is not None


# The probe runs in a child process: a broken or foreign libnccl can crash or hang
# its loader, and loading it here would also pin that SONAME for a later torch import.
_NCCL_PROBE = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
v = ctypes.c_int(0)
rc = lib.ncclGetVersion(ctypes.byref(v))
print(json.dumps({"rc": rc, "code": v.value, "rootless": hasattr(lib, sys.argv[2]),
                  "raise_abort": hasattr(lib, sys.argv[3])}))
"""


def find_libnccl(probe: Probe) -> list[tuple[str, str]]:
    """Candidate libnccl.so.2 files, first = the one PyTorch would load, without importing CUDA.

    Order: a copy inside torch/lib (source builds bundle it); the nvidia-nccl-cu12
    wheel in site-packages (pip PyTorch's libtorch_cuda.so finds it through its RPATH
    $ORIGIN/../../nvidia/nccl/lib); LD_LIBRARY_PATH; the ldconfig cache.
    """
    if probe.nccl_paths is not None:
        return [(p, "given") for p in probe.nccl_paths]
    found: list[tuple[str, str]] = []

    def add(path: Path, how: str) -> None:
        if path.is_file() and str(path) not in (f for f, _ in found):
            found.append((str(path), how))

    for entry in probe.sys_path:
        base = Path(entry or ".")
        add(base / "torch" / "lib" / "libnccl.so.2", "torch/lib")
    for entry in probe.sys_path:
        add(Path(entry or ".") / "nvidia" / "nccl" / "lib" / "libnccl.so.2", "nvidia-nccl wheel")
    for entry in probe.env.get("LD_LIBRARY_PATH", "").split(":"):
        if entry:
            add(Path(entry) / "libnccl.so.2", "LD_LIBRARY_PATH")
    if probe.use_ldconfig:
        try:
            out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        for line in out.splitlines():
            if line.strip().startswith("libnccl.so.2") and "=>" in line:
                add(Path(line.split("=>", 1)[1].strip()), "ldconfig")
    return found


def probe_libnccl(path: str, timeout: float = PROBE_TIMEOUT_S) -> dict:
    """Load ``path`` in a child and return {"rc", "code", "rootless"}; raises RuntimeError."""
    try:
        done = subprocess.run([sys.executable, "-c", _NCCL_PROBE, path, ROOTLESS_SYMBOL, RAISE_ABORT_SYMBOL],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"loading {path} did not finish within {timeout:g} s") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise RuntimeError(f"loading {path} failed: {tail}")
    try:
        return json.loads(done.stdout)
    except ValueError:
        raise RuntimeError(f"loading {path} printed {done.stdout.strip()[:200]!r}") from None


def nccl_version_text(code: int) -> str:
    """NCCL >= 2.9 encodes major*10000 + minor*100 + patch (22105 -> 2.21.5)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def check_nccl(probe: Probe, torch, config) -> Row:
    cuda = torch is not None and getattr(getattr(torch, "version", None), "cuda", None) is not None
    needs_rootless = bool(config is not None and config.use_rootless and torch is not None
                          and torch_is_patched(torch) and cuda)
    # Every row's advice follows the installed torch: a stock CUDA torch keeps its own pin's
    # library (cu13 for torch 2.14/2.15); hpct's patched torch 2.6.0 the 2.21.5 one.
    version = str(getattr(torch, "__version__", "")) if torch is not None else ""
    patched = torch is not None and torch_is_patched(torch)
    pin = NCCL_PIN if patched else (nccl_pin_of(version) or NCCL_PIN)
    install = f"{pip_command()} install --no-deps {NCCL_WHEEL[pin]}=={pin}"
    candidates = find_libnccl(probe)
    if not candidates:
        if cuda:
            return Row("libnccl", "fail", "no libnccl.so.2 found (torch/lib, nvidia wheel, "
                       "LD_LIBRARY_PATH, ldconfig)", install)
        return Row("libnccl", "info", "none found; a CPU-only PyTorch does not need one")
    path, how = candidates[0]
    try:
        result = probe_libnccl(path)
    except RuntimeError as err:
        return Row("libnccl", "fail" if cuda else "warn", f"{err}{_elf_exports_text(path)}",
                   f"reinstall it: {install}")
    if result["rc"] != 0:
        return Row("libnccl", "fail" if cuda else "warn",
                   f"{path}: ncclGetVersion returned error {result['rc']}", f"reinstall it: {install}")
    detail = f"{path} ({how}): NCCL {nccl_version_text(result['code'])} ({result['code']})"
    if result["rootless"]:
        return Row("libnccl", "ok", f"{detail}, exports {ROOTLESS_SYMBOL}")
    detail += f", stock: no {ROOTLESS_SYMBOL}"
    fix = ("install hpct's NCCL wheel in its place (it replaces nvidia-nccl-cu12 and keeps torch's "
           "requirement met): hpct-build fetch nccl --source nccl-2.21.5-1.tar.gz && hpct-build build nccl "
           "&& hpct-build wheel nccl --install (docs/nccl-build.md)") if patched else nccl_fix(version)
    if needs_rootless:
        return Row("libnccl", "fail", detail + " (required: HPCT_USE_ROOTLESS=1 with hpct's PyTorch)", fix)
    return Row("libnccl", "warn", detail + " (rootless NCCL start-up unavailable)", fix)


def _elf_exports_text(path: str) -> str:
    """What the file's dynamic symbol table says, for a library that could not be loaded
    (e.g. hpct's build without libcudart.so.12 on the search path)."""
    from .elf import ElfError, read_elf
    try:
        elf = read_elf(path)
    except (ElfError, OSError):
        return ""
    if "ncclGetVersion" not in elf.exports:
        return "; its symbol table has no ncclGetVersion"
    has = ROOTLESS_SYMBOL in elf.exports
    return f"; its symbol table {'exports' if has else 'has no'} {ROOTLESS_SYMBOL}"


# The distributions a pip torch's libnccl comes from: CUDA 12 wheels (torch <= 2.8) and CUDA 13
# ones (torch 2.14.1 pins nvidia-nccl-cu13==2.30.7); hpct's drop-in wheels take the same names.
NCCL_DISTS = ("nvidia-nccl-cu12", "nvidia-nccl-cu13")
NCCL_SERIES_RECORD = ("nvidia", "nccl", "hpct-series.json")   # written by `hpct-build wheel nccl`


def check_nccl_wheel(probe: Probe) -> list[Row]:
    """The nvidia-nccl-cu12/cu13 distribution that holds the libnccl a pip PyTorch loads: NVIDIA's,
    or hpct's build (version <nccl>+hpct.<series>, with its series record).  No row without one."""
    for entry in probe.sys_path:
        site = Path(entry or ".")
        if not (site / "nvidia" / "nccl" / "lib" / "libnccl.so.2").is_file():
            continue
        dist = next((d for name in NCCL_DISTS
                     for d in importlib.metadata.distributions(name=name, path=[str(site)])), None)
        version = dist.version if dist is not None else "unknown version (no metadata)"
        dist_name = dist.metadata["Name"] if dist is not None else "nvidia-nccl"
        label = version.partition("+")[2]
        record_path = site.joinpath(*NCCL_SERIES_RECORD)
        if not label.startswith("hpct.") and not record_path.exists():
            return [Row("nccl wheel", "info", f"{dist_name} {version} in {site}: NVIDIA's build, "
                                              "no hpct series")]
        fix = "reinstall it: hpct-build wheel nccl, then pip install the wheel it prints"
        try:
            record = json.loads(record_path.read_text())
            series = str(record["series_id"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            return [Row("nccl wheel", "warn", f"{dist_name} {version} in {site}: its series record "
                                              f"{record_path.name} is unreadable ({type(err).__name__})", fix)]
        patches = [str(p) for p in record.get("patches") or []]
        archs = ",".join(str(a) for a in record.get("cuda_archs") or []) or "?"
        detail = (f"{dist_name} {version} in {site}: hpct series {series}, {len(patches)} patches"
                  f"{' (' + ', '.join(patches) + ')' if patches else ''}, CUDA {record.get('cuda', '?')}, "
                  f"sm {archs}, collectives {record.get('funcs') or 'all'}")
        if label != f"hpct.{series}":
            return [Row("nccl wheel", "warn", f"{detail}; the version label does not name that series", fix)]
        return [Row("nccl wheel", "ok", detail)]
    return []


def _series_near(lib: str) -> str | None:
    """The hpct series id recorded beside a libnccl: nvidia/nccl/hpct-series.json of hpct's wheel
    (lib/../hpct-series.json) or <install>/hpct-series.json of a built tree."""
    here = Path(lib).resolve().parent
    for cand in (here.parent / "hpct-series.json", here / "hpct-series.json"):
        try:
            return str(json.loads(cand.read_text()).get("series_id") or "") or None
        except (OSError, ValueError, AttributeError):
            continue
    return None


def torch_nccl_pin(torch) -> str | None:
    """The NCCL version torch's wheel requires (Requires-Dist nvidia-nccl-cuXX==V), if any."""
    import re
    try:
        reqs = importlib.metadata.requires("torch") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in reqs:
        m = re.match(r"nvidia-nccl-cu\d+\s*==\s*([0-9.]+)", req.replace("_", "-"))
        if m:
            return m.group(1)
    return None


class _RaiseAbort:
    """What forming.comm_kind asks of a library, from the probe's answer."""

    def __init__(self, has: bool):
        self.has_raise_abort = has


def check_nccl_for_hpct(probe: Probe, torch) -> Row:
    """Which libnccl torch loads and which one hpct's CUDA half uses (nccl_lib's rule), and which
    kind of communicator that library gives hpct's groups (forming.comm_kind's rule)."""
    from .distributed.nccl import find as nccl_find, library as nccl_lib
    from .distributed.nccl.library import comm_kind
    cuda = getattr(getattr(torch, "version", None), "cuda", None) if torch is not None else None
    if probe.nccl_paths is not None:
        torch_lib = probe.nccl_paths[0] if probe.nccl_paths else None
    else:
        torch_lib = nccl_find.torch_loaded_libnccl() or next((p for p, _ in find_libnccl(probe)), None)

    def facts(path):
        if not path:
            return None
        try:
            r = probe_libnccl(path)
        except Exception as err:   # noqa: BLE001 -- reported as the library's state
            return {"path": path, "error": str(err)}
        if r.get("rc"):
            return {"path": path, "error": f"ncclGetVersion returned error {r['rc']}"}
        return {"path": path, "version": nccl_version_text(r["code"]), "patched": bool(r["rootless"]),
                "raise_abort": bool(r.get("raise_abort")), "series_id": _series_near(path)}

    t = facts(torch_lib)
    explicit = probe.env.get(nccl_lib.LIBRARY_VAR, "")
    if t and t.get("patched"):
        hpct_lib, how = torch_lib, "the one torch loads"
    elif explicit:
        hpct_lib, how = explicit, nccl_lib.LIBRARY_VAR
    elif torch_lib:
        hpct_lib, how = torch_lib, "the one torch loads"
    else:
        wheels = nccl_find.wheel_candidates(probe.sys_path)
        hpct_lib, how = (wheels[0], "nvidia-nccl wheel") if wheels else (None, "none")
    h = facts(hpct_lib) if hpct_lib != torch_lib else (dict(t) if t else None)
    pin = torch_nccl_pin(torch) if probe.nccl_paths is None else None
    if h is not None:
        h["how"] = how
        h["matches_torch_pin"] = None if pin is None or "version" not in h else h["version"] == pin
    data = {"torch": t, "hpct": h, "torch_pin": pin}

    def describe(f):
        if f is None:
            return "none"
        if "error" in f:
            return f"{f['path']}: {f['error']}"
        kind = f"hpct series {f['series_id']}" if f.get("series_id") else ("patched" if f["patched"] else "stock")
        return f"{f['path']} (NCCL {f['version']}, {kind})"

    detail = f"torch: {describe(t)}; hpct: {describe(h)}" + (f" via {how}" if h else "")
    if h is not None and h.get("matches_torch_pin") is not None:
        detail += f"; torch pins {pin}: {'matches' if h['matches_torch_pin'] else 'differs (new functions only, same ABI)'}"
    advice = nccl_fix(str(getattr(torch, "__version__", ""))) if cuda else nccl_lib.ROOTLESS_FIX
    if h is None:
        status, fix = ("info" if not cuda else "warn"), advice
    elif "error" in h:
        status, fix = ("warn" if not cuda else "fail"), f"point {nccl_lib.LIBRARY_VAR} at a working libnccl.so.2"
    elif h["patched"]:
        status, fix = "ok", None
        kind, why = comm_kind(_RaiseAbort(h["raise_abort"]), probe.env.get("HPCT_NCCL_BLOCKING", "") != "0")
        h["comm_kind"], h["comm_kind_why"] = kind, why
        detail += f"; CUDA groups use {kind} communicators ({why})"
    else:
        status, fix = ("info" if not cuda else "warn"), advice
        detail += " (no ncclCommInitRankRootless: hpct's CUDA groups cannot start)"
    row = Row("nccl for hpct", status, detail, fix)
    row.data = data
    return row
