"""The README's two commands, run the way the README states them.

``bash ci/main.sh`` and ``bash ci/test.sh`` from a fresh clone of the committed HEAD, in
a clean environment (``env -i``) whose PATH is what a login shell has: /etc/profile's
directories first, then pyenv's where pyenv is installed.  On this kind of machine that
PATH finds Debian's own python3 (which refuses pip installs) before pyenv's, and a new
console script has no pyenv shim until a rehash: exactly what broke the main job while
the in-process tests stayed green.

The slow tests reinstall hpct, from the clone, into the interpreter the scripts pick.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hpct.cliutil import console_script
from util import REPO

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = pytest.mark.serial

PROFILE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"   # Debian's /etc/profile, root


def pyenv_root() -> Path | None:
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    return root if (root / "bin" / "pyenv").exists() else None


def login_env() -> dict:
    path = PROFILE_PATH
    if pyenv_root():
        path += f":{pyenv_root()}/shims:{pyenv_root()}/bin"
    return {"HOME": str(Path.home()), "PATH": path}


def in_clean_env(cmd: str, cwd: Path, timeout: float, extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**login_env(), **(extra or {})}
    argv = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), "bash", "-c", cmd]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def python_sh(body: str, extra: dict | None = None) -> subprocess.CompletedProcess:
    return in_clean_env(f"set -euo pipefail; . ci/python.sh; {body}", REPO, 120, extra)


# ---------------------------------------------------------------- the interpreter the ci scripts pick

@pytest.mark.unit
def test_ci_picks_a_python_pip_may_install_into():
    proc = python_sh("hpct_pick_python; echo \"$PYTHON\"")
    if proc.returncode != 0:
        # no usable Python on the login PATH: the message must say what to do
        assert "fix:" in proc.stderr and ("managed by the OS" in proc.stderr or "no python3" in proc.stderr)
        pytest.skip(f"no Python the ci scripts may use on this login PATH: {proc.stderr.strip()}")
    chosen = proc.stdout.strip()
    check = subprocess.run([chosen, "-c", "import sys, sysconfig, os; print(sys.prefix != sys.base_prefix or "
                            "not os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')))"],
                           capture_output=True, text=True, timeout=60)
    assert check.stdout.strip() == "True", (chosen, check)
    system = shutil.which("python3", path=login_env()["PATH"])
    if pyenv_root() and system and system.startswith("/usr/bin"):
        # Debian's python3 comes first on this PATH: pyenv's must win
        assert chosen.startswith(str(pyenv_root())), chosen


@pytest.mark.unit
def test_ci_skips_an_os_managed_python_listed_before_the_shims():
    # A clean shell with pyenv's shims after /usr/bin and pyenv itself off PATH (the check
    # every developer runs before stopping): the shim's python3 is the one pip may use.
    root = pyenv_root()
    if root is None or not Path("/usr/bin/python3").exists():
        pytest.skip("needs pyenv and a /usr/bin/python3")
    proc = in_clean_env(". ci/python.sh; hpct_pick_python; echo \"$PYTHON\"", REPO, 120,
                        {"PATH": f"/usr/local/bin:/usr/bin:/bin:{root}/shims"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{root}/shims/python3"


@pytest.mark.unit
def test_ci_honours_python_and_refuses_an_os_managed_one(tmp_path):
    import sys
    proc = python_sh("hpct_pick_python; echo \"$PYTHON\"", {"PYTHON": sys.executable})
    assert (proc.returncode, proc.stdout.strip()) == (0, sys.executable), proc.stderr
    proc = python_sh("hpct_pick_python", {"PYTHON": str(tmp_path / "nope")})
    assert proc.returncode != 0 and f"PYTHON={tmp_path / 'nope'} is not an executable" in proc.stderr
    managed = Path("/usr/lib/python3.11/EXTERNALLY-MANAGED")
    if not (managed.exists() and Path("/usr/bin/python3").exists()):
        pytest.skip("no OS-managed /usr/bin/python3 on this machine")
    proc = python_sh("hpct_pick_python", {"PYTHON": "/usr/bin/python3"})
    assert proc.returncode == 1
    assert "/usr/bin/python3 is managed by the OS" in proc.stderr
    assert "fix: unset PYTHON (the ci scripts then make and use the checkout's .venv), or python3 -m venv " \
           "~/hpct-venv && PYTHON=~/hpct-venv/bin/python bash" in proc.stderr


BARE_PATH = "/usr/local/bin:/usr/bin:/bin"      # a fresh Debian 12 box's: no pyenv, no venv


def debian_python3() -> bool:
    """Whether /usr/bin/python3 is the OS's, refusing pip installs (PEP 668), and no other python3 is
    on BARE_PATH: the fresh Debian 12 box of the README."""
    return (Path("/usr/bin/python3").exists() and shutil.which("python3", path=BARE_PATH) == "/usr/bin/python3"
            and subprocess.run(["/usr/bin/python3", "-c", "import sys, sysconfig, os; sys.exit(not os.path.exists("
                                "os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')))"],
                               timeout=60).returncode == 0)


def shallow_clone(dest: Path) -> Path:
    """A clone of the committed HEAD (python.sh as committed, no .venv, nothing built)."""
    subprocess.run(["git", "clone", "--quiet", "--depth", "1", f"file://{REPO}", str(dest)], check=True, timeout=120)
    return dest


def pick_bare(clone: Path, home: Path, extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {"HOME": str(home), "PATH": BARE_PATH, **(extra or {})}
    argv = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), "bash", "-c",
            "set -euo pipefail; . ci/python.sh; hpct_pick_python; echo \"$PYTHON\""]
    return subprocess.run(argv, cwd=clone, capture_output=True, text=True, timeout=300)


@pytest.mark.unit
def test_a_fresh_clone_on_a_bare_debian_shell_makes_its_own_venv_and_reuses_it(tmp_path):
    """README's two commands on a fresh Debian 12 box, whose only python3 is Debian's (PEP 668): from
    a fresh clone, in `env -i HOME=<empty> PATH=/usr/local/bin:/usr/bin:/bin` (no pyenv on PATH or
    under HOME, no venv), the ci scripts' selection makes the checkout's .venv from that python3 and
    the next run reuses it; an active venv still wins.  Installing torch and the build into it is
    ci/setup.sh's (README command 1 was run so by hand: docs/launch.md has its output)."""
    if not debian_python3():
        pytest.skip("needs Debian's own /usr/bin/python3 (PEP 668) as the only python3 on a bare PATH")
    clone, home = shallow_clone(tmp_path / "clone"), tmp_path / "home"
    home.mkdir()
    first = pick_bare(clone, home)
    venv = clone / ".venv"
    assert (first.returncode, first.stdout.strip()) == (0, f"{venv}/bin/python"), first.stderr
    assert "is managed by the OS (PEP 668) and no other python3 is on PATH: making the checkout's virtual " \
           f"environment {venv}" in first.stderr
    facts = subprocess.run([f"{venv}/bin/python", "-c", "import sys, pip; print(sys.prefix != sys.base_prefix, "
                            "sys.base_prefix)"], capture_output=True, text=True, timeout=60)
    assert facts.stdout.split() == ["True", "/usr"], facts       # a venv over Debian's python3, with pip
    made = (venv / "pyvenv.cfg").stat().st_mtime_ns
    again = pick_bare(clone, home)
    assert (again.returncode, again.stdout.strip()) == (0, f"{venv}/bin/python"), again.stderr
    assert f"using the checkout's virtual environment {venv} (made by an earlier run from /usr/bin/python3" \
           in again.stderr and (venv / "pyvenv.cfg").stat().st_mtime_ns == made
    other = shallow_clone(tmp_path / "other")
    active = pick_bare(other, home, {"VIRTUAL_ENV": str(venv)})
    assert (active.returncode, active.stdout.strip()) == (0, f"{venv}/bin/python"), active.stderr
    assert not (other / ".venv").exists(), "an active venv is used, not a new one made"


@pytest.mark.unit
def test_a_python3_that_cannot_make_a_venv_is_refused_with_the_fix(tmp_path):
    """A python3 managed by the OS whose venv module fails (Debian's without python3-venv says
    ensurepip is not available; stood in for by a wrapper here, as the machine has the package)."""
    if not debian_python3():
        pytest.skip("needs Debian's own /usr/bin/python3 (PEP 668)")
    clone, home, bin_dir = shallow_clone(tmp_path / "clone"), tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/sh\nif [ "$1 $2" = "-m venv" ]; then\n  echo "The virtual environment '
                                     'was not created successfully because ensurepip is not available." >&2\n'
                                     '  exit 1\nfi\nexec /usr/bin/python3 "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    proc = pick_bare(clone, home, {"PATH": f"{bin_dir}:{BARE_PATH}"})
    assert proc.returncode == 1 and proc.stdout == "", proc
    assert f"ci: {bin_dir}/python3 -m venv {clone}/.venv failed: The virtual environment was not created " \
           "successfully because ensurepip is not available." in proc.stderr, proc.stderr
    assert "fix: install your OS's venv package for" in proc.stderr and not (clone / ".venv").exists()


@pytest.mark.unit
def test_ci_finds_the_installed_console_script_off_path():
    import sys
    installed = console_script("hpct")
    assert installed, "hpct's console script is not installed"
    # PATH without the interpreter's scripts folder (and no pyenv): the real file, and a note
    proc = in_clean_env("set -euo pipefail; . ci/python.sh; hpct_console_script hpct", REPO, 120,
                        {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == installed
    assert f"'hpct' is not on PATH; it is {installed} (add {os.path.dirname(installed)} to PATH)" in proc.stderr
    assert subprocess.run([installed, "--version"], capture_output=True, text=True, timeout=60).returncode == 0


# ---------------------------------------------------------------- the README's commands, end to end

@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory) -> Path:
    """A clone of the committed HEAD: no build outputs, no caches, nothing uncommitted."""
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip(f"{REPO} is not a git checkout")
    dest = tmp_path_factory.mktemp("clone") / "fresh"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(dest)], check=True, timeout=300)
    return dest


@pytest.mark.slow
def test_readme_command_1_main_job(fresh_clone):
    proc = in_clean_env("bash ci/main.sh", fresh_clone, 1800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "command not found" not in out
    assert "measured on this machine" in proc.stdout and "stock/hpct" in proc.stdout, proc.stdout[-4000:]
    # The demo's table, every row (tests/test_demo.py's end-to-end run was folded in here).
    assert "bit-identical after recovery: yes" in proc.stdout
    assert "survivors kept their processes: yes" in proc.stdout
    for row in ("start-up: process start -> first all_reduce", "recovery: SIGKILL -> first all_reduce",
                "failure -> training resumed (stock: full restart of all processes)"):
        assert row in proc.stdout, proc.stdout[-4000:]
    # It trains under hpct run, whose replacement is forked (warm), and says so.
    assert "launcher: `hpct run --nproc-per-node 4`" in proc.stdout
    assert "the replacement forked from the node's fork server" in proc.stdout, proc.stdout[-4000:]


@pytest.mark.slow
def test_readme_command_2_test_suite_entry_point(fresh_clone):
    # the entry point, not the whole suite again: ci/test.sh passes its arguments to pytest
    proc = in_clean_env("bash ci/test.sh -q -p no:cacheprovider tests/test_cli.py", fresh_clone, 1800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-3000:]
