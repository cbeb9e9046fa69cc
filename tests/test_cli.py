"""Both console scripts: --version, help without a verb, a closed pipe, the installed scripts.

The scripts are run as the files pip installed (found through the wheel's RECORD),
so these tests fail when the console scripts are missing or broken, not only when
``hpct.cli:main`` is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import hpct
from hpct.cliutil import SIGPIPE_EXIT, console_script
from util import REPO

pytestmark = pytest.mark.unit

PROGS = ("hpct", "hpct-build")


def script(prog: str) -> str:
    path = console_script(prog)
    assert path, f"the installed hpct has no {prog} console script"
    return path


def run(prog: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([script(prog), *args], capture_output=True, text=True, timeout=120, cwd="/", **kw)


@pytest.mark.parametrize("prog", PROGS)
def test_console_script_is_installed_beside_the_interpreter(prog):
    path = Path(script(prog))
    assert os.access(path, os.X_OK)
    # pip writes the interpreter that installed it into the shebang: the same one runs the tests
    shebang = path.read_text().splitlines()[0]
    assert shebang.startswith("#!") and Path(shebang[2:].split()[0]).resolve() == Path(sys.executable).resolve()


@pytest.mark.parametrize("prog", PROGS)
def test_version(prog):
    proc = run(prog, "--version")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"{prog} {hpct.__version__}\n", "")


@pytest.mark.parametrize("prog,verbs", [("hpct", ("doctor", "ports", "demo", "diagnose")),
                                        ("hpct-build", ("fetch", "patch", "build", "wheel", "all", "status"))])
def test_no_verb_prints_the_help(prog, verbs):
    proc = run(prog)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.startswith(f"usage: {prog} ")
    for verb in verbs:
        assert f"\n    {verb} " in proc.stdout, (verb, proc.stdout)
    assert "--version" in proc.stdout
    # only the verb being run is imported: the help needs none of them
    assert run(prog, "-v").stdout == proc.stdout


def test_unknown_verb_is_still_a_usage_error():
    proc = run("hpct", "doctr")
    assert proc.returncode == 2
    assert "invalid choice: 'doctr'" in proc.stderr


def closed_pipe_run(argv: list[str], unbuffered: bool) -> subprocess.CompletedProcess:
    """Run argv with stdout a pipe whose reader is already gone (what `| head` leaves behind)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(argv, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
                              cwd="/", env=env)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("prog,args", [
    ("hpct", ["ports", "plan", "--json"]),
    ("hpct", ["ports", "plan"]),
    ("hpct-build", ["status", "--json", "--root", str(REPO)]),
    ("hpct", ["--help"]),
    ("hpct", []),
    ("hpct-build", ["--version"]),
])
def test_closed_pipe_ends_quietly(prog, args):
    proc = closed_pipe_run([script(prog), *args], unbuffered=False)
    assert (proc.returncode, proc.stderr) == (SIGPIPE_EXIT, "")


@pytest.mark.parametrize("prog,args", [("hpct", ["ports", "plan", "--json"]), ("hpct", ["--help"]),
                                       ("hpct-build", ["--version"])])
def test_closed_pipe_ends_quietly_unbuffered(prog, args):
    # argparse ignores a failed write of the help or the version; hpct's own output does not
    proc = closed_pipe_run([script(prog), *args], unbuffered=True)
    assert (proc.returncode, proc.stderr) == (0 if "ports" not in args else SIGPIPE_EXIT, "")


def test_closed_pipe_with_head_keeps_the_first_lines():
    # through a real shell pipeline; more output than a pipe buffer holds, so the
    # writer must meet the closed pipe (N_PROC_PER_NODE large: a long plan)
    proc = subprocess.run(["bash", "-c", f"set -o pipefail; N_PROC_PER_NODE=1024 HPCT_PORT_SLOTS=2 "
                                         f"'{script('hpct')}' ports plan --json | head -n 3"],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.stdout.splitlines()[:2] == ["{", '  "schema_version": 1,'], proc.stdout
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, SIGPIPE_EXIT)


def test_console_script_lookup_without_hpct_installed(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "distribution", missing)
    assert console_script("hpct") is None


def test_old_module_name_still_runs_the_build_cli_and_says_it_is_deprecated():
    # The pipeline moved from hpct.build to hpct.builder; scripts that call the old
    # module keep working for one release and are told the new name.
    old = subprocess.run([sys.executable, "-m", "hpct.build", "--version"], capture_output=True,
                         text=True, timeout=120, cwd="/")
    new = subprocess.run([sys.executable, "-m", "hpct.builder", "--version"], capture_output=True,
                         text=True, timeout=120, cwd="/")
    assert old.returncode == new.returncode == 0, old.stderr
    assert old.stdout == new.stdout and "hpct-build" in new.stdout
    assert "deprecated" in old.stderr and "python -m hpct.builder" in old.stderr
    assert "deprecated" not in new.stderr
