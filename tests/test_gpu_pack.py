"""The GPU proof's CPU side (issue 27, items 10 and 11): the settings both stacks run under, the
device preflight, and the pack's size accounting.  No GPU, no NCCL build: the pack is made of
small files here; ci/gpu.sh --pack builds the real one (docs/gpu-proof.md)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from util import REPO

pytestmark = pytest.mark.unit

sys.path.insert(0, str(REPO / "tests" / "gpu"))
sys.path.insert(0, str(REPO / "ci"))
import proof_settings as ps  # noqa: E402  (tests/gpu and ci/ are folders of scripts, not packages)
import gpu_device  # noqa: E402
import gpu_pack  # noqa: E402
import gpu_packfmt  # noqa: E402

torch = pytest.importorskip("torch")
KIB = 1024


# ---------------------------------------------------------------------------- the proof's settings
def fake_lib(tmp_path: Path) -> Path:
    lib = tmp_path / "nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF not really")
    return lib


def test_both_stacks_get_the_packs_libnccl_preloaded_and_one_reduction_order(tmp_path):
    lib = fake_lib(tmp_path)
    env = ps.proof_env(lib, "/opt/torch/nvidia/cu13/lib",
                       base={"LD_PRELOAD": "/usr/lib/libfoo.so", "LD_LIBRARY_PATH": "/a:/b"})
    assert env["LD_PRELOAD"].split(":") == [str(lib), "/usr/lib/libfoo.so"]   # ours first, theirs kept
    assert env["HPCT_NCCL_LIBRARY"] == str(lib)                              # hpct: the same file
    assert env["LD_LIBRARY_PATH"].split(":") == ["/opt/torch/nvidia/cu13/lib", "/a", "/b"]
    assert {k: env[k] for k in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")} == \
        {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": "1", "NCCL_MAX_NCHANNELS": "1"}
    assert "LD_LIBRARY_PATH" not in ps.proof_env(lib, None, base={})
    assert "PYTHONPATH" not in ps.proof_env(lib, None, base={})


def test_torchs_own_nccl_preload_finds_the_packs_file_first(tmp_path):
    """torch's __init__ opens nvidia/nccl/lib/libnccl.so.* from the first sys.path entry that has
    one; the overlay, first on PYTHONPATH, points there at the pack's file (one copy mapped)."""
    lib = fake_lib(tmp_path)
    root = ps.torch_overlay(lib, tmp_path / "overlay")
    assert ps.torch_overlay(lib, root) == root                                # idempotent
    place = root / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    assert place.resolve() == lib.resolve() and place.read_bytes() == lib.read_bytes()
    assert not (root / "nvidia" / "__init__.py").exists()     # `import nvidia` still finds the wheels'
    assert [p.name for p in place.parent.iterdir()] == ["libnccl.so.2"]      # no temporary left
    env = ps.proof_env(lib, None, base={"PYTHONPATH": "/site"}, overlay=root)
    assert env["PYTHONPATH"].split(":") == [str(root), "/site"]


def test_the_settings_refuse_a_library_that_is_not_there(tmp_path):
    with pytest.raises(ps.ProofSettingsError, match="not an existing absolute path.*ci/gpu.sh"):
        ps.proof_env(tmp_path / "missing.so.2")
    with pytest.raises(ps.ProofSettingsError, match="not an existing absolute path"):
        ps.proof_env("nccl/lib/libnccl.so.2")
    with pytest.raises(ps.ProofSettingsError, match=f"{ps.LIBNCCL_VAR} is unset.*ci/gpu.sh"):
        ps.from_environ({})


def test_the_runner_hands_the_tests_the_packs_library(tmp_path):
    """What ci/gpu_device.py sets for the test process is what proof_settings turns into the
    ranks' LD_PRELOAD: the unpacked pack's libnccl, torch's libcudart folder."""
    work = tmp_path / "run"
    lib = fake_lib(work / "files")
    manifest = {"libnccl": "nccl/lib/libnccl.so.2"}
    facts = {"cudart": ["/opt/torch/site-packages/nvidia/cu13/lib/libcudart.so.13"]}
    env = gpu_device.proof_environ(work, manifest, facts, tmp_path / "report")
    ranks = ps.from_environ(env)
    assert ranks["LD_PRELOAD"].split(":")[0] == str(lib.resolve()) == ranks["HPCT_NCCL_LIBRARY"]
    assert ranks["LD_LIBRARY_PATH"].split(":")[0] == "/opt/torch/site-packages/nvidia/cu13/lib"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(work / "site")
    overlay = work / "torch-overlay"
    assert ranks["PYTHONPATH"].split(os.pathsep)[:2] == [str(overlay), str(work / "site")]
    assert (overlay / "nvidia" / "nccl" / "lib" / "libnccl.so.2").resolve() == lib.resolve()


def test_mapped_libnccl_reads_every_mapping():
    maps = ("7f00-7f01 r-xp 00000000 08:01 12 /pack/nccl/lib/libnccl.so.2\n"
            "7f01-7f02 r--p 00001000 08:01 12 /pack/nccl/lib/libnccl.so.2\n"
            "7f03-7f04 r-xp 00000000 08:01 13 /venv/nvidia/nccl/lib/libnccl.so.2 (deleted)\n"
            "7f05-7f06 rw-p 00000000 00:00 0 \n")
    assert ps.mapped_libnccl(maps) == ["/pack/nccl/lib/libnccl.so.2", "/venv/nvidia/nccl/lib/libnccl.so.2"]
    assert ps.mapped_libnccl(maps.splitlines()[0]) == ["/pack/nccl/lib/libnccl.so.2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_inputs_are_integer_valued_and_every_sum_is_exact(dtype, n):
    inputs = [ps.proof_input(r, n, dtype, 4096) for r in range(n)]
    assert all(t.dtype == dtype for t in inputs)
    assert inputs[0].abs().max() > ps.input_bound(dtype, n) // 2       # the range is used, not zeros
    assert not torch.equal(inputs[0], inputs[1 % n]) or n == 1
    assert ps.exact_in(inputs, dtype)
    wide = torch.stack([t.to(torch.float64) for t in inputs])
    assert torch.equal(wide, wide.round())                               # integer valued
    exact = wide.sum(0)
    # Summed in the dtype itself, in the orders a ring may use: every one equals the exact sum.
    for order in (list(range(n)), list(reversed(range(n))), [(i + 1) % n for i in range(n)]):
        acc = inputs[order[0]].clone()
        for i in order[1:]:
            acc = acc + inputs[i]
        assert torch.equal(acc.to(torch.float64), exact)
    if dtype.is_floating_point and ps.avg_is_exact(n):                   # AVG as NCCL does it: x/n, then sum
        acc = sum(t / n for t in inputs)
        assert torch.equal(acc.to(torch.float64), exact / n)
        assert torch.equal(ps.expected_reduce("AVG", inputs, dtype), acc)


def test_the_exactness_check_catches_inputs_that_are_too_large():
    """Over the bound in bf16 (8 bits): 255 is exact, 3 x 255 = 765 is not, and exact_in says so."""
    assert ps.input_bound(torch.bfloat16, 4) == 64 and ps.input_bound(torch.float16, 2) == 1024
    inputs = [torch.full((8,), 255.0, dtype=torch.bfloat16) for _ in range(3)]
    assert not ps.exact_in(inputs, torch.bfloat16)
    acc = inputs[0] + inputs[1] + inputs[2]
    assert acc.to(torch.float64)[0].item() != 765                        # the dtype really rounds there
    halves = [torch.full((4,), 0.5, dtype=torch.float16) for _ in range(2)]
    assert not ps.exact_in(halves, torch.float16)                         # not integer valued


def test_expected_values_of_each_reduction():
    inputs = [torch.tensor([1, -4, 7], dtype=torch.float16), torch.tensor([3, 2, -7], dtype=torch.float16)]
    assert ps.expected_reduce("SUM", inputs, torch.float16).tolist() == [4, -2, 0]
    assert ps.expected_reduce("MAX", inputs, torch.float16).tolist() == [3, 2, 7]
    assert ps.expected_reduce("MIN", inputs, torch.float16).tolist() == [1, -4, -7]
    assert ps.expected_reduce("AVG", inputs, torch.float16).tolist() == [2, -1, 0]
    with pytest.raises(ps.ProofSettingsError, match="1/3 is not a power of two"):
        ps.expected_reduce("AVG", inputs + inputs[:1], torch.float16)
    assert ps.chunk(torch.arange(8), 4, 2).tolist() == [4, 5]


def test_the_proof_functions_are_ring_simple_only_and_hpct_build_accepts_them():
    from hpct.builder.nccl import check_funcs
    assert check_funcs(ps.PROOF_FUNCS) == ps.PROOF_FUNCS
    # NCCL's generator (src/device/generate.py) matches "<coll> <redop> <type> <algo> <proto>"
    # against the spec with '*' as [^ ]* and '$' appended; emulated here.
    pattern = ps.PROOF_FUNCS.replace("*", "[^ ]*") + "$"

    def built(fn: str) -> bool:
        return re.match(pattern, fn, flags=re.IGNORECASE) is not None
    for fn in ("AllReduce Sum f32 RING SIMPLE", "AllReduce MinMax bf16 RING SIMPLE", "AllReduce PreMulSum f16 RING SIMPLE",
               "AllReduce Sum i64 RING SIMPLE", "AllReduce Sum u64 RING SIMPLE", "AllReduce Sum i32 RING SIMPLE",
               "ReduceScatter Sum f32 RING SIMPLE", "Reduce Sum i64 RING SIMPLE", "AllGather RING SIMPLE",
               "Broadcast RING SIMPLE", "SendRecv"):
        assert built(fn), fn
    for fn in ("AllReduce Sum f32 RING LL", "AllReduce Sum f32 TREE SIMPLE", "AllReduce Sum f32 NVLS SIMPLE",
               "AllGather PAT SIMPLE", "AllReduce Sum f8e4m3 RING SIMPLE", "AllGatherV RING SIMPLE"):
        assert not built(fn), fn


# ---------------------------------------------------------------------------- the device preflight
GOOD = {"python": [3, 12, 3], "executable": "/opt/torch/.venv/bin/python3", "torch": "2.11.0+cu130",
        "torch_cuda": "13.0", "nccl_backend": True, "cuda_available": True, "device_count": 1,
        "capability": [9, 0], "device_name": "NVIDIA H100 80GB HBM3", "driver": "580.159.04",
        "cudart": ["/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13"],
        "modules": {"pytest": True}}


def problems(**changes):
    facts = {**GOOD, **changes}
    return [f"{p.what}: {p.detail}" for p in gpu_device.check(facts, gpu_device.TARGET, "python3")]


def test_the_preflight_passes_the_device_it_is_written_for():
    assert problems() == []


@pytest.mark.parametrize("changes, expect", [
    ({"python": [3, 11, 7]}, r"python: Python 3\.11\.7 .*for CPython 3\.12 \(cp312\)"),
    ({"torch": "2.13.0+cu130"}, r"torch: torch 2\.13\.0\+cu130; the proof needs torch 2\.11\.x"),
    ({"torch": "2.11.0+cu128", "torch_cuda": "12.8"}, r"built for CUDA 12\.8; the pack's libnccl is built with CUDA 13\.0"),
    ({"torch": "2.11.0+cpu", "torch_cuda": None}, r"is a CPU build: no CUDA device can be used"),
    ({"driver": None}, r"driver: no NVIDIA driver"),
    ({"driver": "570.86.10"}, r"NVIDIA driver 570\.86\.10; CUDA 13\.0 needs 580"),
    ({"cuda_available": False, "device_count": 0}, r"device: no CUDA device is visible"),
    ({"capability": [8, 0], "device_name": "NVIDIA A100"}, r"device 0 is NVIDIA A100 \(sm_80\); .*sm_90 code only"),
    ({"cudart": []}, r"no libcudart\.so\.13"),
    ({"nccl_backend": False}, r"has no NCCL backend"),
])
def test_the_preflight_names_each_wrong_part_of_the_toolchain(changes, expect):
    found = problems(**changes)
    assert len(found) == 1 and re.search(expect, found[0]), found


def test_a_torch_that_does_not_import_is_named():
    facts = {k: v for k, v in GOOD.items() if not k.startswith(("torch", "cuda", "device", "capability", "nccl"))}
    found = [str(p) for p in gpu_device.check({**facts, "torch_error": "ImportError: libcudnn.so.9"},
                                              gpu_device.TARGET, "python3")]
    assert len(found) == 1 and "torch is not importable (ImportError: libcudnn.so.9)" in found[0]


def test_gpu_sh_preflight_refuses_on_this_machine_with_every_reason(tmp_path):
    """The real probe on this CPU machine: no driver, no device, no pack; exit 3, one list."""
    if shutil.which("nvidia-smi") or Path("/proc/driver/nvidia/version").exists():
        pytest.skip("this machine has an NVIDIA driver: ci/gpu.sh is for the device")
    # --mps: the MPS control program is named too (a PATH without CUDA's bin, where it lives)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not shutil.which(
        gpu_device.MPS_CONTROL, path=p))
    done = subprocess.run(["bash", str(REPO / "ci" / "gpu.sh"), "--preflight", "--mps", "--from",
                           str(tmp_path / "nopack")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable, "PATH": path})
    assert done.returncode == gpu_device.EXIT_PREFLIGHT, done.stderr
    err = done.stderr
    assert "mps: --mps: nvidia-cuda-mps-control is not on PATH" in err and "leave --mps out" in err
    assert "the preflight refused" in err and "no NVIDIA driver" in err
    assert f"no pack at {tmp_path / 'nopack'}" in err and "ci/gpu.sh --pack" in err
    if not torch.cuda.is_available():
        assert ("is a CPU build: no CUDA device can be used" in err or "no CUDA device is visible" in err), err
    if sys.version_info[:2] != (3, 12):
        assert f"Python {sys.version_info[0]}.{sys.version_info[1]}" in err and "cp312" in err
    bad = subprocess.run(["bash", str(REPO / "ci" / "gpu.sh"), "--phase"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--phase needs a value" in bad.stderr


def test_the_library_check_wants_one_libnccl_shared_by_both_stacks(tmp_path):
    lib = fake_lib(tmp_path)
    # torch_nccl is what torch was compiled against (2.28.9 on the device's torch 2.11): no verdict
    good = {"mapped": [str(lib)], "torch_nccl": [2, 28, 9], "runtime_nccl": [2, 30, 7], "hpct_path": str(lib),
            "hpct_how": "loaded by torch", "rootless": True}
    assert gpu_device.library_verdict(good, lib, "2.30.7") == []
    two = {**good, "mapped": [str(lib), "/venv/nvidia/nccl/lib/libnccl.so.2"], "runtime_nccl": [2, 28, 9]}
    wrong = gpu_device.library_verdict(two, lib, "2.30.7")
    assert len(wrong) == 2 and "expected only" in wrong[0] and "runs NCCL [2, 28, 9], expected 2.30.7" in wrong[1]
    assert "hpct could not load" in gpu_device.library_verdict({**good, "hpct_error": "x"}, lib, "2.30.7")[0]


# ---------------------------------------------------------------------------- the pack
@pytest.fixture
def small_allowance(monkeypatch):
    monkeypatch.setattr(gpu_packfmt, "MANIFEST_ALLOWANCE", 8 * KIB)


def blob(path: Path, size: int, compressible: bool = False, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (b"hpct gpu proof " * (size // 15 + 1))[:size] if compressible else random.Random(seed).randbytes(size)
    path.write_bytes(data)
    return path


def make_pack(tmp_path: Path, sizes: dict, *, limit: int, max_calls: int = 1, compressible=()) -> dict:
    sources = [gpu_packfmt.Source(name, blob(tmp_path / "in" / name, size, name in compressible, seed=i), "proof")
               for i, (name, size) in enumerate(sizes.items())]
    return gpu_packfmt.pack(sources, tmp_path / "pack", limit=limit, tree=10 * KIB, margin=6 * KIB,
                         max_calls=max_calls, meta={"target": gpu_device.TARGET, "libnccl": "x"},
                         work=tmp_path / "work")


def test_a_pack_over_the_limit_is_refused_naming_the_largest_files(tmp_path, small_allowance):
    with pytest.raises(gpu_packfmt.Refused) as err:
        make_pack(tmp_path, {"nccl/lib/libnccl.so.2": 300 * KIB, "wheels/hpct.whl": 90 * KIB, "proof/a.py": 5 * KIB},
                  limit=200 * KIB)
    problem, fix = err.value.args
    assert "more than 1 call(s) of 0.2 MiB each" in problem
    assert problem.index("nccl/lib/libnccl.so.2") < problem.index("wheels/hpct.whl")     # largest first
    assert "--funcs proof" in fix and "--max-calls 3" in fix
    assert not (tmp_path / "pack").exists()                                            # nothing half-written


def test_split_parts_reassemble_to_the_same_sha256(tmp_path, small_allowance):
    sizes = {"nccl/lib/libnccl.so.2": 300 * KIB, "wheels/hpct.whl": 90 * KIB, "proof/a.py": 5 * KIB}
    limit = 200 * KIB
    manifest = make_pack(tmp_path, sizes, limit=limit, max_calls=3)
    pack = tmp_path / "pack"
    budget = limit - 16 * KIB
    assert manifest["budget_bytes"] == budget and len(manifest["calls"]) >= 2
    lib = next(f for f in manifest["files"] if f["path"] == "nccl/lib/libnccl.so.2")
    assert len(lib["parts"]) == 2 and lib["codec"] == "none"                        # random bytes: stored as is
    for call in manifest["calls"]:
        folder = pack / f"call-{call['call']}"
        carried = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        assert carried <= budget and json.loads((folder / "manifest.json").read_text()) == manifest
    assert gpu_packfmt.verify_stored(pack, gpu_packfmt.load_manifest(pack)) == []
    out = tmp_path / "unpacked"
    for entry in manifest["files"]:
        got = gpu_packfmt.unpack_file(pack, entry, out)
        assert gpu_packfmt.sha256_of(got) == gpu_packfmt.sha256_of(tmp_path / "in" / entry["path"]) == entry["sha256"]
    # The device got only the first call's folder: the preflight says what to carry.
    for c in manifest["calls"][1:]:
        shutil.rmtree(pack / f"call-{c['call']}")
    (pack / "manifest.json").unlink()
    missing = gpu_packfmt.verify_stored(pack, gpu_packfmt.load_manifest(pack))
    assert missing and all("is missing" in p.detail and "carry" in p.fix for p in missing)


def test_compressible_files_are_stored_as_xz_and_come_back_bit_for_bit(tmp_path, small_allowance):
    manifest = make_pack(tmp_path, {"proof/worker.py": 64 * KIB, "wheels/hpct.whl": 64 * KIB},
                         limit=400 * KIB, compressible={"proof/worker.py"})
    by = {f["path"]: f for f in manifest["files"]}
    assert by["proof/worker.py"]["codec"] == "xz" and by["proof/worker.py"]["stored_size"] < 4 * KIB
    assert by["wheels/hpct.whl"]["codec"] == "none"
    assert manifest["total_stored_bytes"] == sum(f["stored_size"] for f in manifest["files"])
    assert manifest["total_bytes"] == 128 * KIB and len(manifest["calls"]) == 1
    for entry in manifest["files"]:
        got = gpu_packfmt.unpack_file(tmp_path / "pack", entry, tmp_path / "out")
        assert got.read_bytes() == (tmp_path / "in" / entry["path"]).read_bytes()


def test_a_damaged_pack_is_refused_by_sha256(tmp_path, small_allowance):
    make_pack(tmp_path, {"proof/a.py": 40 * KIB, "proof/b.py": 20 * KIB}, limit=400 * KIB, compressible={"proof/a.py"})
    pack = tmp_path / "pack"
    manifest = gpu_packfmt.load_manifest(pack)
    part = pack / manifest["files"][1]["parts"][0]["path"]
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    found, _ = gpu_device.check_pack(pack, {"modules": {"pytest": True}})[1], None
    assert len(found) == 1 and "sha256" in found[0].detail and str(part) in found[0].detail
    assert "build it again" in found[0].fix
    entry = manifest["files"][1]
    with pytest.raises(gpu_packfmt.Refused, match="the manifest says"):
        gpu_packfmt.unpack_file(pack, entry, tmp_path / "out")
    assert not (tmp_path / "out" / entry["path"]).exists()                           # nothing half-written


def test_a_pack_is_replaced_atomically_and_never_over_a_foreign_folder(tmp_path, small_allowance):
    first = make_pack(tmp_path, {"proof/a.py": 10 * KIB}, limit=400 * KIB)
    (tmp_path / "in" / "proof" / "a.py").write_bytes(b"changed")
    second = gpu_packfmt.pack([gpu_packfmt.Source("proof/a.py", tmp_path / "in" / "proof" / "a.py", "proof")],
                           tmp_path / "pack", limit=400 * KIB, tree=0, margin=0, max_calls=1,
                           meta={}, work=tmp_path / "w")
    assert first["pack_id"] != second["pack_id"] == gpu_packfmt.load_manifest(tmp_path / "pack")["pack_id"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []   # no staging left
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(gpu_packfmt.Refused, match="exists and is not a pack"):
        gpu_packfmt.pack([gpu_packfmt.Source("proof/a.py", tmp_path / "in" / "proof" / "a.py", "proof")], foreign,
                      limit=400 * KIB, tree=0, margin=0, max_calls=1, meta={}, work=tmp_path / "w")
    assert (foreign / "notes.txt").read_text() == "keep"


def test_the_tree_that_travels_counts_tracked_and_unignored_files(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True, timeout=60)
    (tmp_path / ".gitignore").write_text("/build/\n")
    (tmp_path / "a.py").write_bytes(b"x" * 1000)
    subprocess.run(git + ["add", "."], check=True, timeout=60)
    subprocess.run(git + ["commit", "-qm", "a"], check=True, timeout=60)
    (tmp_path / "new.txt").write_bytes(b"y" * 300)                    # untracked, not ignored: travels
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "big.bin").write_bytes(b"z" * 100000)       # ignored: only if carried
    assert gpu_pack.tree_bytes(tmp_path) == 1000 + 300 + len(".gitignore") + len("/build/\n") - len(".gitignore")


def test_nvcc_must_be_exactly_cuda_13_0(tmp_path):
    assert gpu_pack.nvcc_release("Cuda compilation tools, release 13.0, V13.0.88") == "13.0"
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    for release, ok in (("12.8", False), ("13.1", False), ("13.0", True)):
        nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
        nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
        if ok:
            assert gpu_pack.check_nvcc({"CUDA_HOME": str(tmp_path)})[0] == nvcc
        else:
            with pytest.raises(gpu_packfmt.Refused, match=f"is CUDA {release}, not exactly 13.0"):
                gpu_pack.check_nvcc({"CUDA_HOME": str(tmp_path)})
    with pytest.raises(gpu_packfmt.Refused, match="no nvcc at"):
        gpu_pack.check_nvcc({"CUDA_HOME": str(tmp_path / "nothing")})


def test_the_pack_refuses_missing_inputs(tmp_path):
    with pytest.raises(gpu_packfmt.Refused) as err:
        gpu_pack.check_source({}, tmp_path)
    assert "source is not handed over" in err.value.args[0] and "HPCT_NCCL_SOURCE=" in err.value.args[1]
    gpu_pack.check_source({"HPCT_NCCL_SOURCE": "/x/nccl-2.30.7-1.tar.gz"}, tmp_path)
    with pytest.raises(gpu_packfmt.Refused, match="no Python 3.12"):
        gpu_pack.check_python312(None, tmp_path)
    if sys.version_info[:2] != (3, 12):
        with pytest.raises(gpu_packfmt.Refused, match=r"not 3\.12"):
            gpu_pack.check_python312(sys.executable, tmp_path)
    done = subprocess.run(["bash", str(REPO / "ci" / "gpu.sh"), "--pack", str(tmp_path / "p"), "--max-calls", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == gpu_pack.EXIT_REFUSED and "--max-calls 0" in done.stderr
    assert not (tmp_path / "p").exists()


# ---------------------------------------------------------------------------- install on the device
def tiny_wheel(folder: Path, name: str = "hpct_probe") -> Path:
    """A real (minimal) wheel: one module, its dist-info."""
    folder.mkdir(parents=True, exist_ok=True)
    whl = folder / f"{name}-0.1-py3-none-any.whl"
    di = f"{name}-0.1.dist-info"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(f"{name}.py", "VALUE = 42\n")
        z.writestr(f"{di}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        z.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{di}/RECORD", f"{name}.py,,\n{di}/METADATA,,\n{di}/WHEEL,,\n{di}/RECORD,,\n")
    return whl


def test_install_unpacks_the_pack_and_installs_its_wheels_once(tmp_path, small_allowance):
    wheel = tiny_wheel(tmp_path / "in")
    lib = fake_lib(tmp_path / "in")
    sources = [gpu_packfmt.Source("nccl/lib/libnccl.so.2", lib, "libnccl", mode=0o755),
               gpu_packfmt.Source(f"wheels/{wheel.name}", wheel, "hpct-wheel"),
               gpu_packfmt.Source("wheels/skipped_probe-0.1-py3-none-any.whl",
                               tiny_wheel(tmp_path / "in2", "skipped_probe"), "test-wheel", "pytest")]
    manifest = gpu_packfmt.pack(sources, tmp_path / "pack", limit=400 * KIB, tree=0, margin=0, max_calls=1,
                             meta={"target": gpu_device.TARGET, "libnccl": "nccl/lib/libnccl.so.2"},
                             work=tmp_path / "w")
    lines = []
    work = gpu_device.install(tmp_path / "pack", manifest, tmp_path / "run", sys.executable,
                              {"modules": {"pytest": True}}, lines.append)
    assert (work / "site" / "hpct_probe.py").read_text() == "VALUE = 42\n"
    assert not (work / "site" / "skipped_probe.py").exists()          # this python has pytest already
    assert os.access(work / "files" / "nccl" / "lib" / "libnccl.so.2", os.X_OK)
    again = []
    gpu_device.install(tmp_path / "pack", manifest, tmp_path / "run", sys.executable, {}, again.append)
    assert again == [f"install: {work} already holds pack {manifest['pack_id']}"]


def test_a_manifest_larger_than_its_allowance_is_caught_before_the_pack_lands(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_packfmt, "MANIFEST_ALLOWANCE", 16)
    with pytest.raises(gpu_packfmt.Refused, match="over the budget .* manifest copy is larger"):
        make_pack(tmp_path, {"proof/a.py": 183 * KIB, "proof/b.py": 20 * KIB}, limit=200 * KIB, max_calls=2)
    assert not (tmp_path / "pack").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_the_runner_runs_the_packs_tests_and_stops_them_at_the_budget(tmp_path):
    proof = tmp_path / "run" / "files" / "proof"
    (proof / "tests" / "gpu").mkdir(parents=True)
    (proof / "pytest.ini").write_text(gpu_pack.PYTEST_INI)
    (proof / "tests" / "gpu" / "test_gpu_proof.py").write_text(
        "import time, pytest\n"
        "@pytest.mark.gpu\ndef test_fine():\n    pass\n"
        "@pytest.mark.gpu\ndef test_hangs():\n    time.sleep(600)\n")
    lines, logfile = [], tmp_path / "log.txt"
    env = {**os.environ, "PYTHONPATH": ""}
    t = "tests/gpu/test_gpu_proof.py::"
    assert gpu_device.run_tests(sys.executable, tmp_path / "run", env, [t + "test_fine"], lines.append, 120, logfile) == 0
    assert "1 passed" in logfile.read_text()
    import time
    t0 = time.monotonic()
    rc = gpu_device.run_tests(sys.executable, tmp_path / "run", env, [t + "test_hangs"], lines.append, 5, logfile)
    assert rc == 124 and time.monotonic() - t0 < 60 and "stopped" in lines[-1]


def test_reuse_takes_only_a_build_made_with_the_same_settings(tmp_path):
    install = tmp_path / "third_party" / "build" / "nccl-2.30.7" / "install"
    install.mkdir(parents=True)
    (install / "hpct-series.json").write_text(json.dumps({"funcs": ps.PROOF_FUNCS, "cuda": "13.0", "cuda_archs": ["90"]}))
    assert gpu_pack.built_nccl(tmp_path, ps.PROOF_FUNCS, "90") == (install, json.loads((install / "hpct-series.json").read_text()))
    assert gpu_pack.built_nccl(tmp_path, None, "90") is None                 # --funcs all asked, proof built
    assert gpu_pack.built_nccl(tmp_path, ps.PROOF_FUNCS, "100") is None
    (install / "hpct-series.json").write_text(json.dumps({"funcs": None, "cuda": "13.0", "cuda_archs": ["90"],
                                                          "series_id": "0123abcd"}))
    assert gpu_pack.built_nccl(tmp_path, None, "90", "0123abcd") is not None
    assert gpu_pack.built_nccl(tmp_path, None, "90", "fedc9876") is None     # another patch series: rebuild
    assert re.fullmatch(r"[0-9a-f]{16}", gpu_pack.series_id(REPO))
    assert gpu_pack.resolve_funcs("proof") == ps.PROOF_FUNCS and gpu_pack.resolve_funcs("all") is None


def test_mps_is_started_for_the_tests_and_stopped_after(tmp_path, monkeypatch):
    """--mps: the control daemon is started with its pipes under the run's folder (the tests
    inherit the variables) and told to quit at the end; a daemon that fails to start is reported."""
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / gpu_device.MPS_CONTROL
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat)" >> {calls}\n'
                    'exit "${FAKE_MPS_RC:-0}"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    for name in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        monkeypatch.setenv(name, "")          # restored after the test
    said = []
    assert gpu_device.mps_problem() is None
    assert gpu_device.start_mps(tmp_path / "work", said.append)
    gpu_device.stop_mps(said.append)
    pipe = tmp_path / "work" / "mps" / "pipe"
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe) and pipe.is_dir()
    assert calls.read_text().splitlines() == [f"args=-d pipe={pipe} stdin=", f"args= pipe={pipe} stdin=quit"]
    assert said == ["mps: started", "mps: stopped"]
    monkeypatch.setenv("FAKE_MPS_RC", "3")
    assert not gpu_device.start_mps(tmp_path / "work", said.append)
    assert said[-1].startswith(f"mps: {gpu_device.MPS_CONTROL} -d exited 3")


def test_every_phase_names_tests_the_proof_has():
    """A phase that names a test the proof lacks would run nothing for it on the device."""
    import ast
    tree = ast.parse((REPO / "tests" / "gpu" / "test_gpu_proof.py").read_text())
    names = {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}
    for phase, nodes in gpu_device.PHASES.items():
        for node in nodes:
            if node == "library":
                continue
            name = node.split("::", 1)[1].split("[", 1)[0]
            assert name in names, (phase, node)
            if "[" in node:
                assert node.endswith(("[2]", "[4]")), (phase, node)


# ---------------------------------------------------------------- the fault-path verdicts (tests/gpu/verdicts.py)
# Lines of the kind the lent H200 printed on 2026-11-27 (tests/gpu/worker_faults.py and worker.py).
GRAPH_OK = [f"GRAPH rank {r}: {line}" for r in (0, 1) for line in (
    "5 warm-up all_reduces: 0.068 s", "capture: 0.028 s (engine stream capturing after: False)",
    "3 replays: 0.071 s (result exact)", "engine barrier after the replays: 0.005 s (True)",
    "replay, then an eager all_reduce: 0.010 s (eager result 2)", "stock barrier: 0.040 s",
    "shutdown while the graph lives: 5.001 s (returned: True; comm: Communicator(rank 0 of 2, ended: destroyed))",
    "del graph: 0.072 s (comm freed after del graph: True)")]
INITFAIL_OK = ["INITFAIL rank 0: init with rank 1 absent: 2.010 s (NcclConnectError: hpct NCCL communicator "
               "creation failed ... (ncclRemoteError, 6))",
               "INITFAIL rank 0: the failed init's comm: 0.000 s (Communicator(rank 0 of 2, listen 127.0.0.1:1, "
               "next 127.0.0.1:2, ended: aborted), freed: True)",
               "INITFAIL rank 0: recover on the same slot: 0.068 s (re-formed on the same slot and summed exactly)",
               "INITFAIL rank 1: recover on the same slot: 0.068 s (re-formed on the same slot and summed exactly)"]
HELD_OK = ("HELD n=2 rank 0: 5.01 s: NcclOpTimeoutError: hpct NCCL launch failed ... | the call returned at "
           "5.006 s; abort flag raised at 5.006 s; the held call returned at 5.006 s; ncclCommAbort called at "
           "5.007 s; ncclCommAbort returned at 5.010 s | flag first: True; abort beside the call: False")


def test_the_graph_verdict_passes_a_good_run_and_names_what_a_bad_one_lacks():
    import verdicts
    assert verdicts.graph_problems(GRAPH_OK) == []
    hung = [ln.replace("5.001 s (returned: True", "12.001 s (returned: False") for ln in GRAPH_OK]
    assert verdicts.graph_problems(hung) == [
        f"rank {r}: shutdown while the graph lives{p}" for r in (0, 1)
        for p in (": 'returned: False; comm: Communicator(rank 0 of 2, ended: destroyed)' lacks 'returned: True'",
                  " took 12.001 s, more than 7 s")]
    kept = [ln.replace("freed after del graph: True", "freed after del graph: False") for ln in GRAPH_OK]
    assert len(verdicts.graph_problems(kept)) == 2
    assert verdicts.graph_problems(GRAPH_OK[:8]) == [f"rank 1: no '{s}' stage" for s in (
        "3 replays", "replay, then an eager all_reduce", "shutdown while the graph lives", "del graph")]
    with pytest.raises(ValueError, match="printed stage '3 replays' twice"):
        verdicts.graph_problems(GRAPH_OK + GRAPH_OK[2:3])


def test_the_initfail_and_held_verdicts_name_what_went_wrong():
    import verdicts
    assert verdicts.initfail_problems(INITFAIL_OK) == []
    leaked = [ln.replace("ended: aborted), freed: True", "live), freed: False") for ln in INITFAIL_OK]
    assert verdicts.initfail_problems(leaked)[0].startswith("the failed init's comm was not aborted and freed")
    assert verdicts.initfail_problems(INITFAIL_OK[:3]) == ["rank 1 did not re-form on the same slot: None"]
    assert verdicts.held_problems(HELD_OK) == []
    beside = HELD_OK.replace("flag first: True; abort beside the call: False", "flag first: False; abort beside the call: True")
    assert verdicts.held_problems(beside) == ["the abort flag was not the first step of the end",
                                              "ncclCommAbort ran beside the held call"]
    assert verdicts.held_problems("") == ["no HELD line"]
