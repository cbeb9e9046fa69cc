"""hpct's declared requirements: parsing, version ranges, and the doctor rows built on them.

The installed wheel's metadata is the source (pyproject.toml's ``requires-python``,
``dependencies`` and extras); fake metadata drives the rows into every state.
"""

from __future__ import annotations

import email.message
import importlib.metadata
import re
import sys
import tomllib

import pytest

from hpct import doctor, requirements
from hpct.doctor import Probe
from hpct.requirements import Requirement, parse_requirement, runtime_requirements, satisfies
from util import REPO

pytestmark = pytest.mark.unit


def fake_metadata(requires_python=">=3.11", requires=()):
    msg = email.message.Message()
    if requires_python is not None:
        msg["Requires-Python"] = requires_python
    for line in requires:
        msg["Requires-Dist"] = line
    return lambda name: msg if name == "hpct" else (_ for _ in ()).throw(
        importlib.metadata.PackageNotFoundError(name))


def versions(**installed):
    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]
    return version


def not_installed(name):
    raise importlib.metadata.PackageNotFoundError(name)


# ---------------------------------------------------------------- parsing and ranges

def test_parse_requirement_forms():
    assert parse_requirement('torch<2.14,>=2.6; extra == "torch"') == Requirement("torch", "<2.14,>=2.6", "torch")
    assert parse_requirement("numpy>=1.24") == Requirement("numpy", ">=1.24", None)
    assert parse_requirement("Typing_Extensions") == Requirement("typing-extensions", "", None)
    assert parse_requirement("pkg[extra1] (>=1.0, <2)") == Requirement("pkg", ">=1.0,<2", None)
    with pytest.raises(ValueError, match="unreadable requirement"):
        parse_requirement("; extra == 'x'")


def test_runtime_requirements_drop_test_and_benchmark_extras():
    reqs = runtime_requirements(['torch<2.14,>=2.6; extra == "torch"', 'pytest>=7; extra == "test"',
                                 'matplotlib>=3.7; extra == "bench"', "numpy"])
    assert [r.name for r in reqs] == ["torch", "numpy"]


@pytest.mark.parametrize("version,spec,ok", [
    ("2.13.0+cpu", ">=2.6,<2.14", True),
    ("2.6.0+hpct.4709382791ce502e", ">=2.6,<2.14", True),
    ("2.5.1+cu124", ">=2.6,<2.14", False),
    ("2.14.0", ">=2.6,<2.14", False),
    ("2.14.0a0", "<2.14", False),
    ("3.11.7", ">=3.11", True),
    ("3.10.14", ">=3.11", False),
    ("1.26.4", "==1.*", True),
    ("2.0.0", "==1.*", False),
    ("2.0.0", "!=1.*", True),
    ("1.4.2", "~=1.4", True),
    ("2.0", "~=1.4", False),
    ("1.0", "", True),
    ("1.0", "==1.0.0", True),
    ("1.0.1", "!=1.0.1", False),
    ("1.0", ">1.0", False),
    ("1.0", "<=1.0", True),
])
def test_satisfies(version, spec, ok):
    assert satisfies(version, spec) is ok


def test_satisfies_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="unreadable version clause"):
        satisfies("1.0", "^1.0")
    with pytest.raises(ValueError, match="unreadable version 'abc'"):
        satisfies("abc", ">=1")


# ---------------------------------------------------------------- one source: pyproject.toml

def test_pyproject_declares_torch_as_a_bounded_extra_and_no_numpy():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert all(not d.lower().startswith(("torch", "numpy")) for d in project["dependencies"])
    (torch,) = [parse_requirement(d) for d in project["optional-dependencies"]["torch"]]
    assert torch.name == "torch" and "<" in torch.spec and ">=" in torch.spec, torch
    # the range admits both pins the project names, and nothing is a bare unpinned torch
    assert satisfies(requirements.TORCH_CPU_PIN, torch.spec)
    assert satisfies(requirements.TORCH_PATCHED_PIN, torch.spec)
    # ... and the newest torch CI tests (ci/torch_tier.sh), and not the release after it
    assert satisfies(requirements.TORCH_NEWEST, torch.spec)
    major, minor = requirements.TORCH_NEWEST.split(".")[:2]
    assert not satisfies(f"{major}.{int(minor) + 1}.0", torch.spec)


def test_the_installed_metadata_is_pyprojects():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    meta = importlib.metadata.metadata("hpct")
    assert meta["Requires-Python"] == project["requires-python"]
    installed = {r.name: r for r in runtime_requirements(meta.get_all("Requires-Dist") or [])}
    declared = [parse_requirement(d) for d in project["dependencies"] + project["optional-dependencies"]["torch"]]
    assert {r.name for r in declared} == set(installed)
    assert meta["Version"] == __import__("hpct").__version__


def test_ci_setup_installs_the_cpu_pin():
    setup = (REPO / "ci" / "setup.sh").read_text()
    assert re.search(r"^TORCH_VERSION=(\S+)", setup, re.M).group(1) == requirements.TORCH_CPU_PIN


NUMPY_USE = re.compile(r"^\s*(import|from)\s+numpy\b|\.numpy\(\)|from_numpy\(", re.M)


def test_no_numpy_in_the_package():
    import hpct
    from pathlib import Path
    users = [str(p) for p in Path(hpct.__file__).parent.rglob("*.py")
             if p.parent.name != "build" and NUMPY_USE.search(p.read_text())]
    assert users == [], "numpy is not a dependency of hpct: " + ", ".join(users)


# ---------------------------------------------------------------- doctor rows

def test_python_row_uses_requires_python(monkeypatch):
    ok = doctor.check_python(Probe(metadata=fake_metadata(">=3.8")))
    assert ok.status == "ok" and ok.detail.endswith(", requires >=3.8")
    bad = doctor.check_python(Probe(metadata=fake_metadata(">=99.1")))
    assert (bad.status, bad.fix) == ("fail", "use Python 99.1 or newer")
    assert "does not satisfy hpct's requires-python >=99.1" in bad.detail
    odd = doctor.check_python(Probe(metadata=fake_metadata(">=3,<3.1")))
    assert (odd.status, odd.fix) == ("fail", "use a Python that satisfies >=3,<3.1")
    unknown = doctor.check_python(Probe(metadata=not_installed))
    assert unknown.status == "ok" and unknown.detail.endswith("hpct's requires-python unknown (hpct is not installed)")


def test_dependencies_row_every_state():
    torch_only = ['torch<2.14,>=2.6; extra == "torch"', 'pytest>=7; extra == "test"']
    row = doctor.check_dependencies(Probe(metadata=fake_metadata(requires=torch_only), dist_version=not_installed))
    assert (row.status, row.detail) == ("ok", "none besides torch (declared: torch<2.14,>=2.6)")

    reqs = torch_only + ["numpy>=1.24", "filelock"]
    good = doctor.check_dependencies(Probe(metadata=fake_metadata(requires=reqs),
                                           dist_version=versions(numpy="2.4.6", filelock="3.13.1")))
    assert (good.status, good.detail) == ("ok", "numpy 2.4.6 (>=1.24), filelock 3.13.1 (any)")

    bad = doctor.check_dependencies(Probe(metadata=fake_metadata(requires=reqs),
                                          dist_version=versions(numpy="1.21.0")))
    assert bad.status == "fail"
    assert bad.detail == "numpy>=1.24: 1.21.0 is outside >=1.24; filelock: not installed"
    assert bad.fix == f"{sys.executable} -m pip install 'numpy>=1.24'; {sys.executable} -m pip install 'filelock'"

    source = doctor.check_dependencies(Probe(metadata=not_installed))
    assert source.status == "info" and "metadata not found" in source.detail


def test_torch_row_range_from_metadata():
    import types
    torch = types.SimpleNamespace(__version__="2.7.0", version=types.SimpleNamespace(cuda=None))
    meta = fake_metadata(requires=['torch<2.7,>=2.6; extra == "torch"'])
    row, _ = doctor.check_torch(Probe(metadata=meta, import_module=lambda name: torch))
    assert (row.status, row.detail) == ("fail", "2.7.0 is outside hpct's supported range torch<2.7,>=2.6")
    assert row.fix == requirements.torch_fix()          # a CPU torch: the CPU pin, or the GPU ways
    assert "install torch==2.13.0" in row.fix and "patched PyTorch 2.6.0: hpct-build wheel torch=2.6.0" in row.fix
    row, _ = doctor.check_torch(Probe(metadata=not_installed, import_module=lambda name: torch))
    assert (row.status, row.detail) == ("ok", "2.7.0 (CPU-only)")
