#!/usr/bin/env python3
"""``ci/gpu.sh --pack DIR``: build here what the GPU proof needs and pack it for the device tool.

    python3 ci/gpu_pack.py DIR [--funcs all|proof|SPEC] [--max-calls N] [--limit-mib 64]
                           [--margin-mib 4] [--python312 PATH] [--reuse] [--no-test-wheels]

The device machine builds nothing (a full NCCL build alone would not fit its minutes): this CPU
machine builds the patched libnccl 2.30.7 for sm_90 with CUDA 13.0, the hpct wheel for cp312,
and the pack carries them with the proof's tests and its runner (ci/gpu_device.py).  The device
tool carries at most 64 MiB per call, the working tree that travels with every call included,
so the pack is sized against ``limit - tree - margin``: files are stripped, compressed (xz,
which the device's Python reads with lzma) where that pays, and split across calls only when
--max-calls allows it; otherwise it is refused, naming the largest files.

DIR is written atomically (a staging folder renamed into place); the logs go to build/gpu-pack-logs/.
Exit codes: 0 packed, 2 bad arguments, 4 refused (toolchain, inputs or size), 5 a build failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import gpu_device  # noqa: E402  (the device side: its target, the runner the pack carries)
from gpu_packfmt import LIMIT_MIB, MIB, Refused, Source, pack, xz  # noqa: E402

MARGIN_MIB = 4            # the checkout that calls the device may hold a little more than this one
NCCL_VERSION = "2.30.7"
CUDA = "13.0"
EXIT_REFUSED, EXIT_BUILD = 4, 5
# The proof's pytest and what it needs, installed on the device only where its python lacks them.
TEST_WHEELS = (("pytest", "9.0.3", "pytest"), ("pluggy", "1.6.0", "pluggy"), ("iniconfig", "2.3.0", "iniconfig"),
               ("packaging", "26.2", "packaging"), ("pygments", "2.20.0", "pygments"))
PROOF_FILES = ("tests/gpu/test_gpu_proof.py", "tests/gpu/worker.py", "tests/gpu/worker_faults.py",
               "tests/gpu/worker_speed.py", "tests/gpu/worker_ab.py", "tests/gpu/proof_settings.py",
               "tests/gpu/verdicts.py", "tests/gpu/targets.py")
PYTEST_INI = ("[pytest]\n# The GPU proof's own configuration (the checkout's tests/conftest.py is not used).\n"
              "markers =\n    gpu: needs a CUDA device\naddopts = -ra --strict-markers -p no:cacheprovider\n")


def _load_settings():
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import proof_settings
    return proof_settings


# ------------------------------------------------------------------------------ checks here
def nvcc_release(text: str) -> str | None:
    """'13.0' from `nvcc --version`'s 'Cuda compilation tools, release 13.0, V13.0.88'."""
    m = re.search(r"release (\d+\.\d+)", text)
    return m.group(1) if m else None


def check_nvcc(env: dict) -> tuple[Path, str]:
    """The nvcc the NCCL build will use (CUDA_HOME's, else /usr/local/cuda's, as hpct-build
    picks it) must be exactly CUDA 13.0: torch 2.11+cu130's runtime on the device."""
    home = env.get("CUDA_HOME") or "/usr/local/cuda"
    nvcc = Path(home) / "bin" / "nvcc"
    fix = f"install CUDA {CUDA} and set CUDA_HOME to it (the pack's libnccl must match torch's cu130 runtime)"
    if not nvcc.is_file():
        raise Refused(f"no nvcc at {nvcc} (CUDA_HOME={env.get('CUDA_HOME', 'unset')})", fix)
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        raise Refused(f"{nvcc} --version failed ({err})", fix) from None
    release = nvcc_release(out)
    if release != CUDA:
        raise Refused(f"{nvcc} is CUDA {release or 'of unknown release'}, not exactly {CUDA}", fix)
    return nvcc, out.strip().splitlines()[-1]


def check_source(env: dict, build_root: Path) -> None:
    """NCCL's tag tarball must be handed over (no registry serves it), unless already fetched."""
    if env.get("HPCT_NCCL_SOURCE") or env.get("HPCT_NCCL_SOURCES"):
        return
    if (build_root / "third_party" / "src" / f"nccl-{NCCL_VERSION}").is_dir():
        return
    raise Refused(f"NCCL {NCCL_VERSION}'s source is not handed over",
                  f"set HPCT_NCCL_SOURCE=/path/to/nccl-{NCCL_VERSION}-1.tar.gz (the tag tarball; the team's "
                  "shared/sources/ has it) or HPCT_NCCL_SOURCES to its folder")


_REQS = "import sys, importlib.util as u; print('%d.%d' % sys.version_info[:2], all(u.find_spec(m) for m in ('scikit_build_core', 'pybind11')))"


def check_python312(given: str | None, root: Path) -> Path:
    """The CPython 3.12 that builds the cp312 wheel, with scikit-build-core and pybind11 in it
    (a venv under build/ keeps them out of the machine's interpreters)."""
    venv = root / "build" / "py312"
    make = (f"python3.12 -m venv {venv} && {venv}/bin/python -m pip install 'scikit-build-core>=0.10' "
            "'pybind11>=2.12'  (python3.12: pyenv's, e.g. ~/.pyenv/versions/3.12.*/bin/python)")
    if given:
        path = Path(given).absolute()     # hpct-build probes it from /
    elif (venv / "bin" / "python").exists():
        path = venv / "bin" / "python"
    else:
        raise Refused(f"no Python 3.12 to build the cp312 wheel with ({venv} does not exist)",
                      f"make it: {make}; or pass --python312 PATH")
    try:
        out = subprocess.run([str(path), "-c", _REQS], capture_output=True, text=True, timeout=60).stdout.split()
    except (OSError, subprocess.TimeoutExpired) as err:
        raise Refused(f"{path} does not run ({err})", f"make it: {make}") from None
    if not out or out[0] != "3.12":
        raise Refused(f"{path} is Python {out[0] if out else '?'}, not 3.12 (the device's)",
                      f"pass --python312 a CPython 3.12, or make one: {make}")
    if out[1] != "True":
        raise Refused(f"{path} lacks scikit-build-core or pybind11 (the wheel's build requirements)",
                      f"{path} -m pip install 'scikit-build-core>=0.10' 'pybind11>=2.12'")
    return path


def resolve_funcs(value: str) -> str | None:
    """--funcs: all (None: every collective), proof (what the proof reaches under its pins), or a spec."""
    if value == "all":
        return None
    if value == "proof":
        return _load_settings().PROOF_FUNCS
    return value


# ------------------------------------------------------------------------------ builds
def run_timed(cmd: list[str], log: Path, what: str, cwd: Path, env: dict | None = None,
              timeout: float = 3 * 3600) -> tuple[float, str]:
    """Run ``cmd`` with its output in ``log``; (seconds, output's last line); a failure raises."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    print(f"gpu-pack: {what} (log: {log})", flush=True)
    with open(log, "w") as out:
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BuildFailed(f"{what} ran past {timeout:.0f} s; see {log}") from None
    seconds = time.monotonic() - t0
    lines = log.read_text(errors="replace").strip().splitlines()
    if proc.returncode != 0:
        tail = "\n    ".join(lines[-12:])
        raise BuildFailed(f"{what} failed (exit {proc.returncode}); last lines:\n    {tail}\n  whole log: {log}")
    print(f"gpu-pack: {what}: {seconds:.0f} s", flush=True)
    return seconds, lines[-1] if lines else ""


class BuildFailed(Exception):
    pass


def build_nccl(root: Path, funcs: str | None, arch: str, logs: Path, env: dict,
               workdir: Path | None = None) -> tuple[Path, dict, float]:
    """hpct-build build nccl, in the checkout or in ``workdir`` (which keeps the checkout's own
    NCCL build, another version or arch list, untouched)."""
    cmd = [sys.executable, "-m", "hpct.builder", "build", f"nccl={NCCL_VERSION}", "--cuda", CUDA,
           "--cuda-arch", arch]
    if workdir:
        cmd += ["--workdir", str(workdir)]
    if funcs:
        cmd += ["--funcs", funcs]
    seconds, _ = run_timed(cmd, logs / "nccl.log", f"building NCCL {NCCL_VERSION} for sm_{arch} "
                           f"({'proof functions' if funcs else 'all functions'})", root, env)
    prefix = (workdir or root) / "third_party" / "build" / f"nccl-{NCCL_VERSION}" / "install"
    stamp = json.loads((prefix / "hpct-series.json").read_text())
    return prefix, stamp, seconds


def built_nccl(build_root: Path, funcs: str | None, arch: str, series: str | None = None) -> tuple[Path, dict] | None:
    """An existing build made with exactly these settings and, when given, this patch series (--reuse)."""
    prefix = build_root / "third_party" / "build" / f"nccl-{NCCL_VERSION}" / "install"
    try:
        stamp = json.loads((prefix / "hpct-series.json").read_text())
    except (OSError, ValueError):
        return None
    if stamp.get("funcs") != funcs or stamp.get("cuda") != CUDA or stamp.get("cuda_archs") != [arch]:
        return None
    if series is not None and stamp.get("series_id") != series:
        return None
    return prefix, stamp


_SERIES = ("import sys; from pathlib import Path; from hpct.builder.layout import resolve_layout; "
           "from hpct.builder.sources import load_manifest; from hpct.builder.patches import load_series; "
           "l = resolve_layout(Path(sys.argv[1]), None); print(load_series(l, load_manifest(l, 'nccl', sys.argv[2])).identity())")


def series_id(root: Path) -> str:
    """The identity of this checkout's NCCL series (what hpct-build stamps a build with)."""
    proc = subprocess.run([sys.executable, "-c", _SERIES, str(root), NCCL_VERSION], capture_output=True, text=True,
                          timeout=120, cwd=root)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise Refused(f"cannot read this checkout's NCCL {NCCL_VERSION} series: {proc.stderr.strip()[-300:]}",
                      "run from an hpct checkout (patches/nccl/)")
    return proc.stdout.split()[-1]


def build_wheel(root: Path, python312: Path, logs: Path, env: dict) -> tuple[Path, float]:
    cmd = [sys.executable, "-m", "hpct.builder", "wheel", "--python", str(python312)]
    seconds, last = run_timed(cmd, logs / "wheel.log", "building the hpct wheel for cp312", root, env)
    wheel = Path(last.strip())
    if not wheel.is_file() or "-cp312-" not in wheel.name:
        raise BuildFailed(f"hpct-build wheel printed {last!r}, not a cp312 wheel; see {logs / 'wheel.log'}")
    return wheel, seconds


def fetch_test_wheels(cache: Path) -> list[tuple[Path, str]]:
    """The pinned pytest wheels (pure Python), downloaded once with pip."""
    cache.mkdir(parents=True, exist_ok=True)
    out = []
    for dist, version, module in TEST_WHEELS:
        pattern = f"{dist}-{version}-py3-none-any.whl"
        found = [p for p in cache.iterdir() if p.name.lower() == pattern.lower()]
        if not found:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                   "--disable-pip-version-check", "-d", str(cache), f"{dist}=={version}"],
                                  capture_output=True, text=True, timeout=300)
            found = [p for p in cache.iterdir() if p.name.lower() == pattern.lower()]
            if proc.returncode != 0 or not found:
                raise Refused(f"could not download {dist}=={version}: {proc.stderr.strip()[-300:]}",
                              f"make PyPI reachable, put {pattern} into {cache}, or pass --no-test-wheels "
                              "when the device's python has pytest")
        out.append((found[0], module))
    return out


def strip_library(src: Path, dst: Path) -> None:
    """Drop the static symbol table and debug sections; the dynamic symbols (what dlopen and
    ctypes use) stay."""
    strip = shutil.which("strip")
    if not strip:
        raise Refused("no strip (binutils)", "apt-get install -y binutils")
    dst.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([strip, "--strip-unneeded", "-o", str(dst), str(src)], check=True, timeout=300)


_LIB_CHECK = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
v = ctypes.c_int(0)
assert lib.ncclGetVersion(ctypes.byref(v)) == 0
print(v.value, all(hasattr(lib, s) for s in ("ncclCommInitRankRootless", "ncclRootlessUniqueId")))
"""


def check_library(lib: Path, cuda_home: Path, version: str) -> None:
    """The stripped library still loads (against CUDA's runtime here: no GPU needed for that),
    reports its version and exports the rootless entry points."""
    env = {**os.environ, "LD_LIBRARY_PATH": f"{cuda_home / 'lib64'}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", _LIB_CHECK, str(lib)], capture_output=True, text=True,
                          timeout=120, env=env)
    major, minor, patch = (int(x) for x in version.split("."))
    want = major * 10000 + minor * 100 + patch
    if proc.returncode != 0 or proc.stdout.split() != [str(want), "True"]:
        raise Refused(f"{lib} does not load as NCCL {version} with the rootless calls: "
                      f"{(proc.stdout + proc.stderr).strip()[-400:]}", "see the NCCL build log")


# ------------------------------------------------------------------------------ the pack
def tree_bytes(root: Path) -> int:
    """What travels with every device call besides the carried paths: tracked files and
    untracked files git does not ignore."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, timeout=120, check=True).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise Refused(f"cannot list the working tree of {root} ({err})", "run in a git checkout") from None
    total = 0
    for name in filter(None, out.decode().split("\0")):
        p = root / name
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def measure_library(lib: Path, work: Path) -> dict:
    """Sizes of one libnccl as built, stripped, xz'd (what the pack stores) and zstd'd (for the record)."""
    work.mkdir(parents=True, exist_ok=True)
    stripped = work / "libnccl.stripped"
    strip_library(lib, stripped)
    out = {"raw": lib.stat().st_size, "stripped": stripped.stat().st_size}
    out["xz_seconds"] = round(xz(stripped, work / "lib.xz"), 1)
    out["xz"] = (work / "lib.xz").stat().st_size
    if shutil.which("zstd"):
        subprocess.run(["zstd", "-q", "-19", "-f", "-o", str(work / "lib.zst"), str(stripped)], check=True, timeout=900)
        out["zstd19"] = (work / "lib.zst").stat().st_size
    shutil.rmtree(work, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ci/gpu.sh --pack", description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", type=Path, help="the pack folder (e.g. build/gpu-pack; git-ignored)")
    ap.add_argument("--funcs", default="proof",
                    help="NCCL device code: proof (Ring/Simple, what the proof reaches; default), all, or an ONLY_FUNCS spec")
    ap.add_argument("--cuda-arch", default=gpu_device.TARGET["sm"])
    ap.add_argument("--max-calls", type=int, default=1, help="device calls the pack may be split across (default 1)")
    ap.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    ap.add_argument("--margin-mib", type=float, default=MARGIN_MIB)
    ap.add_argument("--python312", default=os.environ.get("PACK_PYTHON"), help="CPython 3.12 for the wheel")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse a NCCL build made with these settings (the wheel is always rebuilt: it carries "
                         "this checkout's hpct, and its build is incremental)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="build NCCL in this folder (hpct-build --workdir), not in the checkout's third_party/")
    ap.add_argument("--no-test-wheels", action="store_true", help="carry no pytest (the device's python has it)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    root, env = ROOT, dict(os.environ)
    logs = root / "build" / "gpu-pack-logs"
    dest = args.dest if args.dest.is_absolute() else Path.cwd() / args.dest
    try:
        if args.max_calls < 1:
            raise Refused(f"--max-calls {args.max_calls}", "at least 1")
        funcs = resolve_funcs(args.funcs)
        nvcc, nvcc_text = check_nvcc(env)
        workdir = args.workdir.absolute() if args.workdir else None
        check_source(env, workdir or root)
        py312 = check_python312(args.python312, root)
        times = {}
        # --reuse: only a build of this checkout's series (an older series' library would not be the code here).
        found = built_nccl(workdir or root, funcs, args.cuda_arch, series_id(root)) if args.reuse else None
        if found:
            (prefix, stamp), times["nccl_build_s"] = found, None
        else:
            prefix, stamp, times["nccl_build_s"] = build_nccl(root, funcs, args.cuda_arch, logs, env, workdir)
        wheel, times["wheel_build_s"] = build_wheel(root, py312, logs, env)
        work = root / "build" / "gpu-pack-work"
        shutil.rmtree(work, ignore_errors=True)
        lib = work / "libnccl.so.2"
        strip_library(prefix / "lib" / "libnccl.so.2", lib)
        check_library(lib, nvcc.parent.parent, NCCL_VERSION)
        sizes = {"libnccl_raw": (prefix / "lib" / "libnccl.so.2").stat().st_size, "libnccl_stripped": lib.stat().st_size}
        sources = [Source("nccl/lib/libnccl.so.2", lib, "libnccl", mode=0o755),
                   Source("nccl/hpct-series.json", prefix / "hpct-series.json", "build-info"),
                   Source(f"wheels/{wheel.name}", wheel, "hpct-wheel")]
        if (prefix / "LICENSE.txt").is_file():     # BSD-3: the binary travels with its notice
            sources.append(Source("nccl/LICENSE.txt", prefix / "LICENSE.txt", "license"))
        if not args.no_test_wheels:
            for path, module in fetch_test_wheels(root / "build" / "gpu-pack-cache" / "wheels"):
                sources.append(Source(f"wheels/{path.name}", path, "test-wheel", module))
        for rel in PROOF_FILES:
            sources.append(Source(f"proof/{rel}", root / rel, "proof"))
        ini = work / "pytest.ini"
        ini.write_text(PYTEST_INI)
        sources += [Source("proof/pytest.ini", ini, "proof"),
                    Source("proof/gpu_device.py", HERE / "gpu_device.py", "runner", mode=0o755),
                    Source("proof/gpu_packfmt.py", HERE / "gpu_packfmt.py", "runner")]
        meta = {"target": {**gpu_device.TARGET, "sm": args.cuda_arch}, "libnccl": "nccl/lib/libnccl.so.2",
                "build": {"nccl_funcs": funcs or "all", "nvcc": nvcc_text, "nccl_series": stamp.get("series_id"),
                          "nccl_gencode": stamp.get("nvcc_gencode"), "wheel": wheel.name,
                          "times_s": {k: (round(v, 1) if v is not None else None) for k, v in times.items()},
                          "sizes": sizes}}
        manifest = pack(sources, dest, limit=int(args.limit_mib * MIB), tree=tree_bytes(root),
                        margin=int(args.margin_mib * MIB), max_calls=args.max_calls, meta=meta,
                        work=work / "blobs")
        shutil.rmtree(work, ignore_errors=True)
    except Refused as err:
        problem, fix = err.args[0], (err.args[1] if len(err.args) > 1 else "")
        print(f"ci/gpu.sh --pack: refused: {problem}" + (f"\n  fix: {fix}" if fix else ""), file=sys.stderr)
        return EXIT_REFUSED
    except BuildFailed as err:
        print(f"ci/gpu.sh --pack: {err}", file=sys.stderr)
        return EXIT_BUILD
    summarize(manifest, dest)
    return 0


def summarize(manifest: dict, dest: Path) -> None:
    print(f"gpu-pack: {dest}: pack {manifest['pack_id']}, {len(manifest['files'])} files, "
          f"{manifest['total_bytes'] / MIB:.1f} MiB unpacked, {manifest['total_stored_bytes'] / MIB:.1f} MiB stored "
          f"in {len(manifest['calls'])} call(s) (budget {manifest['budget_bytes'] / MIB:.1f} MiB per call = "
          f"{manifest['limit_bytes'] / MIB:.0f} MiB - tree {manifest['tree_bytes'] / MIB:.1f} MiB - margin "
          f"{manifest['margin_bytes'] / MIB:.0f} MiB)")
    for f in sorted(manifest["files"], key=lambda f: f["stored_size"], reverse=True):
        print(f"  {f['stored_size']:>11,d} stored  {f['size']:>11,d} unpacked  {f['codec']:4s}  {f['path']}")
    for c in manifest["calls"]:
        print(f"  call {c['call']}: carry {c['carry']} ({c['bytes'] / MIB:.1f} MiB)")


if __name__ == "__main__":
    sys.exit(main())
