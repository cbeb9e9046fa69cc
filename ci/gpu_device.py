#!/usr/bin/env python3
"""The device side of the GPU proof: check the machine, install from the pack, run the proof.

    python3 ci/gpu_device.py preflight [--from DIR] [--json FILE]
    python3 ci/gpu_device.py run [--from DIR] [--work DIR] [--phase smoke|proof|more|overhead|held|faults|speed|speed61|ddp|start|plan|all]
                                 [--report DIR] [--budget-s SECONDS] [--mps]

Nothing is built here: the pack (ci/gpu_pack.py, made on the CPU machine) carries the patched
libnccl, the hpct wheel, the proof's tests and this script.  ``run`` = preflight, install
(unpack, verify, ``pip install --no-index --no-deps --target``), then the phase's tests.

Only the standard library at import: this runs before anything is installed, and in CI on a
machine without a GPU (tests/test_gpu_pack.py).  torch is asked about in a child process with a
deadline, so that a broken torch cannot take this script down or hang it.
Exit codes: 0 ok, 1 a proof test failed, 2 bad arguments, 3 the preflight refused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))     # beside it, in ci/ and in the pack
from gpu_packfmt import Problem, Refused, load_manifest, unpack_file, verify_stored  # noqa: E402

# What the proof runs on: the device image (KINDS.md) and what the pack is built for.  The pack
# writes its own copy into the manifest ("target"); the manifest's wins when there is one.
TARGET = {"python": "3.12", "torch": "2.11", "cuda": "13.0", "sm": "90", "driver_min": 580,
          "nccl": "2.30.7"}
EXIT_PROOF, EXIT_USAGE, EXIT_PREFLIGHT = 1, 2, 3
PROBE_TIMEOUT = 180          # importing a CUDA torch and creating a context: seconds, not minutes

# The proof's phases: node ids of tests/gpu/test_gpu_proof.py ("library" is run_library_check).
# smoke first (one minute: does the pack load, does one collective agree), then the proof at
# N = 4 (the targets are for one GPU, N = 4), then N = 2 if time is left.
_T = "tests/gpu/test_gpu_proof.py::"
PHASES = {
    "smoke": ["library", _T + "test_engine_collectives_exact_against_stock_nccl[2]"],
    "proof": [_T + "test_engine_collectives_exact_against_stock_nccl[4]",
              _T + "test_ddp_bit_identical_to_stock_nccl_and_survives_a_sigkilled_rank[4]",
              _T + "test_start_up_recovery_and_latency_table[4]",
              _T + "test_bus_bandwidth_table[4]"],
    "more": [_T + "test_ddp_bit_identical_to_stock_nccl_and_survives_a_sigkilled_rank[2]",
             _T + "test_start_up_recovery_and_latency_table[2]",
             _T + "test_bus_bandwidth_table[2]"],
}
# Where a small op's time goes (run under MPS: without it the ranks' kernels take turns on the GPU)
PHASES["overhead"] = [_T + "test_launch_overhead_table[4]", _T + "test_launch_overhead_table[2]"]
PHASES["held"] = [_T + "test_a_blocking_launch_held_by_a_silent_peer_is_ended_at_the_op_timeout"]
# Issue 38's fault paths and issue 39's speed: a graph capture, a failed init (no MPS needed);
# the DDP step and the recovery breakdown (under MPS, as the tables).
PHASES["faults"] = [_T + "test_a_captured_all_reduce_replays_and_the_engine_shuts_down_within_seconds",
                    _T + "test_a_failed_init_frees_its_slot_for_the_next_generation"] + PHASES["held"]
# Issue 59: hpct run forks its workers by default; a forked worker's first CUDA op (no MPS needed).
PHASES["forked"] = [_T + "test_hpct_run_forks_workers_whose_first_cuda_op_runs_and_replaces_a_killed_rank_forked"]
PHASES["faults"] += PHASES["forked"]
PHASES["speed"] = [_T + "test_ddp_step_table_against_stock", _T + "test_recovery_breakdown_table",
                   _T + "test_launch_overhead_table[4]", _T + "test_launch_overhead_table[2]"]
PHASES["all"] = PHASES["smoke"] + PHASES["proof"]
# A session's first call, before its changes: the exact collectives and the timing table (the
# DDP SIGKILL and the bandwidth table cost a minute and do not change with the engine's
# fault path), then the fault paths that need no MPS.
PHASES["start"] = (PHASES["smoke"] + [PHASES["proof"][0], PHASES["proof"][2]] + PHASES["faults"][:2])
# The device plan's first call (docs/gpu-proof.md): the proof without the bandwidth table, then
# every fault path; the second runs "speed" under MPS.
PHASES["plan"] = PHASES["smoke"] + PHASES["proof"][:3] + PHASES["faults"]
PHASES["ddp"] = PHASES["speed"][:1]
# Issue 61 (under MPS): the per-op host times against their targets, then the A/B DDP step.  The
# device plan: `--phase plan`, then, while warm, `--mps --phase speed61` (docs/gpu-proof.md 9).
PHASES["speed61"] = PHASES["overhead"] + [_T + "test_ddp_step_ab_in_one_process"]


# ------------------------------------------------------------------------------ the machine
_FACTS = r"""
import json, os, sys
f = {"python": list(sys.version_info[:3]), "executable": sys.executable}
def mapped(name):
    try:
        text = open("/proc/self/maps").read()
    except OSError:
        return []
    return sorted({l.split(None, 5)[5].strip() for l in text.splitlines()
                   if len(l.split(None, 5)) == 6 and name in l.split(None, 5)[5]})
try:
    import torch
except Exception as e:
    f["torch_error"] = f"{type(e).__name__}: {e}"
else:
    f["torch"] = torch.__version__
    f["torch_cuda"] = torch.version.cuda
    try:
        import torch.distributed as dist
        f["nccl_backend"] = bool(dist.is_available() and dist.is_nccl_available())
    except Exception as e:
        f["nccl_backend"] = False
    try:
        f["cuda_available"] = bool(torch.cuda.is_available())
        f["device_count"] = torch.cuda.device_count() if f["cuda_available"] else 0
        if f["device_count"]:
            f["capability"] = list(torch.cuda.get_device_capability(0))
            f["device_name"] = torch.cuda.get_device_name(0)
            f["torch_nccl_version"] = list(torch.cuda.nccl.version())
    except Exception as e:
        f["cuda_error"] = f"{type(e).__name__}: {e}"
    f["cudart"] = mapped("libcudart.so")
    f["libnccl"] = mapped("libnccl.so")
    if not f["cudart"]:     # not mapped yet: where the CUDA runtime wheel put it, else the toolkit's
        places = [os.path.join(e or ".", "nvidia", sub, "lib") for e in sys.path for sub in ("cu13", "cuda_runtime")]
        places += ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
        f["cudart"] = [os.path.join(d, "libcudart.so.13") for d in places
                       if os.path.isfile(os.path.join(d, "libcudart.so.13"))][:1]
import importlib.util as u
f["modules"] = {m: bool(u.find_spec(m)) for m in sys.argv[1:]}
print("FACTS " + json.dumps(f))
"""


def gather_facts(python: str, modules: list[str] | None = None, timeout: float = PROBE_TIMEOUT) -> dict:
    """What ``python`` has (torch, CUDA, the device) and what the driver says."""
    facts: dict = {}
    try:
        proc = subprocess.run([python, "-c", _FACTS, *(modules or [])], capture_output=True, text=True,
                              timeout=timeout, cwd="/")
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FACTS ")), None)
        if line:
            facts = json.loads(line[6:])
        else:
            facts["probe_error"] = (proc.stderr or proc.stdout).strip()[-800:] or f"exit {proc.returncode}"
    except FileNotFoundError:
        facts["probe_error"] = f"{python}: no such interpreter"
    except subprocess.TimeoutExpired:
        facts["probe_error"] = f"{python} did not answer within {timeout:g} s (importing torch, initialising CUDA)"
    facts["driver"] = driver_version()
    return facts


def driver_version(timeout: float = 30) -> str | None:
    """The NVIDIA driver's version, from nvidia-smi or /proc/driver/nvidia/version; None if none."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            proc = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=timeout)
            if proc.returncode == 0 and proc.stdout.strip():
                return proc.stdout.split()[0]
        except subprocess.TimeoutExpired:
            return None
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return None


def check(facts: dict, target: dict, python: str) -> list[Problem]:
    """Every way the machine differs from what the pack needs (all at once: device time is scarce)."""
    out: list[Problem] = []
    use_image = f"run with the device image's python3 (Python {target['python']}, torch {target['torch']}.x+cu" \
                f"{target['cuda'].replace('.', '')}), or set PYTHON to it"
    if "probe_error" in facts:
        out.append(Problem("python", f"{python} could not be asked: {facts['probe_error']}", use_image))
        facts = {"driver": facts.get("driver")}
    have = ".".join(map(str, facts.get("python", [])[:2]))
    if have and have != target["python"]:
        out.append(Problem("python", f"Python {'.'.join(map(str, facts['python']))} at {facts.get('executable')}; "
                                     f"the pack's hpct wheel is for CPython {target['python']} "
                                     f"(cp{target['python'].replace('.', '')})", use_image))
    if "torch_error" in facts:
        out.append(Problem("torch", f"torch is not importable ({facts['torch_error']})", use_image))
    elif "torch" in facts:
        ver, cuda = facts["torch"], facts.get("torch_cuda")
        if not ver.startswith(target["torch"] + "."):
            out.append(Problem("torch", f"torch {ver}; the proof needs torch {target['torch']}.x (the device "
                                        "image's, whose NCCL the pack's library replaces)", use_image))
        if not cuda:
            out.append(Problem("torch", f"torch {ver} is a CPU build: no CUDA device can be used", use_image))
        elif cuda != target["cuda"]:
            out.append(Problem("torch", f"torch {ver} is built for CUDA {cuda}; the pack's libnccl is built "
                                        f"with CUDA {target['cuda']}", use_image))
        elif not facts.get("nccl_backend"):
            out.append(Problem("torch", f"torch {ver} has no NCCL backend (stock ProcessGroupNCCL is the "
                                        "reference)", use_image))
    driver = facts.get("driver")
    if not driver:
        out.append(Problem("driver", "no NVIDIA driver: nvidia-smi is not on PATH (or does not answer) and "
                                     "/proc/driver/nvidia/version is absent",
                           "run on the GPU machine (the device tool), not on a CPU machine"))
    elif int(driver.split(".")[0]) < target["driver_min"]:
        out.append(Problem("driver", f"NVIDIA driver {driver}; CUDA {target['cuda']} needs "
                                     f"{target['driver_min']} or newer", "use a machine with a newer driver"))
    if "torch" in facts and facts.get("torch_cuda"):
        if not facts.get("cuda_available") or not facts.get("device_count"):
            why = f"; {facts['cuda_error']}" if facts.get("cuda_error") else ""
            out.append(Problem("device", f"no CUDA device is visible (torch {facts['torch']}, CUDA "
                                         f"{facts['torch_cuda']}){why}",
                               "run on the GPU machine; check CUDA_VISIBLE_DEVICES"))
        elif "".join(map(str, facts.get("capability", []))) != target["sm"]:
            cap = "".join(map(str, facts.get("capability", [])))
            out.append(Problem("device", f"device 0 is {facts.get('device_name')} (sm_{cap}); the pack's "
                                         f"libnccl holds sm_{target['sm']} code only",
                               f"build the pack for this GPU: ci/gpu.sh --pack DIR --cuda-arch {cap}"))
        if not facts.get("cudart"):
            out.append(Problem("cuda runtime", f"torch {facts['torch']} has no libcudart.so.13 mapped or in "
                                               "nvidia/cu13/lib: the preloaded libnccl needs torch's copy",
                               "use the image's torch (its CUDA runtime wheel)"))
    return out


def check_pack(pack: Path, facts: dict, shown: str | None = None) -> tuple[dict | None, list[Problem]]:
    """The manifest and its problems (missing, damaged, or missing pytest on this machine)."""
    shown = shown or str(pack)
    fix = f"build it on the CPU machine with `ci/gpu.sh --pack {shown}` and carry {shown} (a git-ignored folder)"
    try:
        manifest = load_manifest(pack)
    except Refused as err:
        return None, [Problem("pack", str(err), fix)]
    problems = verify_stored(pack, manifest)
    modules = facts.get("modules", {})
    carried = {e.get("module") for e in manifest["files"] if e.get("role") == "test-wheel"}
    for mod in ("pytest",):
        if modules and not modules.get(mod) and mod not in carried:
            problems.append(Problem("pack", f"this python has no {mod} and the pack carries none",
                                    "build the pack with its test wheels (the default of ci/gpu.sh --pack)"))
    return manifest, problems


def preflight(pack: Path, python: str, shown: str | None = None,
              timeout: float = PROBE_TIMEOUT) -> tuple[dict | None, dict, list[Problem]]:
    """(manifest, facts, problems); ``shown``: the pack's name as the user gave it."""
    try:
        peek = load_manifest(pack)
    except Refused:
        peek = None
    modules = sorted({e["module"] for e in (peek or {}).get("files", []) if e.get("module")} | {"pytest"})
    facts = gather_facts(python, modules, timeout)
    manifest, pack_problems = check_pack(pack, facts, shown)
    target = {**TARGET, **((manifest or {}).get("target") or {})}
    return manifest, facts, check(facts, target, python) + pack_problems


# ------------------------------------------------------------------------------ MPS
# Without MPS the ranks sharing the one GPU take turns on it in time slices of milliseconds, which
# is what a small op's latency then measures (27 ms per 4 B all_reduce at N = 4, 2026-11-26).
MPS_CONTROL = "nvidia-cuda-mps-control"


def mps_problem() -> Problem | None:
    if shutil.which(MPS_CONTROL):
        return None
    return Problem("mps", f"--mps: {MPS_CONTROL} is not on PATH",
                   "run on the GPU machine (its image has it), or leave --mps out")


def start_mps(work: Path, log) -> bool:
    """Start the MPS control daemon for this run (its pipes under ``work``); the tests inherit the
    variables that reach it.  False when it did not start."""
    for name, sub in (("CUDA_MPS_PIPE_DIRECTORY", "pipe"), ("CUDA_MPS_LOG_DIRECTORY", "log")):
        folder = work / "mps" / sub
        folder.mkdir(parents=True, exist_ok=True)
        os.environ[name] = str(folder)
    try:
        proc = subprocess.run([MPS_CONTROL, "-d"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        log(f"mps: {MPS_CONTROL} -d failed: {err}")
        return False
    log("mps: started" if proc.returncode == 0 else f"mps: {MPS_CONTROL} -d exited {proc.returncode}: "
        f"{(proc.stderr or proc.stdout).strip()[-400:]}")
    return proc.returncode == 0


def stop_mps(log) -> None:
    try:
        subprocess.run([MPS_CONTROL], input="quit\n", capture_output=True, text=True, timeout=30)
        log("mps: stopped")
    except (OSError, subprocess.TimeoutExpired) as err:
        log(f"mps: quit failed: {err}")


def report_problems(problems: list[Problem]) -> None:
    print(f"ci/gpu.sh: the preflight refused ({len(problems)} problem{'s' if len(problems) > 1 else ''}):",
          file=sys.stderr)
    for p in problems:
        print(f"  {p}", file=sys.stderr)


# ------------------------------------------------------------------------------ install
def install(pack: Path, manifest: dict, work: Path, python: str, facts: dict, log) -> Path:
    """Unpack into ``work`` and install the wheels into work/site; reuse a matching install."""
    stamp_value = manifest["pack_id"]
    stamp = work / "installed.json"
    try:
        if json.loads(stamp.read_text()).get("pack_id") == stamp_value:
            log(f"install: {work} already holds pack {stamp_value}")
            return work
    except (OSError, ValueError):
        pass
    staging = work.with_name(work.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    files = staging / "files"
    t0 = time.monotonic()
    for entry in manifest["files"]:
        unpack_file(pack, entry, files)
    log(f"install: unpacked {len(manifest['files'])} files in {time.monotonic() - t0:.1f} s")
    modules = facts.get("modules", {})
    wheels = [files / e["path"] for e in manifest["files"] if e.get("role") == "hpct-wheel"]
    wheels += [files / e["path"] for e in manifest["files"]
               if e.get("role") == "test-wheel" and not modules.get(e.get("module"), False)]
    site = staging / "site"
    site.mkdir()
    pip_install(python, wheels, site, log)
    (staging / "installed.json").write_text(json.dumps({"pack_id": stamp_value}) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    os.replace(staging, work)
    return work


def pip_install(python: str, wheels: list[Path], site: Path, log) -> None:
    """pip install --no-index --no-deps --target; a wheel is a zip laid out for site-packages,
    so without pip its files are unpacked as they are (no scripts needed here)."""
    has_pip = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, timeout=60).returncode == 0
    if has_pip:
        cmd = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
               "--disable-pip-version-check", "--target", str(site), *map(str, wheels)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise Refused(f"pip install of the pack's wheels failed: {proc.stderr.strip()[-800:]}")
    else:
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                z.extractall(site)
    log(f"install: {', '.join(w.name for w in wheels)} into {site} ({'pip' if has_pip else 'unzipped'})")


# ------------------------------------------------------------------------------ the proof
def pack_settings(work: Path):
    """The installed pack's tests/gpu/proof_settings (this script imports nothing else of it)."""
    folder = str(work / "files" / "proof" / "tests" / "gpu")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import proof_settings
    return proof_settings


def proof_environ(work: Path, manifest: dict, facts: dict, report: Path) -> dict:
    """The test process's environment: the installed hpct first on sys.path, and where the
    pack's libnccl and torch's libcudart are (proof_settings.from_environ turns these into the
    ranks' LD_PRELOAD and pins)."""
    lib = work / "files" / manifest["libnccl"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(work / "site")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["GPU_PROOF_LIBNCCL"] = str(lib.resolve())
    env["GPU_PROOF_CUDART_DIR"] = str(Path(facts["cudart"][0]).parent) if facts.get("cudart") else ""
    env["GPU_PROOF_REPORT"] = str(report)
    settings = pack_settings(work)     # where torch looks for NCCL is the proof's knowledge
    env[settings.OVERLAY_VAR] = str(settings.torch_overlay(lib, work / "torch-overlay"))
    env["GPU_PROOF_RANKS"] = "2 4"
    env["PYTHONUNBUFFERED"] = "1"
    return env


_LIBRARY_CHECK = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests", "gpu"))
import proof_settings
import torch
torch.cuda.init()
# torch.cuda.nccl.version() is the NCCL torch was compiled against, not the one it runs on: ask the
# library that the soname resolves to in this process (the one torch's DT_NEEDED bound to).
import ctypes
v = ctypes.c_int(0)
ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(v))
out = {"mapped": proof_settings.mapped_libnccl(), "torch_nccl": list(torch.cuda.nccl.version()),
       "runtime_nccl": [v.value // 10000, v.value // 100 % 100, v.value % 100]}
try:
    try:
        from hpct.distributed.nccl.find import load
    except ImportError:     # a wheel from before the engine became a package (a session's first proof)
        from hpct.distributed.nccl_find import load
    lib = load()
    out.update(hpct_path=os.path.realpath(lib.path), hpct_how=lib.how, hpct_version=lib.version,
               rootless=lib.has_rootless)
except Exception as e:
    out["hpct_error"] = f"{type(e).__name__}: {e}"
print("LIBRARY " + json.dumps(out))
"""


def library_verdict(out: dict, lib: Path, nccl: str) -> list[str]:
    """What is wrong with the library check's answer (empty: both stacks on the pack's libnccl)."""
    want = os.path.realpath(lib)
    wrong = []
    if out.get("mapped") != [want]:
        wrong.append(f"libnccl mapped in the process: {out.get('mapped')}, expected only {want}")
    if ".".join(map(str, out.get("runtime_nccl", []))) != nccl:
        wrong.append(f"the process runs NCCL {out.get('runtime_nccl')}, expected {nccl} (the pack's)")
    if out.get("hpct_error"):
        wrong.append(f"hpct could not load NCCL: {out['hpct_error']}")
    elif out.get("hpct_path") != want or not out.get("rootless"):
        wrong.append(f"hpct uses {out.get('hpct_path')} ({out.get('hpct_how')}, rootless={out.get('rootless')}), "
                     f"expected {want}")
    return wrong


def run_library_check(python: str, work: Path, env: dict, manifest: dict, log, timeout: float) -> bool:
    """One process under the ranks' settings: torch must have loaded the pack's libnccl (and no
    other), report its version, and hpct must use that same mapping."""
    child_env = {**env, **pack_settings(work).from_environ(env)}
    try:
        proc = subprocess.run([python, "-P", "-c", _LIBRARY_CHECK, str(work / "files" / "proof")], env=child_env,
                              capture_output=True, text=True, timeout=timeout, cwd="/")
    except subprocess.TimeoutExpired:
        log(f"library: no answer within {timeout:g} s")
        return False
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("LIBRARY ")), None)
    if line is None:
        log(f"library: the check failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-1500:]}")
        return False
    out = json.loads(line[8:])
    wrong = library_verdict(out, work / "files" / manifest["libnccl"], manifest["target"]["nccl"])
    log("library: " + ("; ".join(wrong) if wrong else
                       f"ok: torch and hpct both on {out['mapped'][0]} (NCCL {out['runtime_nccl']}; torch "
                       f"was compiled against {out['torch_nccl']})"))
    if wrong:     # which object opened which libnccl, and where torch's NCCL calls bound
        try:
            dbg = subprocess.run([python, "-P", "-c", "import torch; torch.cuda.nccl.version()"], cwd="/",
                                 env={**child_env, "LD_DEBUG": "files,bindings"}, capture_output=True,
                                 text=True, timeout=timeout)
            lines = [ln.strip() for ln in dbg.stderr.splitlines()
                     if "file=" in ln and "libnccl" in ln or "ncclGetVersion" in ln]
            log("library: the dynamic linker said:\n  " + "\n  ".join(lines[:24]))
        except subprocess.TimeoutExpired:
            pass
    return not wrong


def run_tests(python: str, work: Path, env: dict, nodes: list[str], log, timeout: float, logfile: Path) -> int:
    """pytest on the pack's tests, echoed as it runs; a timer ends its whole process group at
    the budget even when it prints nothing (the ranks bound themselves too)."""
    proof = work / "files" / "proof"
    cmd = [python, "-P", "-m", "pytest", "-c", str(proof / "pytest.ini"), "--rootdir", str(proof), "-v",
           *[str(proof / n) for n in nodes]]
    log(f"tests: {len(nodes)} test(s), at most {timeout:.0f} s")
    proc = subprocess.Popen(cmd, env=env, cwd=str(proof), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    expired = threading.Event()

    def stop() -> None:
        expired.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    timer = threading.Timer(timeout, stop)
    timer.start()
    try:
        with open(logfile, "a") as out:
            for line in proc.stdout:        # echoed as it comes: the device tool shows the tail
                sys.stdout.write(line)
                out.write(line)
        rc = proc.wait(timeout=60)
    finally:
        timer.cancel()
        if proc.poll() is None:
            stop()
            proc.wait(timeout=30)
    if expired.is_set():
        log(f"tests: still running at the budget ({timeout:.0f} s): stopped")
        return 124
    return rc


# ------------------------------------------------------------------------------ commands
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ci/gpu_device.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("preflight", "run"))
    ap.add_argument("--from", dest="pack", type=Path, default=Path("build/gpu-pack"), help="the carried pack")
    ap.add_argument("--work", type=Path, default=Path("build/gpu-run"), help="where it is installed")
    ap.add_argument("--phase", choices=sorted(PHASES), default="all")
    ap.add_argument("--report", type=Path, default=Path(os.environ.get("OUT") or "build/gpu-proof"))
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole command's time (default 540)")
    ap.add_argument("--json", type=Path, default=None, help="preflight: also write the facts here")
    ap.add_argument("--python", default=os.environ.get("PYTHON") or sys.executable)
    ap.add_argument("--mps", action="store_true", help="run the tests under MPS (started and stopped here)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else 0
    sys.stdout.reconfigure(line_buffering=True)     # the device tool returns the tail as it was printed
    started = time.monotonic()
    pack, work = args.pack.absolute(), args.work.absolute()
    # The probe may take at most half the budget: a torch that hangs on import must not eat the call.
    probe_s = min(PROBE_TIMEOUT, max(30.0, args.budget_s / 2))
    manifest, facts, problems = preflight(pack, args.python, str(args.pack), probe_s)
    if args.mps and (missing := mps_problem()):
        problems.append(missing)
    record = args.json or (args.report / "preflight.json" if args.command == "run" else None)
    if record:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"facts": facts, "problems": [p.__dict__ for p in problems]}, indent=1) + "\n")
    if problems:
        report_problems(problems)
        return EXIT_PREFLIGHT
    print(f"preflight: Python {'.'.join(map(str, facts['python']))}, torch {facts['torch']} (CUDA "
          f"{facts['torch_cuda']}), {facts.get('device_name')} sm_{''.join(map(str, facts['capability']))}, "
          f"driver {facts['driver']}, pack {manifest['pack_id']} verified ({manifest['total_stored_bytes']} bytes)")
    if args.command == "preflight":
        return 0
    report = args.report.absolute()
    report.mkdir(parents=True, exist_ok=True)
    logfile = report / "proof-log.txt"

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - started:6.1f}s] {msg}"
        print(line, flush=True)
        with open(logfile, "a") as f:
            f.write(line + "\n")

    try:
        install(pack, manifest, work, args.python, facts, log)
    except Refused as err:
        log(f"install refused: {err}")
        return EXIT_PREFLIGHT
    if args.mps and not start_mps(work, log):
        return EXIT_PREFLIGHT
    try:
        return run_phase(args, work, manifest, facts, report, logfile, log, started)
    finally:
        if args.mps:
            stop_mps(log)


def run_phase(args, work: Path, manifest: dict, facts: dict, report: Path, logfile: Path, log,
              started: float) -> int:
    env = proof_environ(work, manifest, facts, report)
    rc = 0
    nodes = list(PHASES[args.phase])
    if "library" in nodes:
        nodes.remove("library")
        left = args.budget_s - (time.monotonic() - started)
        if not run_library_check(args.python, work, env, manifest, log, min(120.0, max(left, 1.0))):
            return EXIT_PROOF      # both stacks must be on the pack's library, or nothing below means anything
    if nodes:
        left = args.budget_s - (time.monotonic() - started) - 5
        if left < 30:
            log(f"no time left for the tests ({left:.0f} s)")
            return EXIT_PROOF
        rc = run_tests(args.python, work, env, nodes, log, left, logfile)
    log(f"phase {args.phase}: {'passed' if rc == 0 else f'failed (pytest exit {rc})'} in "
        f"{time.monotonic() - started:.0f} s")
    for table in sorted(report.glob("*-[0-9]*.txt")):
        print(table.read_text(), end="")
    return 0 if rc == 0 else EXIT_PROOF


if __name__ == "__main__":
    sys.exit(main())
