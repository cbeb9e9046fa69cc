#!/usr/bin/env python3
"""Bootstrap time of NCCL 2.21.5: hpct's rootless ring vs NCCL's stock root-based bootstrap.

For every world size N (default 2, 4, 8, 16, 32, 64) both variants run in the same
invocation, alternating, on loopback, one forked process per rank, through
tests/nccl/bootstrap_harness.cc compiled against the *patched* NCCL tree (NCCL's own
bootstrap.cc, socket.cc, utils.cc, param.cc, debug.cc plus the series' hpct_ring.cc and
hpct_rootless.cc; no GPU is needed):

* ``rootless``: every rank calls ncclCommInitRankRootless (identity computed locally,
  fixed listen port from a free block, ring to the next rank), then bootstrapAllGather;
* ``stock``: the harness calls bootstrapGetUniqueId (NCCL's root thread), every rank calls
  bootstrapInit with that handle, then bootstrapAllGather.

The time for N is the slowest rank's time from the harness's start (before NCCL's
network init, the root and the forks) to the end of its ring allgather of the rank
table (which must come back exact); bootstrapInit itself already ran NCCL's three
allgathers.  The stock variant does not include handing the unique id to the ranks
(a store or MPI would do that in a real job).  NCCL staggers its ranks' connections to
the root only above 128 ranks, so no size here is slowed by that.  Median of --repeat.

The module also holds what tests/test_nccl_bootstrap.py shares with it: where NCCL's
source comes from, compiling the harness (cached per series id), running it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARNESS_SOURCES = ("tests/nccl/bootstrap_harness.cc", "tests/nccl/bootstrap_stubs.cc")
# The unmodified NCCL files the bootstrap layer needs, plus the series' two new ones.
NCCL_FILES = ("bootstrap.cc", "misc/socket.cc", "misc/utils.cc", "misc/param.cc", "debug.cc",
              "misc/hpct_ring.cc", "misc/hpct_rootless.cc")
CXXFLAGS = ("-std=c++11", "-O1", "-pthread", "-w")
CACHE_ENV = "HPCT_NCCL_HARNESS_CACHE"   # where compiled harnesses are kept (default: the temp dir)
COMPILE_TIMEOUT_S = 600
# Per run: the ring deadline and the harness's kill deadline for silent ranks.  NCCL's
# sockets spin (non-blocking recv in a loop), so 64 ranks on a 2-core machine take minutes.
RING_TIMEOUT_MS = 240000
KILL_MS = 300000


class SourceMissing(RuntimeError):
    """NCCL's source is not available; the message says how to provide it."""


def _nccl_manifest(repo: Path):
    from hpct.builder.layout import Layout
    from hpct.builder.sources import load_manifest
    return Layout(repo), load_manifest(Layout(repo), "nccl")


def source_hint(repo: Path = REPO) -> str:
    _, m = _nccl_manifest(repo)
    archive = m.providers[0].file if m.providers else f"nccl-{m.version}.tar.gz"
    prefix = archive.removesuffix(".tar.gz")
    tag = m.extra.get("tag", f"v{m.version}")
    return (f"NCCL {m.version}'s source is not available: set HPCT_NCCL_SOURCE=<{archive} or tree> "
            f"(make it with git archive --format=tar --prefix={prefix}/ {tag} | gzip -n) "
            f"or run hpct-build fetch nccl --source PATH")


def source_missing(repo: Path = REPO) -> str | None:
    """None when NCCL's source is at hand (the verified tree, or HPCT_NCCL_SOURCE), else why not."""
    from hpct.builder.sources import STAMP
    layout, m = _nccl_manifest(repo)
    if (layout.source(m.name, m.version) / STAMP).is_file() or os.environ.get("HPCT_NCCL_SOURCE"):
        return None
    return source_hint(repo)


def patched_tree(repo: Path = REPO) -> tuple[Path, str]:
    """The patched tree hpct-build patch made, and its series id."""
    from hpct.builder.patches import PATCHED_STAMP
    layout, m = _nccl_manifest(repo)
    tree = layout.patched(m.name, m.version)
    try:
        series_id = json.loads((tree / PATCHED_STAMP).read_text())["series_id"]
    except (OSError, ValueError, KeyError):
        raise SourceMissing(f"{tree} is not a patched tree; run hpct-build patch nccl") from None
    return tree, series_id


def patch_with_cli(repo: Path = REPO, timeout: float = 900) -> None:
    """hpct-build patch nccl (the installed CLI), for the benchmark; the tests use run_cli."""
    code = "import sys; from hpct.builder.cli import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", code, "patch", "nccl", "--root", str(repo)],
                          capture_output=True, text=True, timeout=timeout, cwd="/")
    if proc.returncode != 0:
        raise SourceMissing(f"hpct-build patch nccl failed:\n{proc.stderr.strip()}")


def _version_fields(tree: Path) -> dict[str, str]:
    text = (tree / "makefiles" / "version.mk").read_text()
    fields = dict(re.findall(r"^NCCL_(MAJOR|MINOR|PATCH|SUFFIX)\s*:=\s*(\S*)", text, re.MULTILINE))
    major, minor, patch = int(fields["MAJOR"]), int(fields["MINOR"]), int(fields["PATCH"])
    return {"Major": str(major), "Minor": str(minor), "Patch": str(patch), "Suffix": fields.get("SUFFIX", ""),
            # NCCL_VERSION(X,Y,Z) for releases after 2.8: X*10000 + Y*100 + Z
            "Version": f"{major}{minor:02d}{patch:02d}"}


def harness_binary(tree: Path, series_id: str, repo: Path = REPO, progress=None) -> Path:
    """Compile the harness against the patched tree once per (series, harness sources, CUDA)."""
    from hpct.builder.cuda import DEFAULT_CUDA, cuda_headers
    from hpct.builder.layout import Layout
    from hpct.builder.progress import Progress
    progress = progress or Progress(quiet=True)
    key = hashlib.sha256()
    for rel in HARNESS_SOURCES:
        key.update(rel.encode() + b"\0" + (repo / rel).read_bytes() + b"\0")
    key.update(" ".join((*CXXFLAGS, DEFAULT_CUDA)).encode())
    cache = Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "hpct-nccl-bootstrap")
    binary = cache / f"{series_id}-{key.hexdigest()[:12]}" / "bootstrap_harness"
    if binary.is_file():
        return binary
    cuda_include = cuda_headers(Layout(repo), DEFAULT_CUDA, progress)
    major, minor = DEFAULT_CUDA.split(".")
    binary.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=binary.parent))
    try:
        header = (tree / "src" / "nccl.h.in").read_text()
        for name, value in _version_fields(tree).items():
            header = header.replace("${nccl:" + name + "}", value)
        (scratch / "include").mkdir()
        (scratch / "include" / "nccl.h").write_text(header)
        sources = [str(tree / "src" / f) for f in NCCL_FILES] + [str(repo / f) for f in HARNESS_SOURCES]
        cmd = [os.environ.get("CXX", "g++"), *CXXFLAGS, f"-DCUDA_MAJOR={major}", f"-DCUDA_MINOR={minor}",
               "-I", str(scratch / "include"), "-I", str(tree / "src" / "include"), "-I", str(cuda_include),
               *sources, "-o", str(scratch / "bootstrap_harness")]
        progress.step(f"compiling the NCCL bootstrap harness (series {series_id})")
        log = binary.parent / "compile.log"
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        log.write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the bootstrap harness failed; log: {log}\n"
                               + (proc.stderr.strip()[-3000:]))
        os.replace(scratch / "bootstrap_harness", binary)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return binary


@dataclass
class HarnessRun:
    returncode: int
    ranks: list[dict]
    stderr: str
    wall_s: float

    def by_rank(self) -> dict[int, dict]:
        return {r["rank"]: r for r in self.ranks}


def bootstrap_env(ifname: str = "lo") -> dict:
    env = dict(os.environ, NCCL_SOCKET_IFNAME=ifname, NCCL_DEBUG="WARN")
    env.pop("NCCL_COMM_ID", None)   # a root address from the environment would change stock mode
    return env


def harness_argv(binary: Path, mode: str, nranks: int, **options) -> list[str]:
    argv = [str(binary), "--mode", mode, "--nranks", str(nranks)]
    for name, value in options.items():
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def parse_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def run_harness(binary: Path, mode: str, nranks: int, *, timeout: float, env: dict | None = None,
                **options) -> HarnessRun:
    """One harness run (all ranks forked by it); options become --kebab-case flags."""
    started = time.monotonic()
    proc = subprocess.run(harness_argv(binary, mode, nranks, **options), capture_output=True, text=True,
                          timeout=timeout, env=env or bootstrap_env(), cwd="/")
    return HarnessRun(proc.returncode, parse_lines(proc.stdout), proc.stderr, time.monotonic() - started)


def measure(binary: Path, mode: str, size: int) -> dict | str:
    """The slowest rank's times, or why the run failed."""
    from hpct.ports import free_port_block
    options = {"timeout_ms": RING_TIMEOUT_MS, "kill_ms": KILL_MS}
    if mode == "rootless":
        options["base_port"] = free_port_block(size)
    run = run_harness(binary, mode, size, timeout=KILL_MS / 1e3 + 30, **options)
    bad = [r for r in run.ranks if r.get("status") != "ok" or not r.get("table_ok")]
    if run.returncode != 0 or len(run.ranks) != size or bad:
        detail = bad[0] if bad else run.stderr.strip()[-1000:]
        return f"{mode} N={size}: the harness failed (exit {run.returncode}): {detail}"
    return {"allgather_ms": max(r["launch_allgather_ms"] for r in run.ranks),
            "init_ms": max(r["launch_init_ms"] for r in run.ranks)}


def _ms(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "failed"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,4,8,16,32,64", help="comma list of world sizes")
    ap.add_argument("--repeat", type=int, default=3, help="runs per size and variant (median)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    from hpct.builder.progress import Progress
    progress = Progress()
    if (why := source_missing()) is not None:
        print(f"nccl_bootstrap: {why}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        patch_with_cli()
        tree, series_id = patched_tree()
        binary = harness_binary(tree, series_id, progress=progress)
    except (SourceMissing, RuntimeError) as err:
        print(f"nccl_bootstrap: {err}", file=sys.stderr)
        return 2
    rows = []
    for n in sizes:
        runs: dict[str, list[dict]] = {"rootless": [], "stock": []}
        for _ in range(args.repeat):
            for mode in runs:             # alternate, so load drifts hit both variants alike
                runs[mode].append(measure(binary, mode, n))
        row: dict = {"n": n, "failures": []}
        for mode, got in runs.items():
            good = [g for g in got if isinstance(g, dict)]
            row["failures"] += [g for g in got if isinstance(g, str)]
            row[f"{mode}_ms"] = statistics.median(g["allgather_ms"] for g in good) if good else None
            row[f"{mode}_init_ms"] = statistics.median(g["init_ms"] for g in good) if good else None
            row[f"{mode}_runs"] = len(good)
        both = row["stock_ms"] is not None and row["rootless_ms"] is not None
        row["ratio"] = row["stock_ms"] / row["rootless_ms"] if both else None
        rows.append(row)
        for failure in row["failures"]:
            progress.step(failure)
        progress.step(f"N={n}: rootless {_ms(row['rootless_ms'])} ms, stock {_ms(row['stock_ms'])} ms")
    print(f"NCCL bootstrap on loopback, harness start -> ring allgather done (slowest rank); "
          f"series {series_id}; {os.cpu_count()} CPUs; median of {args.repeat}")
    print(f"{'N':>4}  {'rootless [ms]':>14}  {'stock root [ms]':>16}  {'stock/rootless':>14}  runs ok")
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "n/a"
        print(f"{r['n']:>4}  {_ms(r['rootless_ms']):>14}  {_ms(r['stock_ms']):>16}  {ratio:>14}  "
              f"{r['rootless_runs']}+{r['stock_runs']} of {2 * args.repeat}")
    print(f"total benchmark time {time.monotonic() - started:.1f} s")
    if any(r["failures"] for r in rows):
        print("failed runs (left out of the medians):\n  " + "\n  ".join(f for r in rows for f in r["failures"]))
    if args.json:
        print(json.dumps({"schema_version": 1, "series_id": series_id, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
