"""What hpct needs at run time, read from its own installed metadata.

pyproject.toml is the one place where the Python floor (``requires-python``) and the
dependencies are declared; the installed wheel carries them as ``Requires-Python`` and
``Requires-Dist``, and ``hpct doctor`` checks the running interpreter against exactly
those.  torch is an extra with a range, never a base dependency: a bare ``pip install``
of the wheel must not pull a multi-gigabyte CUDA torch, and the version a user should
install depends on the machine (the two pins below).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Callable, Iterable

TORCH_CPU_PIN = "2.13.0"        # the stock CPU wheel ci/setup.sh installs and CI runs against
TORCH_PATCHED_PIN = "2.6.0"     # the PyTorch hpct's c10d/NCCL series patch (hpct-build wheel torch=2.6.0)
TORCH_NEWEST = "2.15.0"         # the newest torch hpct supports (pyproject's extra: <2.16); a newer
                                # release is admitted by a green CI on it and a one-line bump there
# The NCCL each CUDA torch pins, where hpct has a series for it: a drop-in wheel then replaces
# NVIDIA's under torch's own pin (hpct-build build nccl=V && hpct-build wheel nccl=V).
NCCL_DROP_IN = {(2, 6): "2.21.5", (2, 14): "2.30.7", (2, 15): "2.30.7"}
# The PyPI distribution each drop-in replaces (third_party/nccl.toml's pins say the same; a test checks).
NCCL_WHEEL = {"2.21.5": "nvidia-nccl-cu12", "2.30.7": "nvidia-nccl-cu13"}
NCCL_NEWEST_SERIES = "2.30.7"   # built beside torch's own NCCL where torch pins one without a series
# Extras that hpct never imports at run time: the test suite's, and the benchmarks' plotting.
NON_RUNTIME_EXTRAS = frozenset({"test", "bench"})

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")
_CLAUSE = re.compile(r"\s*(~=|===|==|!=|>=|<=|>|<)\s*([^\s,]+)\s*$")


@dataclass(frozen=True)
class Requirement:
    name: str
    spec: str                   # "" (any version) or e.g. ">=2.6,<2.14"
    extra: str | None = None    # the extra that pulls it in; None for a base dependency

    def __str__(self) -> str:
        return f"{self.name}{self.spec}"


def parse_requirement(line: str) -> Requirement:
    """One ``Requires-Dist`` value, e.g. ``torch<2.14,>=2.6; extra == "torch"``."""
    text, _, marker = line.partition(";")
    m = _NAME.match(text)
    if not m:
        raise ValueError(f"unreadable requirement {line!r}")
    spec = text[m.end():].strip().strip("()").replace(" ", "")
    extra = _EXTRA.search(marker)
    return Requirement(m.group(1).lower().replace("_", "-"), spec, extra.group(1) if extra else None)


def runtime_requirements(lines: Iterable[str]) -> list[Requirement]:
    """The base dependencies and every extra except the test-only ones."""
    reqs = [parse_requirement(line) for line in lines]
    return [r for r in reqs if r.extra not in NON_RUNTIME_EXTRAS]


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version: "2.13.0+cpu" -> (2, 13, 0), "2.14.0a0" -> (2, 14, 0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise ValueError(f"unreadable version {version!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def _cmp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    width = max(len(a), len(b))
    a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    return (a > b) - (a < b)


def satisfies(version: str, spec: str) -> bool:
    """Whether ``version`` meets every clause of ``spec`` (release numbers only; the local
    part such as ``+cpu`` is ignored, as pip does).  ValueError for a clause it cannot read."""
    have = _release(version)
    for clause in filter(None, spec.split(",")):
        m = _CLAUSE.match(clause)
        if not m:
            raise ValueError(f"unreadable version clause {clause!r}")
        op, want = m.groups()
        if op in ("==", "!=", "===") and want.endswith(".*"):
            prefix = _release(want[:-2])
            hit = have[:len(prefix)] + (0,) * max(0, len(prefix) - len(have)) == prefix
            ok = hit if op != "!=" else not hit
        elif op == "~=":
            floor = _release(want)
            if len(floor) < 2:
                raise ValueError(f"~= needs at least two release numbers: {clause!r}")
            ok = _cmp(have, floor) >= 0 and have[:len(floor) - 1] == floor[:-1]
        else:
            c = _cmp(have, _release(want))
            ok = {"==": c == 0, "===": c == 0, "!=": c != 0, ">=": c >= 0, "<=": c <= 0,
                  ">": c > 0, "<": c < 0}[op]
        if not ok:
            return False
    return True


def python_floor_text(spec: str) -> str:
    """"3.11 or newer" for ">=3.11"; the spec itself for anything else."""
    m = re.fullmatch(r">=\s*(\d+\.\d+)", spec.strip())
    return f"Python {m.group(1)} or newer" if m else f"a Python that satisfies {spec}"


def pip_command(executable: str | None = None) -> str:
    """pip of the interpreter running hpct: a bare ``pip`` may belong to another one."""
    return f"{executable or sys.executable} -m pip"


def torch_fix(executable: str | None = None, installed: str | None = None, cuda: str | None = None) -> str:
    """What to install when the torch row fails, following the build the machine has: a CUDA
    torch is never told to downgrade to the CPU wheel."""
    pip = pip_command(executable)
    if installed is not None and cuda:
        if _release(installed)[:2] > _release(TORCH_NEWEST)[:2]:
            return (f"torch {installed} is newer than hpct supports (2.6 through {TORCH_NEWEST}): "
                    f"{pip} install torch=={TORCH_NEWEST} (its CUDA build, as PyPI serves it), or an hpct "
                    f"release that admits {'.'.join(map(str, _release(installed)[:2]))}")
        return f"{pip} install torch=={TORCH_NEWEST} (its CUDA build, as PyPI serves it)"
    return (f"{pip} install torch=={TORCH_CPU_PIN} (the CPU build hpct is tested with, "
            f"as ci/setup.sh installs it); for GPUs, torch {TORCH_NEWEST} from PyPI with hpct's NCCL "
            f"(hpct-build build nccl={NCCL_NEWEST_SERIES}), or hpct's patched PyTorch {TORCH_PATCHED_PIN}: "
            f"hpct-build wheel torch={TORCH_PATCHED_PIN}")


def nccl_pin_of(torch_version: str | None) -> str | None:
    """The NCCL a CUDA torch of this version pins and hpct has a drop-in series of, else None."""
    try:
        minor = _release(torch_version or "")[:2]
    except ValueError:
        return None
    return NCCL_DROP_IN.get(minor)


def nccl_fix(torch_version: str | None) -> str:
    """How to give a CUDA torch of this version a libnccl with ncclCommInitRankRootless."""
    pin = nccl_pin_of(torch_version)
    if pin:
        return (f"torch {torch_version} pins NCCL {pin}: install hpct's drop-in wheel of it "
                f"(hpct-build build nccl={pin} --cuda-arch <your GPUs> && hpct-build wheel nccl={pin}, then "
                f"pip install the wheel it prints; torch's pin stays met)")
    return (f"torch {torch_version or '?'} pins an NCCL hpct has no series for: build hpct's "
            f"{NCCL_NEWEST_SERIES} (hpct-build build nccl={NCCL_NEWEST_SERIES} --cuda-arch <your GPUs>) and set "
            f"HPCT_NCCL_LIBRARY to its lib/libnccl.so.2; torch keeps its own NCCL beside it")


def install_fix(req: Requirement, executable: str | None = None) -> str:
    if req.name == "torch":
        return torch_fix(executable)
    return f"{pip_command(executable)} install '{req}'"


def unmet(reqs: Iterable[Requirement], version_of: Callable[[str], str]) -> list[tuple[Requirement, str]]:
    """(requirement, why) for each requirement ``version_of`` (importlib.metadata.version) fails."""
    from importlib.metadata import PackageNotFoundError
    bad = []
    for req in reqs:
        try:
            have = version_of(req.name)
        except PackageNotFoundError:
            bad.append((req, "not installed"))
            continue
        try:
            if not satisfies(have, req.spec):
                bad.append((req, f"{have} is outside {req.spec}"))
        except ValueError as err:
            bad.append((req, f"{have}: {err}"))
    return bad
