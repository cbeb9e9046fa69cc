"""The suite's own layout: every test belongs to a tier (a registered marker), the tiers ci/test.sh
runs are the registered markers, and the run's summary (ci/summary.py) says what it read."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "ci"))
import summary  # noqa: E402  (ci/ is a folder of scripts)


def registered_markers() -> set[str]:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return {m.split(":", 1)[0].strip() for m in cfg["markers"]}


def marks_in(tree: ast.AST) -> set[str]:
    """Every ``pytest.mark.<name>`` a module's source names (module, class or test)."""
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark" and isinstance(node.value.value, ast.Name) and node.value.value.id == "pytest"}


def test_every_test_module_names_a_tier_marker():
    tiers = registered_markers() - {"gpu"}
    missing = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        if not marks_in(ast.parse(path.read_text())) & tiers:
            missing.append(path.name)
    assert missing == [], f"test modules with no tier marker ({', '.join(sorted(tiers))}): {missing}"


def test_every_collected_test_has_a_tier_marker():
    """The source check above cannot see a test whose only mark comes from elsewhere; the
    collection can: a test with none of the tier markers would run in no tier."""
    tiers = sorted(registered_markers())
    expr = "not (" + " or ".join(tiers) + ")"
    proc = subprocess.run([sys.executable, "-P", "-m", "pytest", "--collect-only", "-q", "-m", expr,
                           "-p", "no:cacheprovider", str(REPO / "tests")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    unmarked = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    assert unmarked == [], f"tests with no tier marker: {unmarked[:20]}"
    assert proc.returncode == 5, proc.stdout[-2000:] + proc.stderr[-2000:]     # 5: nothing collected


def ci_tiers() -> list[str]:
    """ci/test.sh's TIER_MARKERS, in order."""
    m = re.search(r"^\s*TIER_MARKERS=\(([^)]*)\)", (REPO / "ci" / "test.sh").read_text(), re.MULTILINE)
    assert m, "ci/test.sh has no TIER_MARKERS=(...) list"
    return m.group(1).split()


def test_the_tiers_ci_test_sh_names_are_the_registered_markers():
    named = set(ci_tiers())
    assert named == registered_markers() - {"gpu"}, (named, registered_markers())


def test_only_tiers_of_waiting_tests_run_several_at_a_time():
    """TIER_WORKERS (pytest-xdist workers per tier) names tiers of the list, never serial: the
    tests that time themselves or fill both cores must not share the machine."""
    text = (REPO / "ci" / "test.sh").read_text()
    m = re.search(r"^\s*declare -A TIER_WORKERS=\(([^)]*)\)", text, re.MULTILINE)
    assert m, "ci/test.sh has no declare -A TIER_WORKERS=(...)"
    workers = dict(re.findall(r"\[(\w+)\]=(\d+)", m.group(1)))
    tiers = ci_tiers()
    assert workers and set(workers) <= set(tiers) - {"serial", "unit"}, (workers, tiers)
    assert all(2 <= int(n) <= 4 for n in workers.values()), workers
    assert tiers.index("serial") < min(tiers.index(t) for t in workers), \
        "serial must come before the shared tiers: a test marked serial and multiprocess runs in the first"
    m = re.search(r"^\s*LONG_FIRST=\(([^)]*)\)", text, re.MULTILINE)
    assert m, "ci/test.sh has no LONG_FIRST=(...)"
    for path in m.group(1).split():     # started first in their tier: they must exist
        assert (REPO / path).is_file(), f"ci/test.sh's LONG_FIRST names {path}, which is gone"


def test_the_summary_reads_tiers_junit_reports_and_cache_logs(tmp_path, capsys):
    (tmp_path / "ci-tiers.tsv").write_text("setup\t7\nbuild\t140\npytest\t2400\n")
    (tmp_path / "junit-suite.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        + "".join(f'<testcase classname="tests.test_x" name="test_{i}" time="{i}.5"/>' for i in range(12))
        + "</testsuite></testsuites>")
    (tmp_path / "nccl-prebuild.log").write_text(
        "[  2.0s] nccl 2.30.7: taken from the build cache (/c/nccl-2.30.7-abc; HPCT_BUILD_CACHE=0 builds it anyway)\n"
        "[ 80.0s] nccl 2.21.5: stored in the build cache (/c/nccl-2.21.5-def)\n")
    (tmp_path / "torch-tier-prepare.log").write_text("ci/torch_tier.sh: cache hit: /c/venv\n")
    (tmp_path / "ccache-before.tsv").write_text("cache_miss\t40\ndirect_cache_hit\t10\nstats_updated_timestamp\t1\n")
    (tmp_path / "ccache-after.tsv").write_text("cache_miss\t43\ndirect_cache_hit\t90\npreprocessed_cache_hit\t7\n")
    assert summary.main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "all tiers                        2547" in out
    slow = [ln for ln in out.splitlines() if "tests/test_x.py::test_" in ln]
    assert len(slow) == 10 and slow[0].split() == ["11.5", "suite:", "tests/test_x.py::test_11"]
    assert "NCCL 2.30.7 build          hit" in out and "NCCL 2.21.5 build          miss (built, then stored)" in out
    assert "torch tier environment     hit" in out
    assert "compiler cache (ccache)    87 of 90 compiles hit" in out
    assert summary.main(["summary", str(tmp_path / "empty")]) == 0
    assert "(no JUnit report in build/)" in capsys.readouterr().out


def test_no_module_name_is_both_a_test_helper_and_a_benchmark_or_ci_script():
    """Tests put benchmarks/ and ci/ on sys.path beside tests/: a shared name imports whichever folder
    came first, so a helper is silently replaced by a benchmark (CI's slow tier once lost
    tests/torch26.py's ``ensure`` this way)."""
    def names(folder: str) -> set[str]:
        return {p.stem for p in (REPO / folder).glob("*.py")}
    for other in ("benchmarks", "ci"):
        assert not names("tests") & names(other), f"rename the tests/ helper: {sorted(names('tests') & names(other))}"
    assert not names("benchmarks") & names("ci"), sorted(names("benchmarks") & names("ci"))


def _sources() -> list[Path]:
    return sorted([*(REPO / "tests").glob("*.py"), *(REPO / "benchmarks").glob("*.py")])


def test_no_test_module_imports_another_and_nothing_puts_tests_on_sys_path():
    """Tests and benchmarks share the harness by name (hpct.testing, installed with hpct) and the
    tests' other helpers through non-test modules (util.py, launch_jobs.py, ...): no module of
    tests/ or benchmarks/ imports a test module, and none puts tests/ itself on sys.path (issue 62).
    tests/gpu (the GPU pack's scripts) and ci/ (scripts) may be put there: they are no test files."""
    tests = {p.stem for p in (REPO / "tests").glob("test_*.py")}
    imports, path_edits = [], []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                names = []
            if any(n.split(".")[0] in tests for n in names):
                imports.append(f"{path.relative_to(REPO)}:{node.lineno}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.path.insert", "sys.path.append") \
                    and re.search(r"'tests'\)*$", ast.unparse(node)):
                path_edits.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert imports == [], f"test modules imported by other modules (move the shared part to a helper): {imports}"
    assert path_edits == [], f"tests/ put on sys.path (import the harness from hpct.testing): {path_edits}"


def test_the_old_harness_homes_are_gone():
    """The harness moved to hpct/testing/: a copy left in tests/ would shadow it (tests/ is on the
    suite's pythonpath) and drift."""
    old = [*(REPO / "tests" / n for n in ("netns.py", "lossy.py", "launch_cluster.py")),
           *(REPO / "tests" / "nccl_sim").glob("*.py")]      # a checkout may keep its __pycache__
    assert [str(p.relative_to(REPO)) for p in old if p.exists()] == []
