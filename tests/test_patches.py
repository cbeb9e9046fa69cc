"""Patch series: form (DEP-3, why-comments), and that every series applies to its pin."""

from __future__ import annotations

from pathlib import Path

import pytest

from util import run_cli

pytestmark = pytest.mark.unit


def _series_dirs(repo: Path) -> list[Path]:
    return sorted(p.parent for p in (repo / "patches").glob("*/*/series"))


def test_every_series_line_names_an_existing_patch_with_a_why(repo):
    dirs = _series_dirs(repo)
    assert dirs, "no patch series found"
    for d in dirs:
        listed = []
        for n, raw in enumerate((d / "series").read_text().splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, why = line.partition("#")
            assert sep and why.strip(), f"{d}/series:{n} has no why-comment"
            assert (d / name.strip()).is_file(), f"{d}/series:{n} names a missing patch"
            listed.append(name.strip())
        on_disk = sorted(p.name for p in d.glob("*.patch"))
        assert sorted(listed) == on_disk, f"{d}: patches on disk but not in series (or twice)"


def test_every_patch_is_format_patch_with_dep3_fields(repo):
    from hpct.builder.patches import lint_patch
    patches = [p for d in _series_dirs(repo) for p in sorted(d.glob("*.patch"))]
    assert patches
    for p in patches:
        assert lint_patch(p) == [], p.name


def test_lint_names_each_missing_field(tmp_path):
    from hpct.builder.patches import lint_patch
    bad = tmp_path / "0001-x.patch"
    bad.write_text("From 0 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] x\n\nDescription: x\n"
                   "Last-Update: 22/11/2026\n---\ndiff --git a/x b/x\n")
    assert lint_patch(bad) == ["missing DEP-3 field Origin:", "missing DEP-3 field Forwarded:",
                               "Last-Update '22/11/2026' is not YYYY-MM-DD"]


@pytest.mark.parametrize("component", ["gloo", "pytorch"])
def test_series_applies_to_the_pinned_tree(repo, component):
    proc = run_cli("hpct-build", "patch", "--check", component, "--root", str(repo), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "patches apply" in proc.stdout


def test_patch_is_idempotent_and_records_the_series(seeded_root):
    first = run_cli("hpct-build", "patch", "gloo", "--root", str(seeded_root))
    assert first.returncode == 0, first.stderr
    stamp = (seeded_root / "third_party/patched/gloo-5354032/.hpct-patched.json").read_text()
    assert "0001-test-accept-any-OpenSSL-for-the-test-build.patch" in stamp
    patched = (seeded_root / "third_party/patched/gloo-5354032/gloo/test/CMakeLists.txt").read_text()
    assert patched.startswith("find_package(OpenSSL REQUIRED)")
    pristine = (seeded_root / "third_party/src/gloo-5354032/gloo/test/CMakeLists.txt").read_text()
    assert pristine.startswith("find_package(OpenSSL 1.1 REQUIRED EXACT)")
    second = run_cli("hpct-build", "patch", "gloo", "--root", str(seeded_root))
    assert second.returncode == 0 and "already applied" in second.stderr


def test_series_naming_a_missing_patch(seeded_root):
    series = seeded_root / "patches/gloo/5354032/series"
    series.write_text(series.read_text() + "0099-missing.patch  # to prove the error\n")
    proc = run_cli("hpct-build", "patch", "--check", "gloo", "--root", str(seeded_root))
    assert proc.returncode == 5
    assert "series names 0099-missing.patch, which does not exist" in proc.stderr


def test_series_line_without_why(seeded_root):
    series = seeded_root / "patches/gloo/5354032/series"
    first = next(p.name for p in sorted(series.parent.glob("*.patch")))
    series.write_text(f"{first}\n")
    proc = run_cli("hpct-build", "patch", "--check", "gloo", "--root", str(seeded_root))
    assert proc.returncode == 5
    assert f"{first} has no '# why' comment" in proc.stderr


def test_hunk_that_no_longer_applies_names_patch_file_and_hunk(seeded_root):
    d = seeded_root / "patches/gloo/5354032"
    (d / "0098-stale.patch").write_text("""From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: hpct test <t@localhost>
Subject: [PATCH] stale context

Description: a hunk whose context is not in the tree
Origin: vendor, hpct
Forwarded: not-needed
Last-Update: 2026-11-22
---
diff --git a/gloo/context.cc b/gloo/context.cc
--- a/gloo/context.cc
+++ b/gloo/context.cc
@@ -1,3 +1,3 @@
-this line is not in gloo/context.cc
+replacement
 neither is this
 nor this
""")
    (d / "series").write_text((d / "series").read_text() + "0098-stale.patch  # must fail\n")
    proc = run_cli("hpct-build", "patch", "gloo", "--root", str(seeded_root))
    assert proc.returncode == 5, proc.stderr
    assert "0098-stale.patch does not apply: gloo/context.cc: hunk #1 (at line 1)" in proc.stderr
    # Nothing half-patched is left behind.
    assert not (seeded_root / "third_party/patched/gloo-5354032").exists()


def test_two_patch_runs_at_once_serialize_and_the_second_reuses_the_tree(seeded_root):
    # Two CI jobs (or two xdist workers) on one checkout: without the component's lock the
    # second one's atomic_dir removed the first one's scratch folder, or failed its rename.
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "hpct.builder", "patch", "gloo", "--root", str(seeded_root)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    errs = [err for _, err in outs]
    assert sum("patches applied" in e for e in errs) == 1, errs
    assert sum("already applied" in e for e in errs) == 1, errs
    assert not list((seeded_root / "third_party/patched").glob(".tmp-*"))
    assert (seeded_root / "third_party/patched/gloo-5354032/.hpct-patched.json").is_file()
