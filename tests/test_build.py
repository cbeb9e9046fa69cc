"""hpct-build build/status/CLI: toolchain checks, logs named in errors, --json, --help."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from util import run_cli

pytestmark = pytest.mark.unit


def test_help_is_fast_and_lists_every_verb():
    started = time.monotonic()
    proc = run_cli("hpct-build", "--help")
    elapsed = time.monotonic() - started
    assert proc.returncode == 0
    for verb in ("fetch", "patch", "build", "wheel", "all", "status"):
        assert verb in proc.stdout
    assert elapsed < 5, elapsed


def test_help_does_not_import_the_verbs():
    code = ("import sys; from hpct.builder.cli import main\n"
            "try: main(['--help'])\nexcept SystemExit: pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('hpct.builder.main_')))")
    import subprocess
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_missing_toolchain_names_each_tool_and_the_package(seeded_root, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("patch",):  # deliberately no cmake, ninja or c++
        os.symlink(shutil.which(tool), bindir / tool)
    proc = run_cli("hpct-build", "build", "gloo", "--root", str(seeded_root), env={"PATH": str(bindir)})
    assert proc.returncode == 6, proc.stderr
    assert "missing build tool(s): cmake, ninja, c++" in proc.stderr
    assert "apt-get install -y cmake g++ ninja-build" in proc.stderr


def test_failed_build_names_its_log_and_shows_its_tail(seeded_root):
    recipe = seeded_root / "build_scripts" / "gloo.cmake"
    recipe.write_text(recipe.read_text() + '\nmessage(FATAL_ERROR "hpct-test-boom")\n')
    proc = run_cli("hpct-build", "build", "gloo", "--root", str(seeded_root), timeout=300)
    assert proc.returncode == 7, proc.stderr
    log = seeded_root / "third_party/build/gloo-5354032/build.log"
    assert "cmake configure failed" in proc.stderr
    assert f"see the whole log: {log}" in proc.stderr
    assert "hpct-test-boom" in proc.stderr and "hpct-test-boom" in log.read_text()
    assert not (seeded_root / "third_party/build/gloo-5354032/install").exists()


def test_status_json_reports_the_real_checkout(repo):
    proc = run_cli("hpct-build", "status", "--json", "--root", str(repo))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema_version"] == 1
    rows = {r["name"]: r for r in doc["components"]}
    assert set(rows) == {"gloo", "nccl", "pytorch"}
    gloo = rows["gloo"]
    # The test command builds and installs before running the suite.
    assert gloo["fetched"] and gloo["patched"] and gloo["built"], gloo
    assert doc["wheel"]["installed"] and doc["wheel"]["extension"]
    assert doc["wheel"]["series_id"] == gloo["series_id"]


def test_verbose_shows_a_traceback_and_plain_does_not(scratch_root):
    plain = run_cli("hpct-build", "fetch", "nope", "--root", str(scratch_root))
    loud = run_cli("hpct-build", "-v", "fetch", "nope", "--root", str(scratch_root))
    assert plain.returncode == loud.returncode == 2
    assert "Traceback" not in plain.stderr
    assert "Traceback" in loud.stderr


def test_outside_a_checkout_says_so(tmp_path):
    proc = run_cli("hpct-build", "status", "--root", str(tmp_path))
    assert proc.returncode == 3
    assert "is not inside an hpct checkout" in proc.stderr


def test_status_from_the_checkout_still_sees_the_installed_extension(repo):
    # `python3 -m hpct.builder` in the checkout imports hpct from the source tree, which has
    # no compiled extension: status must ask the installed package, not itself.
    import subprocess
    proc = subprocess.run([sys.executable, "-m", "hpct.builder", "status", "--json"], cwd=repo,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    wheel = json.loads(proc.stdout)["wheel"]
    assert wheel["installed"] and wheel["extension"], wheel
