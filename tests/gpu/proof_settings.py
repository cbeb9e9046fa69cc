"""The GPU proof's settings, in one place (issue 27, defect 10).

The proof compares hpct's NCCL engine with torch's own ProcessGroupNCCL.  A fair comparison
needs both on the SAME libnccl, with one reduction order, on inputs whose sums are exact:

* the same library: torch 2.11 on the device loads its own NCCL (2.28.9), hpct loads the
  pack's patched 2.30.7.  ``LD_PRELOAD`` of the pack's libnccl.so.2 makes the dynamic linker
  hand that library to torch's ``DT_NEEDED libnccl.so.2`` (an already loaded object with that
  SONAME satisfies it), and hpct then finds it mapped (nccl_lib.choose: "loaded by torch").
  LD_PRELOAD alone is not enough: torch's ``__init__`` also opens ``nvidia/nccl/lib/libnccl.so.*``
  by its full path from the first ``sys.path`` entry that has one, a second copy, and on the
  device (2026-11-26, torch 2.11.0+cu130) torch bound to that copy.  So the ranks also get a
  folder first on PYTHONPATH whose ``nvidia/nccl/lib/libnccl.so.2`` is the pack's file
  (torch_overlay): torch's own loader then opens the preloaded file again, one copy in all;
* one reduction order: ``NCCL_ALGO=Ring``, ``NCCL_PROTO=Simple`` and one channel, so both
  stacks run the same kernel over the same ring with the same chunking;
* exact sums: integer-valued inputs small enough that every partial sum, in any order, is an
  integer the dtype represents exactly (fp16 and bf16 included), so a result can also be
  checked against a value computed on the CPU, not only against the other stack.  That
  second check matters: NCCL turns a collective that was left out of a reduced build
  (ONLY_FUNCS) into a no-op, and two stacks doing nothing agree with each other.

Imported by tests/gpu (on the device) and by tests/test_gpu_pack.py (CPU, in CI).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

# One reduction order in both stacks (NCCL reads these at communicator creation).

PINS = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": "1", "NCCL_MAX_NCHANNELS": "1"}
# Set by ci/gpu_device.py for the test process; the ranks get proof_env() of them.
LIBNCCL_VAR = "GPU_PROOF_LIBNCCL"
CUDART_VAR = "GPU_PROOF_CUDART_DIR"
OVERLAY_VAR = "GPU_PROOF_TORCH_OVERLAY"
# Where torch's __init__ looks for the NCCL it preloads, under each sys.path entry.
TORCH_NCCL_PLACE = ("nvidia", "nccl", "lib", "libnccl.so.2")
# The ONLY_FUNCS spec (hpct-build build nccl --funcs) that builds what the proof can reach under
# PINS: every collective, reduction and type except fp8, but Ring/Simple only (the algorithms x
# protocols cut is most of the size).  Not only the proof's own calls: torch's side issues its
# own (DDP with find_unused_parameters all-reduces an int32 map, barriers, shape checks), and a
# function left out would run as a silent no-op.  One entry per collective and type, since
# hpct-build splits the spec at '|' and wants each entry to start with a collective's name.
PROOF_TYPES = ("i8", "u8", "i32", "u32", "i64", "u64", "f16", "f32", "f64", "bf16")
PROOF_FUNCS = "|".join(
    [f"{coll} * {ty} RING SIMPLE" for coll in ("AllReduce", "Reduce", "ReduceScatter") for ty in PROOF_TYPES]
    + ["AllGather RING SIMPLE", "Broadcast RING SIMPLE", "SendRecv"])


class ProofSettingsError(ValueError):
    """A setting the proof cannot run with; the message names the fix."""


def proof_env(libnccl: str | os.PathLike, cudart_dir: str | os.PathLike | None = None,
              base: Mapping[str, str] | None = None, overlay: str | os.PathLike | None = None) -> dict[str, str]:
    """The variables every rank gets, stock and hpct alike (merge them over the environment).

    ``libnccl``: the pack's libnccl.so.2 (absolute, existing).  ``cudart_dir``: the folder of
    the libcudart.so.13 torch loads, put first on LD_LIBRARY_PATH so that the preloaded
    library (whose RUNPATH names a wheel layout the pack does not have) finds that same copy.
    ``base``: the environment the ranks inherit (default os.environ): its LD_PRELOAD,
    LD_LIBRARY_PATH and PYTHONPATH are kept, after ours.  ``overlay``: torch_overlay()'s folder,
    put first on PYTHONPATH.
    """
    base = os.environ if base is None else base
    lib = Path(libnccl)
    if not lib.is_absolute() or not lib.is_file():
        raise ProofSettingsError(f"{LIBNCCL_VAR}={libnccl}: not an existing absolute path to libnccl.so.2 "
                                 "(run the proof through ci/gpu.sh, which unpacks the pack's library)")
    env = dict(PINS)
    env["LD_PRELOAD"] = _prepend(str(lib), base.get("LD_PRELOAD", ""))
    env["HPCT_NCCL_LIBRARY"] = str(lib)          # the same file: hpct never opens another copy
    env["NCCL_SOCKET_IFNAME"] = "lo"
    if cudart_dir:
        env["LD_LIBRARY_PATH"] = _prepend(str(cudart_dir), base.get("LD_LIBRARY_PATH", ""))
    if overlay:
        env["PYTHONPATH"] = _prepend(str(overlay), base.get("PYTHONPATH", ""))
    return env


def torch_overlay(libnccl: str | os.PathLike, root: str | os.PathLike) -> Path:
    """Make ``root`` a folder whose nvidia/nccl/lib/libnccl.so.2 is a link to ``libnccl`` and
    return it.  First on PYTHONPATH, it is where torch's own preload finds NCCL, so torch opens
    the pack's file (the one LD_PRELOAD mapped: the same file is mapped once) instead of its
    wheel's.  ``root/nvidia`` has no __init__.py, so ``import nvidia`` still finds the wheels'
    package.  Replaced atomically; idempotent."""
    root = Path(root)
    link = root.joinpath(*TORCH_NCCL_PLACE)
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(link.name + f".tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(Path(libnccl).resolve())
    os.replace(tmp, link)
    return root


def from_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """proof_env() of the variables ci/gpu_device.py sets for the test process."""
    environ = os.environ if environ is None else environ
    lib = environ.get(LIBNCCL_VAR, "")
    if not lib:
        raise ProofSettingsError(f"{LIBNCCL_VAR} is unset: the proof runs both stacks on the pack's "
                                 "libnccl; run it through ci/gpu.sh (which sets it)")
    return proof_env(lib, environ.get(CUDART_VAR) or None, environ, environ.get(OVERLAY_VAR) or None)


def mapped_libnccl(maps: str | None = None) -> list[str]:
    """The libnccl files this process has mapped (real paths), from /proc/self/maps or ``maps``
    (its text).  Under proof_env() exactly one: the pack's, shared by torch and hpct."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    found = set()
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and "/libnccl.so" in parts[5]:
            found.add(os.path.realpath(parts[5].strip().removesuffix(" (deleted)")))
    return sorted(found)


def start_rank():
    """A rank's start in every worker of tests/gpu: (rank, n, device, mode) once CUDA is up and
    the process is under the proof's settings (the one libnccl, the pins), else it exits naming
    what is wrong (nothing after that would mean anything)."""
    import sys
    import torch
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(0)
    torch.cuda.init()
    want = os.path.realpath(os.environ["HPCT_NCCL_LIBRARY"])
    if mapped_libnccl() != [want] or any(os.environ.get(k) != v for k, v in PINS.items()):
        sys.exit(f"rank {rank}: not under the proof's settings: libnccl mapped {mapped_libnccl()} (want "
                 f"[{want}]), pins {[(k, os.environ.get(k)) for k in PINS]}")
    return rank, n, torch.device("cuda", 0), os.environ["GPU_PROOF_MODE"]


def _prepend(first: str, rest: str) -> str:
    parts = [first] + [p for p in rest.split(":") if p and p != first]
    return ":".join(parts)


# ------------------------------------------------------------------------------ exact inputs
# Bits of precision: every integer of magnitude <= 2**bits is exactly representable.
_PRECISION = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53, "int32": 31, "int64": 63}
CAP = 1 << 20     # larger float32 ranges prove nothing more, and keep the numbers readable


def precision_bits(dtype) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in _PRECISION:
        raise ProofSettingsError(f"no exactness rule for {dtype}: use one of {', '.join(sorted(_PRECISION))}")
    return _PRECISION[name]


def input_bound(dtype, n: int) -> int:
    """Largest |x| per element such that the sum over ``n`` ranks, in any order and any
    grouping, and the average (x/n summed, n a power of two) stay exact.

    Any partial sum is at most sum(|x_r|) <= n*B <= 2**bits, an integer the dtype holds.  For
    AVG, NCCL multiplies each float input by 1/n first (PreMulSum): with n a power of two that
    is an exponent shift, so the terms and partial sums are the integers above scaled by 1/n."""
    if n < 1:
        raise ProofSettingsError(f"{n} ranks: the proof needs at least one")
    return max(1, min((1 << precision_bits(dtype)) // n, CAP))


def proof_input(rank: int, n: int, dtype, numel: int, seed: int = 1234):
    """Rank ``rank``'s input: integers in [-B, B] (input_bound), a pure function of its
    arguments so that every rank can compute every other rank's input (for expected())."""
    import torch
    bound = input_bound(dtype, n)
    g = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank)
    return torch.randint(-bound, bound + 1, (numel,), generator=g, dtype=torch.int64).to(dtype)


def exact_in(inputs, dtype) -> bool:
    """Whether every element's sum of magnitudes over the ranks is within the dtype's exact
    integer range, and every input is integer valued (what input_bound promises)."""
    import torch
    limit = 1 << precision_bits(dtype)
    wide = [t.to(torch.float64) if t.is_floating_point() else t.to(torch.int64) for t in inputs]
    if any(not torch.equal(w, w.round()) for w in wide if w.is_floating_point()):
        return False
    total = sum(w.abs().to(torch.float64) for w in wide)     # float64: 2**63 does not fit an int64
    return bool((total <= float(limit)).all())


def avg_is_exact(n: int) -> bool:
    """AVG is checked against a CPU value only where 1/n is exact (n a power of two)."""
    return n >= 1 and (n & (n - 1)) == 0


def expected_reduce(op: str, inputs, dtype):
    """The exact result of reducing ``inputs`` (one tensor per rank) with ``op`` (SUM, MAX,
    MIN, AVG), computed wide on the CPU and cast to ``dtype``."""
    import torch
    wide = torch.stack([t.to(torch.float64) if t.is_floating_point() else t.to(torch.int64) for t in inputs])
    if op == "SUM":
        out = wide.sum(0)
    elif op == "MAX":
        out = wide.max(0).values
    elif op == "MIN":
        out = wide.min(0).values
    elif op == "AVG":
        if not avg_is_exact(len(inputs)):
            raise ProofSettingsError(f"AVG over {len(inputs)} ranks is not exact (1/{len(inputs)} is not a "
                                     "power of two): compare it with the other stack only")
        out = wide.sum(0) / len(inputs)
    else:
        raise ProofSettingsError(f"no expected value for {op}: use SUM, MAX, MIN or AVG")
    return out.to(dtype)


def chunk(t, n: int, i: int):
    """Rank i's chunk of an n-way split (reduce_scatter, all_to_all)."""
    size = t.numel() // n
    return t[i * size:(i + 1) * size]
