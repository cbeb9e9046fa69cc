#!/usr/bin/env python3
"""NCCL's bootstrap (2.21.5, or --nccl 2.30.7), ring against log depth, measured on the CPU and carried to 100K ranks.

For every world size N (default 64, 256, 1024) each bootstrap runs in the same invocation,
alternating, on loopback, one forked process per rank, through tests/nccl/bootstrap_harness.cc
compiled against the *patched* NCCL tree (NCCL's own bootstrap.cc, socket.cc, utils.cc,
param.cc, debug.cc plus the series' hpct_*.cc; no GPU is needed):

* ``log``: every rank calls ncclCommInitRankRootless (identity computed locally, fixed listen
  port from a free block) and its bootstrap gathers over the log-depth exchange (the default);
* ``ring``: the same with NCCL_HPCT_BOOTSTRAP=ring: hpct's rootless ring and NCCL's own ring
  allgathers (what hpct did before issue 60);
* ``stock`` (on request): the harness forks the ranks, then calls bootstrapGetUniqueId (NCCL's
  root thread) and pipes the handle to every rank, which calls bootstrapInit with it.

After bootstrapInit (2.21.5: three allgathers; 2.30.7: one) each rank gathers its rank table,
then the two large allgathers of initTransportsRank at this pin's sizes (peer info and
allGather3, the topology ranks).  The time for N is the slowest rank's time from the harness's
launch to the end of those; every rank's gathered bytes must agree.  NCCL's sockets spin on a
would-block call; N such processes on 2 CPUs take each other's time (64 ranks' ring took 79 s),
so by default the harness's no-spin shim makes them wait in poll() instead (--spin: not).

From the runs it fits, per N, one connect and one hop on this machine (N ranks sharing its
CPUs), measures the same costs for one pair of processes (a rank with its own CPU), and
carries those to 100K ranks in benchmarks/model.py's model, beside stock NCCL's published
265 s at 96K GPUs (docs/scale.md).

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
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARNESS_SOURCES = ("tests/nccl/bootstrap_harness.cc", "tests/nccl/bootstrap_stubs.cc")
HARNESS_HEADERS = ("tests/nccl/payload.h",)
# The unmodified NCCL files the bootstrap layer needs, plus the series' new ones.
NCCL_FILES = ("bootstrap.cc", "misc/socket.cc", "misc/utils.cc", "misc/param.cc", "debug.cc",
              "misc/hpct_ring.cc", "misc/hpct_rootless.cc", "misc/hpct_exchange.cc", "misc/hpct_exchange_form.cc",
              "misc/hpct_bootstrap_log.cc")
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
VERSION_FILE = "nccl-version"          # beside each compiled harness: the pin it was built against
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
    for rel in HARNESS_SOURCES + HARNESS_HEADERS:
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
        (binary.parent / VERSION_FILE).write_text(version + "\n")
        os.replace(scratch / "bootstrap_harness", binary)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return binary


def harness_version(binary: Path) -> str:
    """The NCCL version a harness binary was compiled against (harness_binary records it)."""
    return (Path(binary).parent / VERSION_FILE).read_text().strip()


@dataclass
class HarnessRun:
    returncode: int
    ranks: list[dict]
    stderr: str
    wall_s: float

    def by_rank(self) -> dict[int, dict]:
        return {r["rank"]: r for r in self.ranks}


BOOTSTRAP_VAR = "NCCL_HPCT_BOOTSTRAP"     # log (the series' default) or ring: how a rootless comm gathers


def bootstrap_env(ifname: str = "lo", bootstrap: str | None = None) -> dict:
    """The harness's environment; ``bootstrap`` sets NCCL_HPCT_BOOTSTRAP (None: the default, log)."""
    env = dict(os.environ, NCCL_SOCKET_IFNAME=ifname, NCCL_DEBUG="WARN")
    env.pop("NCCL_COMM_ID", None)   # a root address from the environment would change stock mode
    env.pop(BOOTSTRAP_VAR, None)
    if bootstrap is not None:
        env[BOOTSTRAP_VAR] = bootstrap
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


# What a benchmark rank gathers after bootstrapInit: its rank table (the harness's check), then
# the two large allgathers of initTransportsRank at this pin's sizes (peer info, topology).
BENCH_PAYLOADS = "peerinfo,allgather3"
BYTE_PROBE = 16 << 20        # 2-rank allgathers of this many bytes per rank: the exchange's cost per byte
BYTE_PROBES = 5
BOOTSTRAPS = ("log", "ring", "stock")


def measure(binary: Path, bootstrap: str, size: int, spin: bool = False) -> dict | str:
    """One run's slowest rank (launch to the end of its measured allgathers), or why it failed.

    ``bootstrap``: log or ring (rootless, NCCL_HPCT_BOOTSTRAP) or stock (NCCL's root)."""
    from hpct.ports import free_port_block
    mode = "stock" if bootstrap == "stock" else "rootless"
    options = {"timeout_ms": RING_TIMEOUT_MS, "kill_ms": KILL_MS, "payload_bytes": BENCH_PAYLOADS,
               "steps": "allgather", "no_spin": 0 if spin else 1}
    if mode == "rootless":
        options["base_port"] = free_port_block(size)
    env = bootstrap_env(bootstrap=None if bootstrap == "stock" else bootstrap)
    run = run_harness(binary, mode, size, timeout=KILL_MS / 1e3 + 30, env=env, **options)
    bad = [r for r in run.ranks if r.get("status") != "ok" or not r.get("table_ok")]
    if run.returncode != 0 or len(run.ranks) != size or bad:
        detail = bad[0] if bad else run.stderr.strip()[-1000:]
        return f"{bootstrap} N={size}: the harness failed (exit {run.returncode}): {detail}"
    if len({tuple(r["digests"]) for r in run.ranks}) != 1:
        return f"{bootstrap} N={size}: the ranks gathered different bytes"
    x = [r["exchange"] for r in run.ranks if r["exchange"]]
    return {"total_ms": max(r["launch_payload_ms"] for r in run.ranks),
            "init_ms": max(r["launch_init_ms"] for r in run.ranks),
            # the forks: when the last rank started, from the harness's launch
            "spread_ms": max(r["launch_init_ms"] - r["init_ms"] for r in run.ranks),
            "digests": run.ranks[0]["digests"], "payload_bytes": run.ranks[0]["payload_bytes"],
            "form_ms": max(e["form_ms"] for e in x) if x else None,
            "rounds": x[0]["rounds"] if x else None,
            "opened": max(e["opened"] for e in x) if x else None,
            "accepted": max(e["accepted"] for e in x) if x else None,
            "allgathers": x[0]["allgathers"] if x else None,
            "bytes": max(e["bytes"] for e in x) if x else None}


def byte_cost(binary: Path) -> float | None:
    """Seconds per byte received by the exchange: the second of two back-to-back 2-rank allgathers
    of BYTE_PROBE bytes each (the first one waits for the later rank to arrive); the least of
    BYTE_PROBES runs, since other jobs on a shared machine only ever add to it."""
    from hpct.ports import free_port_block
    best = None
    for _ in range(BYTE_PROBES):
        run = run_harness(binary, "rootless", 2, timeout=120, base_port=free_port_block(2), timeout_ms=60000,
                          payload_bytes=f"{BYTE_PROBE},{BYTE_PROBE}", steps="allgather", no_spin=1,
                          env=bootstrap_env(bootstrap="log"))
        if run.returncode == 0 and len(run.ranks) == 2:
            got = max(r["exchange"]["last_allgather_ms"] for r in run.ranks) / 1e3 / BYTE_PROBE
            best = got if best is None else min(best, got)
    return best


def reprint(path: str) -> int:
    """The report of a saved run, from its own rows and costs (the tables change, the data do not)."""
    import nccl_bootstrap_fit as fit
    try:
        doc = json.loads(Path(path).read_text())
        if doc.get("schema_version") != fit.SCHEMA:
            raise ValueError(f"schema {doc.get('schema_version')!r}, expected {fit.SCHEMA}")
        c = {k: v for k, v in doc["costs"].items() if k != "nccl_pin"}
        text = fit.report(doc["rows"], c, doc["nccl_version"], doc["series_id"], doc.get("repeat", 1),
                          doc.get("no_spin", True))["text"]
    except (OSError, ValueError, KeyError) as err:
        print(f"nccl_bootstrap: cannot report {path}: {err}\n  fix: write it with nccl_bootstrap.py --json PATH",
              file=sys.stderr)
        return 2
    print(text)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,256,1024", help="comma list of world sizes")
    ap.add_argument("--repeat", type=int, default=1, help="runs per size and bootstrap (median)")
    ap.add_argument("--bootstraps", default="log,ring", help=f"comma list of {', '.join(BOOTSTRAPS)}")
    ap.add_argument("--spin", action="store_true",
                    help="leave NCCL's sockets spinning (the harness's no-spin shim off; see bootstrap_stubs.cc)")
    ap.add_argument("--json", metavar="PATH", help="write the results (and the model's inputs) here")
    ap.add_argument("--nccl", default=None, metavar="VERSION",
                    help=f"the NCCL pin to measure (default: third_party/nccl.toml's default; have: "
                         f"{', '.join(HARNESS_PROFILES)})")
    ap.add_argument("--report", metavar="JSON", help="print the report of an earlier run's --json file; run nothing")
    args = ap.parse_args(argv)
    if args.report:
        return reprint(args.report)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s]
        bootstraps = [b for b in args.bootstraps.split(",") if b]
        if not sizes or min(sizes) < 1 or not bootstraps or set(bootstraps) - set(BOOTSTRAPS):
            raise ValueError
    except ValueError:
        print(f"nccl_bootstrap: --sizes needs positive integers and --bootstraps names from "
              f"{', '.join(BOOTSTRAPS)} (got {args.sizes!r}, {args.bootstraps!r})", file=sys.stderr)
        return 2
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
    import nccl_bootstrap_fit as fit
    version = harness_version(binary)
    progress.step("micro-costs: a connect, a hop, a byte, a store request, a process start")
    costs = fit.micro_costs(byte_cost(binary))
    rows = []
    for n in sizes:
        runs: dict[str, list] = {b: [] for b in bootstraps}
        for _ in range(args.repeat):
            for b in bootstraps:            # alternate, so load drifts hit every bootstrap alike
                runs[b].append(measure(binary, b, n, args.spin))
                got = runs[b][-1]
                progress.step(f"N={n} {b}: " + (f"{got['total_ms']:.0f} ms" if isinstance(got, dict) else got))
        rows.append(fit.row(n, runs, version))
    doc = fit.report(rows, costs, version, series_id, args.repeat, not args.spin)
    print(doc["text"])
    print(f"total benchmark time {time.monotonic() - started:.1f} s")
    if args.json:
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps({k: v for k, v in doc.items() if k != "text"}, indent=1))
        os.replace(tmp, args.json)
    return 0 if all(not r["failures"] for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))   # model.py, nccl_bootstrap_fit.py, scale_costs.py
    sys.exit(main())
