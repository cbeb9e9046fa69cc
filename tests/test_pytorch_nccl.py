"""The NCCL half of the PyTorch 2.6.0 series (patches 0008-0011): rootless ProcessGroupNCCL.

No GPU here, and no NCCL source: what runs is

* the Python side of the address derivation (``nccl_setup`` of the patched
  ``_hpct_rootless`` module), against the shared port-plan vectors, and every
  bad-input message;
* the run-time lookup of ``ncclCommInitRankRootless`` (the torch-free header
  ``NCCLRootless.hpp`` of patch 0009) in a small program linked against the
  *real* stock ``libnccl.so.2`` of ``nvidia-nccl-cu12==2.21.5`` (which lacks the
  call), and against a stand-in libnccl that has it and records what it is given;
* (``slow``) a compile of every changed C++ unit with NCCL on, against the
  ``torch==2.6.0`` wheel's headers, the wheel's stock ``nccl.h``, hpct's
  ``nccl_rootless.h`` (taken from the NCCL series), and CUDA 12.4 headers from
  PyPI wheels, plus controls that fail where they should.

A ProcessGroupNCCL run needs a GPU (its constructor refuses to run without one);
see docs/pytorch-build.md for what a GPU machine checks.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

from pytorch_series import (  # noqa: F401  (fixtures are used by name)
    CACHE, GLOO_CONFIG, GLOO_PATCHED, MODULE, PATCHED, PRISTINE, SERIES_DIR, TORCH_INCLUDE, VECTORS,
    _error_names, changed_files, compile_env, fetch_extra_headers, fetch_torch_headers, patched_tree, rl,
)
from util import REPO, unguarded_calls

C10D = "torch/csrc/distributed/c10d"
NCCL_PATCHES = ("0008", "0009", "0010", "0011")
NCCL_PIN = "2.21.5"
CUDA = "12.4"
NCCL_UNITS = (f"{C10D}/NCCLUtils.cpp", f"{C10D}/ProcessGroupNCCL.cpp", f"{C10D}/init.cpp")
NCCL_DEFINES = ["-DUSE_C10D_NCCL", "-DUSE_C10D_GLOO", "-DUSE_DISTRIBUTED", "-DUSE_C10D", "-DUSE_CUDA",
                "-DUSE_RPC", "-DUSE_TENSORPIPE", "-DTHP_BUILD_MAIN_LIB"]
def _env(case: dict) -> dict:
    """The environment of a port_plan.json peer_table case, as the NCCL block."""
    return {"TORCH_NCCL_GET_PORT_BASE": str(case["block_base"]), "TORCH_GLOO_GET_PORT_BASE": "1024",
            "N_PROC_PER_NODE": str(case["nproc_per_node"]), "HPCT_PORT_SLOTS": str(case["slots"]),
            "HPCT_HOSTS": ",".join(case["hosts"])}


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ------------------------------------------------------------ the series

@pytest.mark.unit
def test_nccl_patches_are_in_the_series_and_touch_the_nccl_units():
    lines = [ln.split("#", 1)[0].strip() for ln in (SERIES_DIR / "series").read_text().splitlines()]
    names = [n for n in lines if n]
    ours = [n for n in names if n[:4] in NCCL_PATCHES]
    assert len(ours) == len(NCCL_PATCHES)
    touched = set()
    for name in ours:
        text = (SERIES_DIR / name).read_text()
        touched.update(re.findall(r"^diff --git a/\S+ b/(\S+)$", text, re.MULTILINE))
    for must in (MODULE, "torch/distributed/distributed_c10d.py", f"{C10D}/ProcessGroupNCCL.cpp",
                 f"{C10D}/ProcessGroupNCCL.hpp", f"{C10D}/NCCLUtils.cpp", f"{C10D}/NCCLUtils.hpp",
                 f"{C10D}/NCCLRootless.hpp", f"{C10D}/init.cpp"):
        assert must in touched, must


@pytest.mark.unit
def test_the_patch_says_how_subgroups_and_pairs_form(patched_tree):
    text = next(SERIES_DIR.glob("0010-*.patch")).read_text().split("\n---\n", 1)[0]
    flat = " ".join(text.split())
    assert "split from the default communicator" in flat and "own slot" in flat
    assert "Single send/recv pairs" in flat and "group's communicator" in flat


def _hpct_calls_guarded(source: str) -> tuple[int, list[str]]:
    """Calls of hpct code in distributed_c10d, and those not behind HPCT_USE_ROOTLESS."""
    def is_hpct(call: ast.Call) -> bool:
        name = ast.unparse(call.func)
        return name.startswith("_hpct_") and name != "_hpct_rootless.enabled"
    return unguarded_calls(source, is_hpct)


@pytest.mark.unit
def test_every_hpct_call_in_c10d_is_behind_the_switch(patched_tree):
    """HPCT_USE_ROOTLESS unset: distributed_c10d runs no hpct code (NCCL helpers included)."""
    calls, unguarded = _hpct_calls_guarded((patched_tree / "torch/distributed/distributed_c10d.py").read_text())
    assert calls >= 20
    assert unguarded == []
    # The check is real: an unguarded call is found.
    _, bad = _hpct_calls_guarded("def f(o):\n    _hpct_rootless_nccl(o, '0', 0, 1, [])\n")
    assert bad == ["line 2: _hpct_rootless_nccl"]


@pytest.mark.unit
def test_cpp_rootless_paths_are_behind_the_options(patched_tree):
    """In C++ every rootless path starts at options_->rootless(), which only the switch sets."""
    src = (patched_tree / C10D / "ProcessGroupNCCL.cpp").read_text()
    for call in ("initRootlessNCCLComm(numRanks", "abortWithinBound();"):
        hits = [m.start() for m in re.finditer(re.escape(call), src)]
        assert len(hits) == 1, call
        line_start = src.rindex("\n", 0, hits[0])
        before = src[:line_start].rstrip().splitlines()[-1]       # the line above the call
        assert "options_->rootless()" in before, (call, before)
    p2p = src.index("} else if (options_->rootless()) {")
    assert "getKeySendRecv(rank_, peer)" in src[p2p:p2p + 3000]       # the stock pair path follows
    hpp = (patched_tree / C10D / "ProcessGroupNCCL.hpp").read_text()
    assert re.search(r"bool rootless\(\) const \{\s*return !rootless_listen_addr\.empty\(\);", hpp)
    assert re.search(r"std::string rootless_listen_addr;", hpp)      # default: empty, i.e. stock
    py = (patched_tree / "torch/distributed/distributed_c10d.py").read_text()
    assert py.count("options._rootless_listen_addr = ") == 1


# ------------------------------------------------------------ address derivation (shared vectors)

@pytest.mark.unit
@pytest.mark.parametrize("case", VECTORS["peer_table"], ids=lambda c: c["name"])
def test_nccl_setup_of_every_rank_matches_the_vectors(rl, case):
    plan = rl.load_plan(_env(case))
    w = case["world_size"]
    want = [_addr(h, p) for h, p in case["expect"]]
    for rank in range(w):
        s = rl.nccl_setup(plan, case["group"], rank, list(range(w)), w, env={})
        assert (s.listen_addr, s.next_addr) == (want[rank], want[(rank + 1) % w])
        assert s.group_index == case["group"]


@pytest.mark.unit
@pytest.mark.parametrize("case", [c for c in VECTORS["port_of"] if c["block_base"] + 1024 <= 65535],
                         ids=lambda c: c["name"])
def test_nccl_port_of_each_vector(rl, case):
    p = case["nproc_per_node"]
    plan = rl.load_plan({"TORCH_NCCL_GET_PORT_BASE": str(case["block_base"]), "N_PROC_PER_NODE": str(p),
                         "HPCT_PORT_SLOTS": str(case["slots"]), "TORCH_GLOO_GET_PORT_BASE": "1024"})
    rank = case["local_rank"]           # one node: global rank == local rank
    setup = rl.nccl_setup(plan, case["group"], rank, list(range(p)), p, env={})
    assert setup.listen_addr == f"127.0.0.1:{case['expect']}"


@pytest.mark.unit
def test_subgroup_uses_the_global_ranks_of_its_members(rl):
    plan = rl.load_plan({"HPCT_HOSTS": "10.0.0.1,10.0.0.2", "N_PROC_PER_NODE": "2"})
    # Members 1, 2, 3 of a 4-rank world, group index 3: NCCL block 12016, slot 3 -> 12022 + l.
    s = rl.nccl_setup(plan, 3, 2, [1, 2, 3], 4, env={})
    assert (s.listen_addr, s.next_addr) == ("10.0.0.2:12023", "10.0.0.1:12023")
    s0 = rl.nccl_setup(plan, 3, 0, [1, 2, 3], 4, env={})
    assert (s0.listen_addr, s0.next_addr) == ("10.0.0.1:12023", "10.0.0.2:12022")


@pytest.mark.unit
def test_the_nccl_and_gloo_ports_of_a_group_never_meet(rl):
    plan = rl.load_plan({"N_PROC_PER_NODE": "4", "HPCT_PORT_SLOTS": "4"})
    for g in range(8):
        gloo = {p for _, p in plan.gloo_peers(g, range(4), 4)}
        nccl = {int(rl.nccl_setup(plan, g, r, range(4), 4, env={}).listen_addr.rsplit(":", 1)[1])
                for r in range(4)}
        assert not gloo & nccl
        assert nccl <= set(plan.block("nccl"))


@pytest.mark.unit
def test_timeouts_and_retry_delay(rl):
    plan = rl.load_plan({"HPCT_CONNECT_TIMEOUT": "2.5", "NCCL_SOCKET_RETRY_DELAY": "250"})
    s = rl.nccl_setup(plan, 0, 0, [0], 1, env={})
    assert (s.connect_timeout_ms, s.retry_delay_ms) == (2500, 250)
    s = rl.nccl_setup(rl.load_plan({"HPCT_CONNECT_TIMEOUT": "86400"}), 0, 0, [0], 1, env={})
    assert s.connect_timeout_ms == 86400000 and s.retry_delay_ms == 100
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.load_plan({"NCCL_SOCKET_RETRY_DELAY": "0"})
    _error_names(err.value, "NCCL_SOCKET_RETRY_DELAY")


# ------------------------------------------------------------ identity: job key and generation

@pytest.mark.unit
def test_job_key_is_the_same_on_every_rank_and_differs_between_jobs(rl):
    env = {"HPCT_HOSTS": "a,b", "N_PROC_PER_NODE": "2", "TORCHELASTIC_RUN_ID": "job-7"}
    keys = {rl.job_key(rl.load_plan({**env, "RANK": str(r), "LOCAL_RANK": str(r % 2)}),
                       {**env, "RANK": str(r)}) for r in range(4)}
    assert len(keys) == 1
    key = keys.pop()
    assert 0 <= key < 2 ** 64
    assert rl.job_key(rl.load_plan(env), {**env, "TORCHELASTIC_RUN_ID": "job-8"}) != key
    assert rl.job_key(rl.load_plan({**env, "HPCT_HOSTS": "a,c"}), env) != key
    assert rl.job_key(rl.load_plan({**env, "TORCH_NCCL_GET_PORT_BASE": "13000"}), env) != key


@pytest.mark.unit
def test_generation_enters_the_identity(rl):
    plan = rl.load_plan({})
    assert rl.nccl_setup(plan, 0, 0, [0], 1, env={}).generation == 0
    rl.advance_generation()                 # a world abort or destroy
    again = rl.nccl_setup(plan, 0, 0, [0], 1, env={})
    assert again.generation == 1
    assert again.listen_addr == "127.0.0.1:12008"      # the same port, a new identity


@pytest.mark.unit
def test_a_replacement_starts_at_hpct_generation(rl):
    assert rl.generation({"HPCT_GENERATION": "4"}) == 4
    assert rl.nccl_setup(rl.load_plan({}), 0, 0, [0], 1).generation == 4


# ------------------------------------------------------------ bad input

@pytest.mark.unit
@pytest.mark.parametrize("env", [
    {"TORCH_GLOO_GET_PORT_BASE": "12000", "TORCH_NCCL_GET_PORT_BASE": "12007"},
    {"TORCH_GLOO_GET_PORT_BASE": "12004", "TORCH_NCCL_GET_PORT_BASE": "12000"},
    {"HPCT_PORT_BASE": "15000", "N_PROC_PER_NODE": "4", "TORCH_NCCL_GET_PORT_BASE": "15031"},
], ids=["nccl-inside-gloo", "gloo-inside-nccl", "last-gloo-port"])
def test_nccl_block_overlapping_the_gloo_block(rl, env):
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.load_plan(env)
    _error_names(err.value, "TORCH_NCCL_GET_PORT_BASE", "overlaps", "gloo block")


@pytest.mark.unit
def test_nccl_block_crossing_the_ephemeral_floor(rl):
    plan = rl.load_plan({"TORCH_NCCL_GET_PORT_BASE": "19996"})      # 19996-20003
    rl.check_ephemeral_range(plan, (20000, 65535), set())             # the Gloo block is fine
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.check_ephemeral_range(plan, (20000, 65535), set(), backend="nccl")
    _error_names(err.value, "TORCH_NCCL_GET_PORT_BASE", "nccl port block 19996-20003", "ip_local_port_range")
    rl.check_ephemeral_range(plan, (20000, 65535), set(range(20000, 20004)), backend="nccl")


@pytest.mark.unit
def test_libnccl_without_the_rootless_call(rl):
    path = "/opt/x/nvidia/nccl/lib/libnccl.so.2"
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.check_nccl_library(lambda: (path, f"{path} has no ncclCommInitRankRootless",
                                       "install hpct's NCCL wheel"))
    _error_names(err.value, path, "ncclCommInitRankRootless", "hpct's NCCL wheel")
    assert rl.check_nccl_library(lambda: ("/hpct/libnccl.so.2", "", "")) == "/hpct/libnccl.so.2"


@pytest.mark.unit
def test_local_synchronization_group_without_a_slot(rl):
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.take_local_sync_index("5b3c9e")
    _error_names(err.value, "use_local_synchronization", "group_index(N)")
    assert not rl.is_local_sync_group("5b3c9e")
    with rl.group_index(40):
        assert rl.take_local_sync_index("5b3c9e") == 40
    assert rl.is_local_sync_group("5b3c9e")         # it forms on slot 40 mod S, never by split
    assert not rl.is_local_sync_group("2")
    s = rl.nccl_setup(rl.load_plan({}), rl.index_of_group("5b3c9e"), 0, [0], 1, env={})
    assert s.listen_addr == "127.0.0.1:12008"       # slot 40 mod 8 = 0


@pytest.mark.unit
def test_nccl_has_a_rootless_path_other_backends_not(rl):
    rl.check_backends({"cuda": "nccl"})
    rl.check_backends({"cpu": "gloo", "cuda": "nccl"})
    assert rl.uses_nccl({"cpu": "gloo", "cuda": "nccl"}) and not rl.uses_nccl({"cpu": "gloo"})
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.check_backends({"cpu": "mpi"})
    _error_names(err.value, "mpi for cpu", "only gloo and nccl", "HPCT_USE_ROOTLESS")


@pytest.mark.unit
def test_group_rank_outside_the_group(rl):
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.nccl_setup(rl.load_plan({"N_PROC_PER_NODE": "2"}), 0, 2, [0, 1], 2, env={})
    _error_names(err.value, "group rank 2")


# ------------------------------------------------------------ headers for C++ (cached, atomic)

def _layout():
    from hpct.builder.layout import Layout
    return Layout(REPO)


def stock_nccl() -> Path:
    """lib/libnccl.so.2 and include/nccl.h of the real nvidia-nccl-cu12==2.21.5 wheel."""
    dest = CACHE / f"nvidia-nccl-cu12-{NCCL_PIN}"
    if (dest / "lib" / "libnccl.so.2").is_file() and (dest / "include" / "nccl.h").is_file():
        return dest
    import tempfile
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpct"
    wheels = sorted(cache.glob(f"nvidia_nccl_cu12-{NCCL_PIN}-*.whl"))
    if not wheels:
        pytest.fail(f"no nvidia_nccl_cu12-{NCCL_PIN} wheel in {cache}; fix: bash ci/setup.sh (it downloads it)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nccl-wheel-", dir=dest.parent) as tmp:
        out = Path(tmp) / "out"
        with zipfile.ZipFile(wheels[0]) as z:
            for name, sub in (("nvidia/nccl/lib/libnccl.so.2", "lib"), ("nvidia/nccl/include/nccl.h", "include"),
                              ("nvidia/nccl/include/nccl_net.h", "include")):
                (out / sub).mkdir(parents=True, exist_ok=True)
                (out / sub / Path(name).name).write_bytes(z.read(name))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(out, dest)
    return dest


def rootless_header(dest: Path) -> Path:
    """hpct's nccl_rootless.h, as the NCCL series adds it."""
    from hpct.builder.patches import extract_new_file
    from hpct.builder.sources import load_manifest
    layout = _layout()
    return extract_new_file(layout, load_manifest(layout, "nccl"), "src/include/nccl_rootless.h", dest).parent


def cuda_includes() -> list[Path]:
    """CUDA 12.4 headers from PyPI wheels (hpct.builder.cuda), plus the math libraries' headers."""
    from hpct.builder import cuda
    from hpct.builder.progress import Progress
    layout, progress = _layout(), Progress()
    return [cuda.cuda_headers(layout, CUDA, progress), cuda.cuda_math_headers(layout, CUDA, progress)]


# ------------------------------------------------------------ the run-time lookup, against real libraries

PROBE_MAIN = r"""// Calls NCCLRootless.hpp as NCCLComm::createRootless does, and prints the outcome.
#include <torch/csrc/distributed/c10d/NCCLRootless.hpp>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  using namespace c10d::hpct_rootless;
  const Probe& p = probe();
  printf("library=%s\nproblem=%s\nfix=%s\n", p.library.c_str(), p.problem.c_str(), p.fix.c_str());
  if (argc < 10) return 0;
  Spec s;
  s.listenAddr = argv[1];
  s.nextAddr = argv[2];
  s.jobKey = strtoull(argv[3], nullptr, 10);
  s.generation = static_cast<uint32_t>(strtoul(argv[4], nullptr, 10));
  s.groupIndex = static_cast<uint32_t>(strtoul(argv[5], nullptr, 10));
  s.connectTimeoutMs = atoi(argv[6]);
  s.retryDelayMs = atoi(argv[7]);
  ncclComm_t comm = nullptr;
  ncclUniqueId id{};
  std::string error;
  ncclResult_t r = initRank(&comm, atoi(argv[8]), atoi(argv[9]), s, nullptr, &id, &error);
  printf("result=%d\ncomm=%s\nid=%.16s\nerror=%s\n", static_cast<int>(r), comm ? "set" : "null",
         id.internal, error.c_str());
  return 0;
}
"""

# A stand-in for hpct's NCCL at the library boundary: the real entry points' signatures
# (from nccl.h and nccl_rootless.h); it records what it is given and, like a peer of
# another generation at the ring handshake, refuses a generation other than the one in
# FAKE_NCCL_PEER_GENERATION.
FAKE_NCCL = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "nccl_rootless.h"

static char lastError[256];
static int fakeComm;

ncclResult_t ncclGetVersion(int* v) { *v = 22105; return ncclSuccess; }
const char* ncclGetErrorString(ncclResult_t r) { return r == ncclRemoteError ? "remote process exited or there was a network error" : "other error"; }
const char* ncclGetLastError(ncclComm_t comm) { (void)comm; return lastError; }

ncclResult_t ncclRootlessUniqueId(const ncclRootlessInfo_t* info, int nranks, ncclUniqueId* id) {
  memset(id, 0, sizeof(*id));
  snprintf(id->internal, sizeof(id->internal), "gen%u-grp%u-n%d", info->generation, info->groupIndex, nranks);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankRootless(ncclComm_t* comm, int nranks, int rank, const ncclRootlessInfo_t* info,
                                      ncclConfig_t* config) {
  FILE* f = fopen(getenv("FAKE_NCCL_RECORD"), "w");
  fprintf(f, "{\"size\": %zu, \"listen\": \"%s\", \"next\": \"%s\", \"job_key\": %llu, \"generation\": %u, "
          "\"group\": %u, \"connect_timeout_ms\": %d, \"retry_delay_ms\": %d, \"nranks\": %d, \"rank\": %d, "
          "\"config\": %s}\n", info->size, info->listenAddr, info->nextAddr, (unsigned long long)info->jobKey,
          info->generation, info->groupIndex, info->connectTimeoutMs, info->retryDelayMs, nranks, rank,
          config ? "true" : "false");
  fclose(f);
  const char* peer = getenv("FAKE_NCCL_PEER_GENERATION");
  if (peer && (unsigned)atoi(peer) != info->generation) {
    snprintf(lastError, sizeof(lastError), "%s refused the handshake: generation %u, expected %s",
             info->nextAddr, info->generation, peer);
    return ncclRemoteError;
  }
  *comm = (ncclComm_t)&fakeComm;
  return ncclSuccess;
}
"""


@pytest.fixture(scope="session")
def probe_env(patched_tree, tmp_path_factory):
    for tool in ("g++", "gcc"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed; fix: apt-get install g++ (ci/setup.sh does)")
    work = tmp_path_factory.mktemp("nccl-probe")
    nccl = stock_nccl()
    rl_inc = rootless_header(work / "rootless-include")
    cuda_inc = cuda_includes()[0]
    (work / "probe.cpp").write_text(PROBE_MAIN)
    (work / "fake").mkdir()
    (work / "fake" / "fake_nccl.c").write_text(FAKE_NCCL)
    inc = ["-I", str(patched_tree), "-I", str(nccl / "include"), "-I", str(rl_inc), "-I", str(cuda_inc)]

    def build(lib_dir: Path, *extra: str) -> Path:
        exe = work / f"probe-{lib_dir.parent.parent.name}-{lib_dir.parent.name}"
        proc = subprocess.run(["g++", "-std=c++17", "-fPIE", "-pie", "-Wall", "-Werror", *inc,
                               str(work / "probe.cpp"), "-o", str(exe), "-L", str(lib_dir), "-l:libnccl.so.2",
                               "-ldl", f"-Wl,-rpath,{lib_dir}", *extra], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return exe

    fake_lib = work / "fake" / "lib"
    fake_lib.mkdir()
    proc = subprocess.run(["gcc", "-shared", "-fPIC", "-Wall", "-Werror", "-Wl,-soname,libnccl.so.2",
                           "-I", str(nccl / "include"), "-I", str(rl_inc), "-I", str(cuda_inc),
                           str(work / "fake" / "fake_nccl.c"), "-o", str(fake_lib / "libnccl.so.2")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"stock": (build(nccl / "lib"), nccl / "lib" / "libnccl.so.2"),
            "rootless": (build(fake_lib), fake_lib / "libnccl.so.2"), "work": work, "build": build}


def _run_probe(exe: Path, *args: str, env: dict | None = None) -> dict:
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out, key = {}, None
    for line in proc.stdout.splitlines():
        m = re.match(r"^(library|problem|fix|result|comm|id|error)=(.*)$", line)
        if m:
            key = m.group(1)
            out[key] = m.group(2)
        elif key:
            out[key] += "\n" + line
    return out


@pytest.mark.slow
def test_stock_libnccl_is_named_with_the_fix(probe_env):
    """HPCT_USE_ROOTLESS=1 on the real nvidia-nccl-cu12 2.21.5 library: refused with its path."""
    exe, lib = probe_env["stock"]
    out = _run_probe(exe)
    assert os.path.realpath(out["library"]) == os.path.realpath(lib)
    assert "has no ncclCommInitRankRootless" in out["problem"] and "NCCL 2.21.5" in out["problem"]
    assert "install hpct's NCCL wheel" in out["fix"] and str(lib) in out["fix"]
    assert "unset HPCT_USE_ROOTLESS" in out["fix"]
    # Asked to form a communicator anyway, it fails at once with that message, NCCL untouched.
    started = time.monotonic()
    out = _run_probe(exe, "127.0.0.1:12008", "127.0.0.1:12009", "1", "0", "0", "5000", "100", "2", "0")
    assert time.monotonic() - started < 10
    assert int(out["result"]) != 0 and out["comm"] == "null"
    assert out["error"].startswith("HPCT_USE_ROOTLESS=1: ") and "\n  fix: install hpct's NCCL wheel" in out["error"]


@pytest.mark.slow
def test_rootless_libnccl_gets_what_the_plan_says(probe_env, rl, tmp_path):
    """C++ passes NCCL exactly the addresses and identity the Python plan computes."""
    exe, lib = probe_env["rootless"]
    env = {"HPCT_HOSTS": "10.0.0.1,fd00::2", "N_PROC_PER_NODE": "2", "HPCT_PORT_SLOTS": "4",
           "HPCT_CONNECT_TIMEOUT": "7.5", "NCCL_SOCKET_RETRY_DELAY": "40", "TORCHELASTIC_RUN_ID": "r1"}
    rl.set_generation(3)
    plan = rl.load_plan(env)
    s = rl.nccl_setup(plan, 6, 1, [0, 2, 3], 4, env=env)     # group index 6 -> slot 2: 12008 + 2*2 + l
    assert (s.listen_addr, s.next_addr) == ("[fd00::2]:12012", "[fd00::2]:12013")
    record = tmp_path / "record.json"
    out = _run_probe(exe, s.listen_addr, s.next_addr, str(s.job_key), str(s.generation), str(s.group_index),
                     str(s.connect_timeout_ms), str(s.retry_delay_ms), "3", "1",
                     env={"FAKE_NCCL_RECORD": str(record)})
    assert out["problem"] == "" and os.path.realpath(out["library"]) == os.path.realpath(lib)
    assert (out["result"], out["comm"], out["error"]) == ("0", "set", "")
    assert out["id"] == "gen3-grp6-n3"                  # the identity bytes were asked for
    got = json.loads(record.read_text())
    assert got == {"size": got["size"], "listen": "[fd00::2]:12012", "next": "[fd00::2]:12013",
                   "job_key": s.job_key, "generation": 3, "group": 6, "connect_timeout_ms": 7500,
                   "retry_delay_ms": 40, "nranks": 3, "rank": 1, "config": False}
    assert got["size"] == 48                            # sizeof(ncclRootlessInfo_t) on x86_64


@pytest.mark.slow
def test_replacement_with_the_old_generation_is_refused_with_the_fix(probe_env, rl, tmp_path):
    """A rank at generation 1 whose ring neighbour is at 2: the failure names both and the fix."""
    exe, _ = probe_env["rootless"]
    rl.set_generation(1)                                # a replacement started without HPCT_GENERATION=2
    s = rl.nccl_setup(rl.load_plan({"N_PROC_PER_NODE": "2"}), 0, 1, [0, 1], 2, env={})
    out = _run_probe(exe, s.listen_addr, s.next_addr, str(s.job_key), str(s.generation), "0",
                     str(s.connect_timeout_ms), str(s.retry_delay_ms), "2", "1",
                     env={"FAKE_NCCL_RECORD": str(tmp_path / "r.json"), "FAKE_NCCL_PEER_GENERATION": "2"})
    assert out["result"] != "0" and out["comm"] == "null"
    err = out["error"]
    assert "rank 1 of 2" in err and "generation 1" in err and "127.0.0.1:12017" in err and "127.0.0.1:12016" in err
    assert "refused the handshake: generation 1, expected 2" in err
    assert "\n  fix: " in err and "HPCT_GENERATION" in err and "same generation" in err


@pytest.mark.slow
def test_hpct_libnccl_has_the_rootless_entry_point(probe_env):
    """With `hpct-build build nccl` done here: the lookup finds the call in hpct's real libnccl.
    The build is the slow tier's (tests/nccl_prebuild.py), waited for under its lock when another
    worker is making it, so the order the tests run in does not decide whether this runs."""
    import nccl_prebuild
    lib = nccl_prebuild.ensure_built(NCCL_PIN) / "lib" / "libnccl.so.2"
    from hpct.builder import cuda
    from hpct.builder.progress import Progress
    pkg, ver, sha = next(w for w in cuda.pins(CUDA)["wheels"] if w[0] == "nvidia-cuda-runtime-cu12")
    cudart = probe_env["work"] / "cudart"
    cuda._unpack(cuda._wheel(_layout(), CUDA, pkg, ver, sha, Progress()), "cuda_runtime/lib", cudart)
    exe = probe_env["build"](lib.parent, f"-Wl,-rpath-link,{cudart}")
    out = _run_probe(exe, env={"LD_LIBRARY_PATH": str(cudart)})
    assert os.path.realpath(out["library"]) == os.path.realpath(lib)
    assert out["problem"] == "" and out["fix"] == ""


# ------------------------------------------------------------ every changed unit compiles, with NCCL on

def _nccl_compile_flags(overlay: Path, rl_inc: Path | None, nccl_inc: Path, cuda_inc: list[Path]) -> list[str]:
    inc = TORCH_INCLUDE / "torch" / "include"
    flags = ["-fsyntax-only", "-std=c++17", "-fPIC", "-w", *NCCL_DEFINES, "-I", str(overlay), "-I", str(inc),
             "-I", str(inc / "torch" / "csrc" / "api" / "include"), "-I", str(nccl_inc)]
    if rl_inc is not None:
        flags += ["-I", str(rl_inc)]
    for d in cuda_inc:
        flags += ["-I", str(d)]
    flags += ["-I", str(GLOO_PATCHED), "-I", str(GLOO_CONFIG), "-I", sysconfig.get_paths()["include"],
              "-idirafter", str(PRISTINE), "-idirafter", str(TORCH_INCLUDE / "extra")]
    return flags


@pytest.fixture(scope="session")
def nccl_compile(compile_env, tmp_path_factory):
    """(flags, overlay) for the NCCL compiles: compile_env's overlay of the changed headers."""
    rl_inc = rootless_header(tmp_path_factory.mktemp("rootless-include"))
    return {"overlay": compile_env, "rl": rl_inc, "nccl": stock_nccl() / "include", "cuda": cuda_includes()}


def _compile(tree: Path, unit: str, flags: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["g++", *flags, unit], cwd=tree, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_nccl_units_are_the_changed_ones():
    units = [f for f in changed_files() if f.endswith((".cpp", ".cc"))]
    assert set(NCCL_UNITS) <= set(units)


@pytest.mark.slow
@pytest.mark.parametrize("unit", [f"{C10D}/init.cpp"])   # the others: built for real (test_patched_torch.py)
def test_changed_unit_compiles_with_nccl(nccl_compile, patched_tree, unit):
    c = nccl_compile
    flags = _nccl_compile_flags(c["overlay"], c["rl"], c["nccl"], c["cuda"])
    started = time.monotonic()
    proc = _compile(patched_tree, unit, flags + ["-H"])
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, f"{unit} does not compile:\n{proc.stderr[-6000:]}"
    # -H lists every header opened: hpct's rootless header and the wheel's stock nccl.h were used.
    opened = [ln.lstrip(". ") for ln in proc.stderr.splitlines() if ln.startswith(".")]
    assert str(c["rl"] / "nccl_rootless.h") in opened, "nccl_rootless.h was not included"
    assert str(c["nccl"] / "nccl.h") in opened
    print(f"{unit}: compiled with NCCL in {elapsed:.1f} s")


@pytest.mark.slow
def test_control_the_patched_unit_fails_against_the_stock_headers(nccl_compile, patched_tree, tmp_path):
    """The patched ProcessGroupNCCL.cpp against the pristine NCCLUtils.hpp/ProcessGroupNCCL.hpp fails."""
    c = nccl_compile
    overlay = tmp_path / "overlay"
    shutil.copytree(c["overlay"], overlay)
    for name in ("NCCLUtils.hpp", "ProcessGroupNCCL.hpp"):
        shutil.copy2(PRISTINE / C10D / name, overlay / C10D / name)
    proc = _compile(patched_tree, f"{C10D}/ProcessGroupNCCL.cpp",
                    _nccl_compile_flags(overlay, c["rl"], c["nccl"], c["cuda"]))
    assert proc.returncode != 0
    assert re.search(r"Options.* has no member named .rootless.", proc.stderr), proc.stderr[-3000:]
    for name in ("initRootlessNCCLComm", "abortWithinBound"):
        assert name in proc.stderr, f"{name} not in the errors:\n{proc.stderr[-3000:]}"


@pytest.mark.slow
def test_without_the_rootless_header_the_unit_still_compiles(nccl_compile, patched_tree):
    """A torch built on another NCCL (no nccl_rootless.h) keeps compiling; the rootless path reports it."""
    c = nccl_compile
    proc = _compile(patched_tree, f"{C10D}/NCCLUtils.cpp",
                    _nccl_compile_flags(c["overlay"], None, c["nccl"], c["cuda"]) + ["-H"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "nccl_rootless.h" not in proc.stderr
    header = (patched_tree / C10D / "NCCLRootless.hpp").read_text()
    assert "built without hpct's nccl_rootless.h" in header
