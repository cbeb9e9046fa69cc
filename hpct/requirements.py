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
TORCH_PATCHED_PIN = "2.6.0"     # the PyTorch hpct's c10d/NCCL series patch (hpct-build build pytorch)
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


def torch_fix(executable: str | None = None) -> str:
    """Which torch to install: the tested CPU wheel, or hpct's patched build for GPUs."""
    return (f"{pip_command(executable)} install torch=={TORCH_CPU_PIN} (the CPU build hpct is tested with, "
            f"as ci/setup.sh installs it); for GPUs, hpct's patched PyTorch {TORCH_PATCHED_PIN}: "
            f"hpct-build build pytorch")


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
