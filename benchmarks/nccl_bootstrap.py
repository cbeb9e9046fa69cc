#!/usr/bin/env python3
"""Bootstrap time of NCCL (2.21.5, or --nccl 2.30.7): hpct's rootless ring vs NCCL's stock root-based bootstrap.

For every world size N (default 2, 4, 8, 16, 32, 64) both variants run in the same
invocation, alternating, on loopback, one forked process per rank, through
tests/nccl/bootstrap_harness.cc compiled against the *patched* NCCL tree (NCCL's own
bootstrap.cc, socket.cc, utils.cc, param.cc, debug.cc plus the series' hpct_ring.cc and
hpct_rootless.cc; no GPU is needed):

* ``rootless``: every rank calls ncclCommInitRankRootless (identity computed locally,
  fixed listen port from a free block, ring to the next rank), then bootstrapAllGather;
* ``stock``: the harness forks the ranks, then calls bootstrapGetUniqueId (NCCL's root
  thread; forking after it could copy a lock that thread holds) and pipes the handle to
  every rank, which calls bootstrapInit with it, then bootstrapAllGather.

The time for N is the slowest rank's time from the harness's start (before NCCL's
network init, the forks and the root) to the end of its ring allgather of the rank
table (which must come back exact); bootstrapInit itself already ran NCCL's three
allgathers.  The stock variant hands the unique id to the ranks through a pipe, not
the store or MPI a real job would use.  NCCL staggers its ranks' connections to
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


@dataclass(frozen=True)
class HarnessProfile:
    """How the harness compiles against one pin's tree (paths under the tree's src/)."""
    files: tuple[str, ...]
    cxxflags: tuple[str, ...]
    includes: tuple[str, ...] = ("include",)
    cuda_from_wheels: bool = True     # CUDA headers from the pinned PyPI wheels; else the pin's toolkit
    libs: tuple[str, ...] = ()


# Per pin of third_party/nccl.toml.  2.30 split parameters (param/), the environment plugin
# (plugin/env*) and the OS layer (os/linux.cc) out of misc/, needs C++17 and NCCL_OS_LINUX, and
# its headers include CCCL's <cuda/atomic>: CUDA 13.0's toolkit headers (include/, include/cccl).
HARNESS_PROFILES = {
    "2.21.5": HarnessProfile(NCCL_FILES, CXXFLAGS),
    "2.30.7": HarnessProfile(
        NCCL_FILES + ("os/linux.cc", "param/param.cc", "param/param_registry.cc", "plugin/env.cc",
                      "plugin/env/default_env.cc", "plugin/env/env_v1.cc", "plugin/env/env_v2.cc",
                      "plugin/plugin_open.cc"),
        ("-std=c++17", "-O1", "-pthread", "-w", "-DNCCL_OS_LINUX", "-DNCCL_GIN_PROXY_ENABLE=0",
         "-DNCCL_GIN_GDAKI_ENABLE=0"),
        includes=("include", "include/plugin"), cuda_from_wheels=False, libs=("-ldl",)),
}


def harness_profile(version: str) -> HarnessProfile:
    try:
        return HARNESS_PROFILES[version]
    except KeyError:
        raise SourceMissing(f"no bootstrap harness profile for NCCL {version} (have: "
                            f"{', '.join(HARNESS_PROFILES)}); add one to HARNESS_PROFILES in "
                            f"benchmarks/nccl_bootstrap.py") from None
CACHE_ENV = "HPCT_NCCL_HARNESS_CACHE"   # where compiled harnesses are kept (default: the temp dir)
COMPILE_TIMEOUT_S = 600
# Per run: the ring deadline and the harness's kill deadline for silent ranks.  NCCL's
# sockets spin (non-blocking recv in a loop), so 64 ranks on a 2-core machine take minutes.
RING_TIMEOUT_MS = 240000
KILL_MS = 300000


class SourceMissing(RuntimeError):
    """NCCL's source is not available; the message says how to provide it."""


def _nccl_manifest(repo: Path, version: str | None = None):
    from hpct.builder.layout import Layout
    from hpct.builder.sources import load_manifest
    return Layout(repo), load_manifest(Layout(repo), "nccl", version)


def source_hint(repo: Path = REPO, version: str | None = None) -> str:
    _, m = _nccl_manifest(repo, version)
    archive = m.providers[0].file if m.providers else f"nccl-{m.version}.tar.gz"
    prefix = archive.removesuffix(".tar.gz")
    tag = m.extra.get("tag", f"v{m.version}")
    component = "nccl" if version is None else f"nccl={m.version}"
    return (f"NCCL {m.version}'s source is not available: put {archive} into the folder HPCT_NCCL_SOURCES "
            f"names, or set HPCT_NCCL_SOURCE=<{archive} or tree> "
            f"(make it with git archive --format=tar --prefix={prefix}/ {tag} | gzip -n) "
            f"or run hpct-build fetch {component} --source PATH")


def source_missing(repo: Path = REPO, version: str | None = None) -> str | None:
    """None when NCCL's source is at hand (the verified tree, the pin's tarball in
    HPCT_NCCL_SOURCES, or HPCT_NCCL_SOURCE), else why not."""
    from hpct.builder.sources import STAMP
    layout, m = _nccl_manifest(repo, version)
    sources = os.environ.get("HPCT_NCCL_SOURCES")
    archive = m.providers[0].file if m.providers else None
    if (layout.source(m.name, m.version) / STAMP).is_file() or os.environ.get("HPCT_NCCL_SOURCE") \
            or (sources and archive and (Path(sources) / archive).is_file()):
        return None
    return source_hint(repo, version)


def patched_tree(repo: Path = REPO, version: str | None = None) -> tuple[Path, str]:
    """The patched tree hpct-build patch made, and its series id."""
    from hpct.builder.patches import PATCHED_STAMP
    layout, m = _nccl_manifest(repo, version)
    tree = layout.patched(m.name, m.version)
    try:
        series_id = json.loads((tree / PATCHED_STAMP).read_text())["series_id"]
    except (OSError, ValueError, KeyError):
        raise SourceMissing(f"{tree} is not a patched tree; run hpct-build patch nccl={m.version}") from None
    return tree, series_id


def patch_with_cli(repo: Path = REPO, timeout: float = 900, version: str | None = None) -> None:
    """hpct-build patch nccl[=VERSION] (the installed CLI), for the benchmark; the tests use run_cli."""
    code = "import sys; from hpct.builder.cli import main; sys.exit(main())"
    component = "nccl" if version is None else f"nccl={version}"
    proc = subprocess.run([sys.executable, "-c", code, "patch", component, "--root", str(repo)],
                          capture_output=True, text=True, timeout=timeout, cwd="/")
    if proc.returncode != 0:
        raise SourceMissing(f"hpct-build patch {component} failed:\n{proc.stderr.strip()}")


def _version_fields(tree: Path) -> dict[str, str]:
    text = (tree / "makefiles" / "version.mk").read_text()
    fields = dict(re.findall(r"^NCCL_(MAJOR|MINOR|PATCH|SUFFIX)\s*:=\s*(\S*)", text, re.MULTILINE))
    major, minor, patch = int(fields["MAJOR"]), int(fields["MINOR"]), int(fields["PATCH"])
    return {"Major": str(major), "Minor": str(minor), "Patch": str(patch), "Suffix": fields.get("SUFFIX", ""),
            # NCCL_VERSION(X,Y,Z) for releases after 2.8: X*10000 + Y*100 + Z
            "Version": f"{major}{minor:02d}{patch:02d}"}


def harness_binary(tree: Path, series_id: str, repo: Path = REPO, progress=None) -> Path:
    """Compile the harness against the patched tree once per (series, harness sources, profile, CUDA)."""
    from hpct.builder.cuda import cuda_headers, cuda_toolchain
    from hpct.builder.layout import Layout
    from hpct.builder.progress import Progress
    from hpct.builder.sources import load_manifest
    progress = progress or Progress(quiet=True)
    fields = _version_fields(tree)
    version = f"{fields['Major']}.{fields['Minor']}.{fields['Patch']}"
    profile = harness_profile(version)
    cuda = load_manifest(Layout(repo), "nccl", version).extra["cuda"]
    key = hashlib.sha256()
    for rel in HARNESS_SOURCES:
        key.update(rel.encode() + b"\0" + (repo / rel).read_bytes() + b"\0")
    key.update(repr((profile, cuda, version)).encode())
    cache = Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "hpct-nccl-bootstrap")
    binary = cache / f"{series_id}-{key.hexdigest()[:12]}" / "bootstrap_harness"
    if binary.is_file():
        return binary
    if profile.cuda_from_wheels:
        cuda_includes = [cuda_headers(Layout(repo), cuda, progress)]
    else:      # the pin's toolkit (CUDA_HOME, or /usr/local/cuda when its nvcc is that release)
        home = cuda_toolchain(Layout(repo), cuda, progress)
        cuda_includes = [home / "include", home / "include" / "cccl"]
    major, minor = cuda.split(".")
    binary.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=binary.parent))
    try:
        header = (tree / "src" / "nccl.h.in").read_text()
        for name, value in fields.items():
            header = header.replace("${nccl:" + name + "}", value)
        (scratch / "include").mkdir()
        (scratch / "include" / "nccl.h").write_text(header)
        sources = [str(tree / "src" / f) for f in profile.files] + [str(repo / f) for f in HARNESS_SOURCES]
        includes = [a for d in profile.includes for a in ("-I", str(tree / "src" / d))]
        cmd = [os.environ.get("CXX", "g++"), *profile.cxxflags, f"-DCUDA_MAJOR={major}", f"-DCUDA_MINOR={minor}",
               "-I", str(scratch / "include"), *includes, *[a for d in cuda_includes for a in ("-I", str(d))],
               *sources, "-o", str(scratch / "bootstrap_harness"), *profile.libs]
        progress.step(f"compiling the NCCL {version} bootstrap harness (series {series_id})")
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
    ap.add_argument("--nccl", default=None, metavar="VERSION",
                    help=f"the NCCL pin to measure (default: third_party/nccl.toml's default; have: "
                         f"{', '.join(HARNESS_PROFILES)})")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    from hpct.builder.progress import Progress
    progress = Progress()
    if (why := source_missing(version=args.nccl)) is not None:
        print(f"nccl_bootstrap: {why}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        patch_with_cli(version=args.nccl)
        tree, series_id = patched_tree(version=args.nccl)
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
    print(f"NCCL {_nccl_manifest(REPO, args.nccl)[1].version} bootstrap on loopback, harness start -> "
          f"ring allgather done (slowest rank); series {series_id}; {os.cpu_count()} CPUs; median of {args.repeat}")
    print(f"{'N':>4}  {'rootless [ms]':>14}  {'stock root [ms]':>16}  {'stock/rootless':>14}  runs ok")
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "n/a"
        print(f"{r['n']:>4}  {_ms(r['rootless_ms']):>14}  {_ms(r['stock_ms']):>16}  {ratio:>14}  "
              f"{r['rootless_runs']}+{r['stock_runs']} of {2 * args.repeat}")
    print(f"total benchmark time {time.monotonic() - started:.1f} s")
    if any(r["failures"] for r in rows):
        print("failed runs (left out of the medians):\n  " + "\n  ".join(f for r in rows for f in r["failures"]))
    if args.json:
        print(json.dumps({"schema_version": 1, "nccl_version": _nccl_manifest(REPO, args.nccl)[1].version,
                          "series_id": series_id, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
