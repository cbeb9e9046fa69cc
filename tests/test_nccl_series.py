"""The NCCL series (2.21.5 and 2.30.7): their form (no upstream line may enter the repository) and its safety net.

Zero-context hunks are placed by line number alone, so what keeps them honest
is elsewhere: the source is verified before patching (sha256 or tree digest)
and every touched file after (``touched.sha256``).  The CI tier checks the
series' form and both checks on synthetic trees; the source tier, which needs
the pinned NCCL tree, checks the real thing.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from hpct.builder.layout import Layout
from hpct.builder.patches import (TOUCHED_SHA256, Series, SeriesEntry, apply_series, extract_new_file,
                                lint_insertion_only, lint_patch, load_series, new_files, touched_files)
from hpct.builder.progress import Progress
from hpct.builder.sources import load_manifest, pinned_versions, sha256_of
from hpct.errors import PatchError
from util import REPO, run_cli

VERSIONS = ("2.21.5", "2.30.7")
PROJECT = REPO / "src" / "nccl_rootless"      # the ring core and header every pin shares


def _need_source(version: str) -> str:
    return (f"needs the pinned NCCL {version} source: HPCT_NCCL_SOURCES=<folder holding nccl-{version}-1.tar.gz> "
            f"(or HPCT_NCCL_SOURCE=<that tarball or tree>), made with `git archive --format=tar "
            f"--prefix=nccl-{version}-1/ v{version}-1 | gzip -n` in a clone of NVIDIA/nccl")


def _series(version: str = "2.21.5") -> Series:
    layout = Layout(REPO)
    return load_series(layout, load_manifest(layout, "nccl", version))


@pytest.mark.unit
def test_the_manifest_pins_both_versions_with_their_cuda_and_wheel():
    layout = Layout(REPO)
    assert pinned_versions(layout, "nccl") == list(VERSIONS)
    assert load_manifest(layout, "nccl").version == "2.21.5"        # the default
    want = {"2.21.5": ("12.4", "nvidia-nccl-cu12", "v2.21.5-1"), "2.30.7": ("13.0", "nvidia-nccl-cu13", "v2.30.7-1")}
    for version, (cuda, wheel, tag) in want.items():
        m = load_manifest(layout, "nccl", version)
        assert (m.extra["cuda"], m.extra["wheel"], m.extra["tag"]) == (cuda, wheel, tag)
        assert m.providers[0].file == f"nccl-{version}-1.tar.gz"
        assert len(m.identity["tree_sha256"]) == 64


@pytest.mark.unit
def test_an_unpinned_version_names_the_pinned_ones():
    with pytest.raises(Exception) as err:
        load_manifest(Layout(REPO), "nccl", "2.28.9")
    assert "nccl version '2.28.9' is not pinned (pinned: 2.21.5, 2.30.7)" in str(err.value)


@pytest.mark.unit
@pytest.mark.parametrize("version", VERSIONS)
def test_both_pins_place_one_shared_ring_core(version):
    """The ring core and the public header are project files, not patch content: one copy for all pins."""
    series = _series(version)
    placed = dict(series.project_files)
    assert placed == {"src/include/hpct_ring.h": PROJECT / "hpct_ring.h",
                      "src/misc/hpct_ring.cc": PROJECT / "hpct_ring.cc",
                      "src/include/nccl_rootless.h": PROJECT / "nccl_rootless.h",
                      "src/include/hpct_exchange.h": PROJECT / "hpct_exchange.h",
                      "src/include/hpct_exchange_wire.h": PROJECT / "hpct_exchange_wire.h",
                      "src/misc/hpct_exchange.cc": PROJECT / "hpct_exchange.cc",
                      "src/misc/hpct_exchange_form.cc": PROJECT / "hpct_exchange_form.cc",
                      "src/include/hpct_bootstrap_log.h": PROJECT / "hpct_bootstrap_log.h",
                      "src/misc/hpct_bootstrap_log.cc": PROJECT / "hpct_bootstrap_log.cc"}
    for path in series.paths:
        assert not set(new_files(path)) & set(placed), path.name
    assert series.identity() != _series(VERSIONS[1 - VERSIONS.index(version)]).identity()


@pytest.mark.unit
def test_a_project_file_never_replaces_an_upstream_file(tmp_path):
    tree = tmp_path / "tree"
    (tree / "src" / "misc").mkdir(parents=True)
    (tree / "src" / "misc" / "hpct_ring.cc").write_text("upstream\n")
    series = Series("nccl", "2.30.7", tmp_path, (), (("src/misc/hpct_ring.cc", PROJECT / "hpct_ring.cc"),))
    with pytest.raises(PatchError) as err:
        apply_series(series, tree, Progress(quiet=True))
    assert "nccl 2.30.7 already has src/misc/hpct_ring.cc: a project file may only add a file" in str(err.value)
    assert (tree / "src" / "misc" / "hpct_ring.cc").read_text() == "upstream\n"


@pytest.mark.unit
def test_a_missing_project_file_is_named(tmp_path):
    series = Series("nccl", "2.30.7", tmp_path, (), (("src/misc/hpct_ring.cc", tmp_path / "gone.cc"),))
    with pytest.raises(PatchError) as err:
        apply_series(series, tmp_path, Progress(quiet=True))
    assert f"the nccl series needs the project file(s) {tmp_path / 'gone.cc'}, which do not exist" in str(err.value)


# ------------------------------------------------------------ form (CI)

@pytest.mark.unit
@pytest.mark.parametrize("version", VERSIONS)
def test_every_patch_is_new_files_plus_zero_context_insertions(version):
    series = _series(version)
    assert len(series.entries) >= 2
    for path in series.paths:
        assert lint_insertion_only(path) == [], path.name
        assert lint_patch(path) == [], path.name
        text = path.read_text()
        assert "Origin: vendor, hpct" in text and "Forwarded: no" in text, path.name
        for header in re.findall(r"^@@ .*$", text, re.MULTILINE):
            assert re.fullmatch(r"@@ -\d+,0 \+\d+(,\d+)? @@", header), (path.name, header)


@pytest.mark.unit
@pytest.mark.parametrize("version", VERSIONS)
def test_every_series_line_says_why(version):
    for entry in _series(version).entries:
        assert len(entry.why) > 30, entry.patch


@pytest.mark.unit
def test_the_manifest_enforces_insertion_only():
    m = load_manifest(Layout(REPO), "nccl")
    assert m.extra["series"]["insertion_only"] is True


@pytest.mark.unit
@pytest.mark.parametrize("version", VERSIONS)
def test_lines_added_to_upstream_files_are_few_and_say_hpct(version):
    """Everything of substance lives in new files; upstream files get small hooks that name hpct."""
    hunks = []
    for path in _series(version).paths:
        created = set(new_files(path))
        text = path.read_text().split("\n-- \n", 1)[0]
        for m in re.finditer(r"^diff --git a/\S+ b/(\S+)$(.*?)(?=^diff --git |\Z)", text, re.MULTILINE | re.DOTALL):
            if m.group(1) in created:
                continue
            for hunk in re.split(r"^@@ .*$", m.group(2), flags=re.MULTILINE)[1:]:
                hunks.append((m.group(1), [ln[1:] for ln in hunk.splitlines() if ln.startswith("+")]))
    # 0001-0004/0005: 18 lines; the log-depth exchange (issue 60) adds its 4 hooks in bootstrap.cc
    # (an include, the branch in bootstrapInit, the dispatch in bootstrapAllGather, the release).
    assert 0 < sum(len(lines) for _, lines in hunks) <= 22, hunks
    for name, lines in hunks:
        assert any("hpct" in ln.lower() or "rootless" in ln for ln in lines), (name, lines)


@pytest.mark.unit
@pytest.mark.parametrize("version", VERSIONS)
def test_touched_sha256_lists_exactly_the_touched_files(version):
    series = _series(version)
    listing = (series.directory / TOUCHED_SHA256).read_text().split("\n")
    names = [ln.split(None, 1)[1] for ln in listing if ln.strip()]
    assert names == touched_files(series)
    assert all(re.fullmatch(r"[0-9a-f]{64}", ln.split()[0]) for ln in listing if ln.strip())


@pytest.mark.unit
@pytest.mark.parametrize("version", VERSIONS)
def test_the_public_header_and_the_ring_core_are_new_files(tmp_path, version):
    layout = Layout(REPO)
    m = load_manifest(layout, "nccl", version)
    header = extract_new_file(layout, m, "src/include/nccl_rootless.h", tmp_path).read_text()
    assert "ncclCommInitRankRootless" in header and "ncclRootlessInfo_t" in header
    core = extract_new_file(layout, m, "src/misc/hpct_ring.cc", tmp_path).read_text()
    assert '#include "hpct_ring.h"' in core and "nccl" not in core.lower().replace("hpct", "")
    # The exchange is POSIX-only like the ring core: NCCL appears only in its comments.
    for rel in ("src/misc/hpct_exchange.cc", "src/misc/hpct_exchange_form.cc", "src/include/hpct_exchange_wire.h"):
        code = extract_new_file(layout, m, rel, tmp_path).read_text()
        assert "#include" in code and not re.search(r'#include\s+"(?!hpct_)', code), rel
    glue = extract_new_file(layout, m, "src/misc/hpct_bootstrap_log.cc", tmp_path).read_text()
    assert "hpctExchangeForm" in glue and "hpctExchangeAllGather" in glue
    with pytest.raises(PatchError) as err:
        extract_new_file(layout, m, "src/init.cc", tmp_path)
    assert f"no patch or project file of nccl {version} adds src/init.cc" in str(err.value)
    rootless = extract_new_file(layout, m, "src/misc/hpct_rootless.cc", tmp_path).read_text()
    assert "ncclCommInitRankRootless" in rootless and "hpctRingForm" in rootless


# ------------------------------------------------------------ the lint and the checks on bad input (CI)

def _patch(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "0001-x.patch"
    p.write_text("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
                 "From: a <a@b>\nSubject: [PATCH] x\n\nDescription: x\nOrigin: vendor, hpct\n"
                 "Forwarded: no\nLast-Update: 2026-11-23\n---\n" + body)
    return p


GOOD = ("diff --git a/f.c b/f.c\nindex 1..2 100644\n--- a/f.c\n+++ b/f.c\n"
        "@@ -1,0 +2 @@\n+int hpct_added;\n")


@pytest.mark.unit
def test_lint_accepts_an_insertion(tmp_path):
    assert lint_insertion_only(_patch(tmp_path, GOOD)) == []


@pytest.mark.unit
@pytest.mark.parametrize("body,expect", [
    ("diff --git a/f.c b/f.c\n--- a/f.c\n+++ b/f.c\n@@ -1,2 +1,3 @@\n int a;\n+int b;\n int c;\n",
     "f.c: hunk @@ -1,2 +1,3 @@ removes or keeps 2 upstream line(s)"),
    ("diff --git a/f.c b/f.c\n--- a/f.c\n+++ b/f.c\n@@ -3,1 +3,0 @@\n-int gone;\n",
     "f.c: line '-int gone;' is context or a removal"),
    ("diff --git a/f.c b/f.c\n--- a/f.c\n+++ b/f.c\n@@ -3,0 +4 @@ static int upstream_function(void)\n+x;\n",
     "carries upstream text after '@@'"),
    ("diff --git a/f.c b/f.c\ndeleted file mode 100644\n--- a/f.c\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n",
     "f.c: deletes, renames or copies a file"),
])
def test_lint_names_each_kind_of_upstream_line(tmp_path, body, expect):
    problems = lint_insertion_only(_patch(tmp_path, body))
    assert any(expect in p for p in problems), problems


@pytest.mark.unit
def test_applying_a_patch_with_context_is_refused_before_the_tree_changes(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "f.c").write_text("int a;\nint c;\n")
    bad = _patch(tmp_path, "diff --git a/f.c b/f.c\n--- a/f.c\n+++ b/f.c\n@@ -1,2 +1,3 @@\n int a;\n"
                           "+int b;\n int c;\n")
    series = Series("nccl", "2.21.5", tmp_path, (SeriesEntry(bad.name, "why", 1),))
    with pytest.raises(PatchError) as err:
        apply_series(series, tree, Progress(quiet=True), insertion_only=True)
    assert "f.c: hunk @@ -1,2 +1,3 @@ removes or keeps 2 upstream line(s)" in str(err.value)
    assert (tree / "f.c").read_text() == "int a;\nint c;\n"


def _one_insertion_series(tmp_path: Path, listing: str | None) -> tuple[Series, Path]:
    tree = tmp_path / "tree"
    tree.mkdir(parents=True)
    (tree / "f.c").write_text("int a;\n")
    patch = _patch(tmp_path, GOOD)
    if listing is not None:
        (tmp_path / TOUCHED_SHA256).write_text(listing)
    return Series("nccl", "2.21.5", tmp_path, (SeriesEntry(patch.name, "why", 1),)), tree


@pytest.mark.unit
def test_a_touched_file_with_another_sha256_after_applying_is_an_error(tmp_path):
    series, tree = _one_insertion_series(tmp_path, f"{'0' * 64}  f.c\n")
    with pytest.raises(PatchError) as err:
        apply_series(series, tree, Progress(quiet=True), insertion_only=True)
    text = str(err.value)
    assert f"after applying the nccl 2.21.5 series, f.c has sha256 {sha256_of(tree / 'f.c')}" in text
    assert f"the series expects {'0' * 64}" in text
    assert "hpct-build fetch nccl --force" in text and "--record-sha256" in text


@pytest.mark.unit
def test_a_touched_file_missing_from_the_listing_is_an_error(tmp_path):
    series, tree = _one_insertion_series(tmp_path, f"{'0' * 64}  other.c\n")
    with pytest.raises(PatchError) as err:
        apply_series(series, tree, Progress(quiet=True))
    assert "lists no sha256 for f.c" in str(err.value)


@pytest.mark.unit
def test_the_right_sha256_passes(tmp_path):
    series, tree = _one_insertion_series(tmp_path, None)
    apply_series(series, tree, Progress(quiet=True), insertion_only=True)
    digest = sha256_of(tree / "f.c")
    assert (tree / "f.c").read_text() == "int a;\nint hpct_added;\n"
    series2, tree2 = _one_insertion_series(tmp_path / "again", f"{digest}  f.c\n")
    apply_series(series2, tree2, Progress(quiet=True), insertion_only=True)


@pytest.mark.slow
def test_record_and_verify_through_the_cli_on_gloo(seeded_root):
    """The same net works for every component: record, verify, and catch a wrong digest."""
    proc = run_cli("hpct-build", "patch", "gloo", "--record-sha256", "--root", str(seeded_root), timeout=300)
    assert proc.returncode == 0, proc.stderr
    listing = seeded_root / "patches" / "gloo" / "5354032" / TOUCHED_SHA256
    lines = listing.read_text().splitlines()
    assert len(lines) >= 8
    proc = run_cli("hpct-build", "patch", "gloo", "--check", "--root", str(seeded_root), timeout=300)
    assert proc.returncode == 0, proc.stderr
    digest, name = lines[0].split(None, 1)
    listing.write_text("\n".join([f"{'f' * 64}  {name}"] + lines[1:]) + "\n")
    proc = run_cli("hpct-build", "patch", "gloo", "--check", "--root", str(seeded_root), timeout=300)
    assert proc.returncode == 5
    assert f"{name} has sha256 {digest}, the series expects {'f' * 64}" in proc.stderr


# ------------------------------------------------------------ with the pinned source

def _source(version: str) -> Path | None:
    """The pinned tree or tarball: a fetched tree, HPCT_NCCL_SOURCES/nccl-<v>-1.tar.gz, or HPCT_NCCL_SOURCE
    (taken only when it names this version)."""
    fetched = REPO / "third_party" / "src" / f"nccl-{version}"
    if (fetched / ".hpct-source.json").is_file():
        return fetched
    folder = os.environ.get("HPCT_NCCL_SOURCES")
    if folder and (Path(folder) / f"nccl-{version}-1.tar.gz").is_file():
        return Path(folder) / f"nccl-{version}-1.tar.gz"
    env = os.environ.get("HPCT_NCCL_SOURCE")
    return Path(env) if env and version in Path(env).name else None


@pytest.mark.slow
@pytest.mark.parametrize("version,hook", [("2.21.5", "hpctBootstrapRootlessRing"),
                                          ("2.30.7", "hpctBootstrapRootlessRing")])
def test_series_applies_to_the_pin_and_every_touched_file_matches(tmp_path, version, hook):
    source = _source(version)
    if source is None:
        pytest.skip(_need_source(version))
    root = tmp_path / "checkout"
    for name in ("third_party", "patches", "build_scripts", "src/nccl_rootless"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("src", "patched", "build", "cache"))
    proc = run_cli("hpct-build", "patch", f"nccl={version}", "--root", str(root),
                   env={"HPCT_NCCL_SOURCE": str(source), "HPCT_NCCL_SOURCES": ""}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "touched files match touched.sha256" in proc.stderr + proc.stdout
    assert "placed 9 project files" in proc.stderr + proc.stdout
    patched = root / "third_party" / "patched" / f"nccl-{version}"
    assert hook in (patched / "src" / "bootstrap.cc").read_text()
    assert "hpctBootstrapLogAllGather" in (patched / "src" / "bootstrap.cc").read_text()
    for rel, name in (("src/misc/hpct_ring.cc", "hpct_ring.cc"), ("src/include/nccl_rootless.h", "nccl_rootless.h")):
        assert (patched / rel).read_bytes() == (PROJECT / name).read_bytes()
    # A zero-context hunk applied to a tree one line off lands in the wrong place without a
    # word from `patch`: the recorded digests are what catches it.
    shifted = tmp_path / "shifted"
    shutil.copytree(patched.parent.parent / "src" / f"nccl-{version}", shifted,
                    ignore=shutil.ignore_patterns(".hpct-source.json"))
    init = shifted / "src" / "init.cc"
    init.write_text("// one line more\n" + init.read_text())
    shutil.rmtree(root / "third_party" / "src")
    shutil.copytree(shifted, root / "third_party" / "src" / f"nccl-{version}")
    (root / "third_party" / "src" / f"nccl-{version}" / ".hpct-source.json").write_text('{"name": "nccl"}\n')
    proc = run_cli("hpct-build", "patch", f"nccl={version}", "--check", "--root", str(root), timeout=300)
    assert proc.returncode == 5, proc.stderr
    assert "src/init.cc has sha256" in proc.stderr and "the series expects" in proc.stderr
