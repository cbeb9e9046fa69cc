#!/usr/bin/env python3
"""The table ci/test.sh ends with: each tier's time, the ten slowest tests, whether each cache hit.

    python3 ci/summary.py [BUILD_DIR]       (default build/; standard library only)

Reads what the run left in BUILD_DIR: the suite's profile ``test-profile-*.jsonl`` (each test's
wall and CPU time, tests/conftest.py), ``ci-tiers.tsv`` (a line ``<tier>\\t<seconds>`` per tier,
written by ci/test.sh), the JUnit reports ``junit-*.xml`` (pytest's, one per pytest run), and the
logs that say whether a cache was used: ``nccl-prebuild.log`` (hpct-build's "taken from the build
cache" / "stored in the build cache" per NCCL version), ``torch-tier-prepare.log`` (the torch
tier's environment: "cache hit" / "cache miss") and ``ccache-before.tsv`` / ``ccache-after.tsv``
(ccache's counters when the run started and ended).  Anything missing is reported as such.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def tiers(build: Path) -> list[tuple[str, int]]:
    path = build / "ci-tiers.tsv"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        name, _, seconds = line.partition("\t")
        if seconds.strip().isdigit():
            out.append((name, int(seconds)))
    return out


def slowest(build: Path, n: int = 10) -> list[tuple[float, str]]:
    cases = []
    for report in sorted(build.glob("junit-*.xml")):
        try:
            root = ET.parse(report).getroot()
        except (ET.ParseError, OSError):
            continue
        for case in root.iter("testcase"):
            module = (case.get("classname") or "").replace(".", "/")
            cases.append((float(case.get("time") or 0.0), f"{report.stem[6:]}: {module}.py::{case.get('name', '')}"))
    return sorted(cases, reverse=True)[:n]


def modules(build: Path, n: int = 12) -> list[tuple[str, float, float, int]]:
    """(module, wall s, CPU s, tests) per test module from the suite's profile (tests/conftest.py),
    the longest first: CPU / wall near 0 waits on sockets and deadlines, near 2 fills both cores."""
    sums: dict[str, list] = {}
    for path in sorted(build.glob("test-profile-*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            row = sums.setdefault(rec["test"].split("::", 1)[0], [0.0, 0.0, 0])
            row[0] += rec.get("wall_s", 0.0)
            row[1] += rec.get("cpu_s", 0.0)
            row[2] += 1
    return sorted(((m, w, c, k) for m, (w, c, k) in sums.items()), key=lambda r: -r[1])[:n]


def caches(build: Path) -> list[tuple[str, str]]:
    out = []
    log = build / "nccl-prebuild.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    for version in ("2.30.7", "2.21.5"):
        if re.search(rf"nccl {re.escape(version)}: taken from the build cache", text):
            out.append((f"NCCL {version} build", "hit"))
        elif re.search(rf"nccl {re.escape(version)}: stored in the build cache", text):
            out.append((f"NCCL {version} build", "miss (built, then stored)"))
        elif text:
            out.append((f"NCCL {version} build", "not used (see build/nccl-prebuild.log)"))
        else:
            out.append((f"NCCL {version} build", "no prebuild ran"))
    log = build / "torch-tier-prepare.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    state = "hit" if "cache hit" in text else "miss (made)" if "cache miss" in text else "no record"
    out.append(("torch tier environment", state))
    out.append(("compiler cache (ccache)", _ccache(build)))
    return out


def _ccache_counts(path: Path) -> dict[str, int]:
    """``ccache --print-stats`` as ci/test.sh saved it: ``<counter>\t<value>`` lines."""
    out = {}
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        key, _, value = line.partition("\t")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _ccache(build: Path) -> str:
    """This run's compiles through ccache: the counters at its end minus those at its start."""
    before, after = _ccache_counts(build / "ccache-before.tsv"), _ccache_counts(build / "ccache-after.tsv")
    if not after:
        return "no record (ccache not installed?)"
    hits = sum(after.get(k, 0) - before.get(k, 0) for k in ("direct_cache_hit", "preprocessed_cache_hit"))
    misses = after.get("cache_miss", 0) - before.get("cache_miss", 0)
    return f"{hits} of {hits + misses} compiles hit" if hits + misses else "no compile went through it"


def main(argv: list[str]) -> int:
    build = Path(argv[1]) if len(argv) > 1 else Path("build")
    print("ci summary " + "-" * 60)
    rows = tiers(build)
    print(f"{'tier':28s} {'seconds':>8s}")
    for name, seconds in rows:
        print(f"{name:28s} {seconds:8d}")
    if rows:
        print(f"{'all tiers':28s} {sum(s for _, s in rows):8d}")
    print("\nten slowest tests (seconds):")
    found = slowest(build)
    for seconds, name in found:
        print(f"{seconds:8.1f}  {name}")
    if not found:
        print("  (no JUnit report in build/)")
    rows = modules(build)
    if rows:
        print("\nlongest test modules: wall s, CPU s (own and children's), CPU/wall, tests:")
        for name, wall, cpu, count in rows:
            print(f"{wall:8.1f} {cpu:8.1f} {cpu / wall if wall else 0.0:6.2f} {count:5d}  {name}")
    print("\ncaches:")
    for what, state in caches(build):
        print(f"  {what:26s} {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
