"""`hpct-build build pytorch`: the plan --dry-run prints is the build, and bad options fail clearly.

A real PyTorch build takes hours and the upstream tarball with submodules; here the
plan is checked instead: its environment, its commands, where the patched Gloo
goes, the wheel's local version, and what it says about the fetched tree.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from util import REPO, run_cli

pytestmark = pytest.mark.unit

VERSION = "2.6.0"
WORK = REPO / "third_party" / "build" / f"pytorch-{VERSION}"


def _series_id(root: Path, name: str) -> str:
    from hpct.builder.layout import Layout
    from hpct.builder.patches import load_series
    from hpct.builder.sources import load_manifest
    layout = Layout(root)
    return load_series(layout, load_manifest(layout, name)).identity()


def _plan(*args: str, root: Path = REPO) -> dict:
    proc = run_cli("hpct-build", "build", "pytorch", "--dry-run", "--json", "--root", str(root), *args,
                   timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema_version"] == 1 and doc["component"] == "pytorch"
    return doc


@pytest.fixture(scope="module")
def fetched_repo() -> Path:
    proc = run_cli("hpct-build", "fetch", "pytorch", "--root", str(REPO), timeout=900)
    assert proc.returncode == 0, proc.stderr
    return REPO


def test_cpu_plan_environment_and_local_version(fetched_repo):
    before = WORK.exists()
    doc = _plan("-j", "3")
    sid = _series_id(REPO, "pytorch")
    assert doc["local_version"] == f"{VERSION}+hpct.{sid}"
    assert re.fullmatch(r"2\.6\.0\+hpct\.[0-9a-f]{16}", doc["local_version"])
    assert doc["gloo_series_id"] == _series_id(REPO, "gloo")
    env = doc["env"]
    assert env["PYTORCH_BUILD_VERSION"] == doc["local_version"]
    assert env["PYTORCH_BUILD_NUMBER"] == "1"          # setup.py int()s it whenever the version is set
    assert env["MAX_JOBS"] == "3"
    assert (env["USE_CUDA"], env["USE_NCCL"]) == ("0", "0")
    assert (env["USE_DISTRIBUTED"], env["USE_GLOO"], env["USE_SYSTEM_GLOO"]) == ("1", "1", "0")
    assert "TORCH_CUDA_ARCH_LIST" not in env and "NCCL_ROOT" not in env
    assert doc["cuda"] is False
    assert WORK.exists() == before, "--dry-run must not create anything"


def test_steps_put_the_patched_gloo_where_pytorch_cmake_expects_it(fetched_repo):
    doc = _plan()
    work = Path(doc["work_tree"])
    assert doc["gloo_placement"] == str(work / "third_party" / "gloo")
    cmds = [s["cmd"] for s in doc["steps"]]
    whats = [s["what"] for s in doc["steps"]]
    assert cmds[0][-4:-2] == ["patch", "pytorch"] and cmds[1][-4:-2] == ["patch", "gloo"]
    assert ["cp", "-a", doc["patched"], str(work)] in cmds
    assert ["rm", "-rf", doc["gloo_placement"]] in cmds
    place = cmds.index(["cp", "-a", doc["gloo_patched"], doc["gloo_placement"]])
    assert place > cmds.index(["rm", "-rf", doc["gloo_placement"]]) > cmds.index(["cp", "-a", doc["patched"], str(work)])
    assert doc["gloo_patched"].endswith("third_party/patched/gloo-5354032")
    last = doc["steps"][-1]
    assert last["cwd"] == str(work) and last["cmd"][1:3] == ["setup.py", "bdist_wheel"]
    assert last["cmd"][-2:] == ["--dist-dir", doc["dist"]]
    assert "USE_SYSTEM_GLOO=0" in " ".join(whats)
    assert doc["wheel_glob"].startswith(f"torch-{doc['local_version']}-cp")


def test_dfsg_tree_is_named_and_blocks_a_real_build(fetched_repo):
    doc = _plan()
    assert doc["source"]["provider"] == "debian"
    assert any("dfsg" in w and "--source pytorch-v2.6.0.tar.gz" in w for w in doc["warnings"]), doc["warnings"]
    assert any("submodule" in b for b in doc["blockers"]) and doc["ready"] is False


def test_text_dry_run_prints_exports_and_commands(fetched_repo):
    proc = run_cli("hpct-build", "build", "pytorch", "--dry-run", "--root", str(REPO), timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "export USE_CUDA=0" in out and "export USE_SYSTEM_GLOO=0" in out
    assert re.search(r"^export PYTORCH_BUILD_VERSION=2\.6\.0\+hpct\.[0-9a-f]{16}$", out, re.M)
    assert re.search(r"^export MAX_JOBS=\d+$", out, re.M)
    assert "# WARNING: the fetched tree is Debian's dfsg repack" in out
    assert "hpct-build fetch pytorch --force --source pytorch-v2.6.0.tar.gz" in out
    assert "setup.py bdist_wheel" in out and "third_party/gloo" in out


def test_cuda_plan_with_an_nccl_prefix(fetched_repo, tmp_path):
    prefix = tmp_path / "nccl"
    (prefix / "include").mkdir(parents=True)
    (prefix / "include" / "nccl.h").write_text("/* stand-in */\n")
    doc = _plan("--cuda", "--cuda-arch", "8.0 9.0+PTX", "--nccl", str(prefix))
    env = doc["env"]
    assert (env["USE_CUDA"], env["USE_NCCL"], env["USE_SYSTEM_NCCL"]) == ("1", "1", "1")
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"
    assert env["NCCL_ROOT"] == str(prefix)
    assert env["NCCL_INCLUDE_DIR"] == str(prefix / "include") and env["NCCL_LIB_DIR"] == str(prefix / "lib")
    assert doc["nccl"]["kind"] == "prefix"
    assert not any("no NCCL" in b for b in doc["blockers"])


def test_cuda_plan_defaults_to_hpct_nccl_and_both_gpu_archs(fetched_repo):
    doc = _plan("--cuda")
    assert doc["env"]["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0"
    assert doc["nccl"]["kind"] == "hpct"
    assert doc["env"]["NCCL_ROOT"] == str(REPO / "third_party/build/nccl-2.21.5/install")
    if not (REPO / "third_party/build/nccl-2.21.5/install/include/nccl.h").is_file():
        assert any("no NCCL at" in b for b in doc["blockers"])


def test_cuda_plan_with_bundled_nccl_warns(fetched_repo):
    doc = _plan("--cuda", "--nccl", "bundled")
    assert doc["env"]["USE_SYSTEM_NCCL"] == "0" and "NCCL_ROOT" not in doc["env"]
    assert any("unpatched NCCL" in w for w in doc["warnings"])


def test_dry_run_names_the_nccl_choice(fetched_repo):
    """--cuda: USE_SYSTEM_NCCL points at hpct's NCCL build, and the header line says so."""
    proc = run_cli("hpct-build", "build", "pytorch", "--dry-run", "--cuda", "--root", str(REPO), timeout=120)
    assert proc.returncode == 0, proc.stderr
    prefix = REPO / "third_party/build/nccl-2.21.5/install"
    assert "# NCCL: hpct's patched NCCL 2.21.5" in proc.stdout and f"at {prefix} (USE_SYSTEM_NCCL=1)" in proc.stdout
    assert "export USE_SYSTEM_NCCL=1" in proc.stdout and f"export NCCL_ROOT={prefix}" in proc.stdout
    assert f"export NCCL_INCLUDE_DIR={prefix}/include" in proc.stdout
    cpu = run_cli("hpct-build", "build", "pytorch", "--dry-run", "--root", str(REPO), timeout=120)
    assert "# NCCL: none (CPU build: USE_NCCL=0)" in cpu.stdout


def _nccl_prefix(root: Path, rootless: bool) -> Path:
    (root / "include").mkdir(parents=True)
    (root / "include" / "nccl.h").write_text("/* stand-in */\n")
    if rootless:
        (root / "include" / "nccl_rootless.h").write_text("/* stand-in */\n")
    return root


def test_nccl_prefix_without_the_rootless_header_warns(fetched_repo, tmp_path):
    doc = _plan("--cuda", "--nccl", str(_nccl_prefix(tmp_path / "stock", rootless=False)))
    assert doc["nccl"]["rootless"] is False
    assert any("no include/nccl_rootless.h" in w and "--nccl hpct" in w for w in doc["warnings"])
    doc = _plan("--cuda", "--nccl", str(_nccl_prefix(tmp_path / "hpct", rootless=True)))
    assert doc["nccl"]["rootless"] is True
    assert not any("nccl_rootless.h" in w for w in doc["warnings"])


def test_hpct_nccl_without_the_rootless_header_blocks(scratch_root):
    _nccl_prefix(scratch_root / "third_party/build/nccl-2.21.5/install", rootless=False)
    doc = _plan("--cuda", root=scratch_root)
    assert doc["nccl"]["kind"] == "hpct" and doc["nccl"]["rootless"] is False
    assert any("no include/nccl_rootless.h" in b and "hpct-build build nccl" in b for b in doc["blockers"])
    assert not doc["ready"]


@pytest.mark.parametrize("args,needle", [
    (["--cuda", "--cuda-arch", "sm_90"], "--cuda-arch 'sm_90'"),
    (["--cuda", "--cuda-arch", ""], "--cuda-arch"),
    (["--cuda-arch", "9.0"], "--cuda-arch and --nccl apply to a CUDA build only"),
    (["--nccl", "bundled"], "apply to a CUDA build only"),
])
def test_bad_cuda_options(fetched_repo, args, needle):
    proc = run_cli("hpct-build", "build", "pytorch", "--dry-run", "--root", str(REPO), *args)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "fix:" in proc.stderr


def test_pytorch_options_are_refused_for_gloo():
    proc = run_cli("hpct-build", "build", "gloo", "--dry-run", "--root", str(REPO))
    assert proc.returncode == 2
    assert "--dry-run apply to `build pytorch` only" in proc.stderr


def test_json_needs_dry_run():
    proc = run_cli("hpct-build", "build", "pytorch", "--json", "--root", str(REPO))
    assert proc.returncode == 2 and "--json needs --dry-run" in proc.stderr


def test_unfetched_tree_is_a_blocker_not_an_error(scratch_root):
    doc = _plan(root=scratch_root)
    assert doc["source"]["provider"] is None
    assert any("not fetched" in b and "--source pytorch-v2.6.0.tar.gz" in b for b in doc["blockers"])
    assert not (scratch_root / "third_party" / "src" / "pytorch-2.6.0").exists()


def test_a_full_source_tree_has_no_submodule_blocker(scratch_root):
    from hpct.builder.pytorch import CPU_SUBMODULES
    src = scratch_root / "third_party" / "src" / "pytorch-2.6.0"
    for sub in CPU_SUBMODULES:
        (src / "third_party" / sub).mkdir(parents=True)
        (src / "third_party" / sub / "CMakeLists.txt").write_text("# stand-in\n")
    (src / "version.txt").write_text("2.6.0a0\n")
    (src / ".hpct-source.json").write_text(json.dumps(
        {"name": "pytorch", "version": VERSION, "provider": "local-archive", "path": "pytorch-v2.6.0.tar.gz"}))
    doc = _plan(root=scratch_root)
    assert doc["source"]["provider"] == "local-archive"
    assert not any("dfsg" in w for w in doc["warnings"])
    assert not any("submodule" in b or "not fetched" in b for b in doc["blockers"])


def test_real_build_on_the_dfsg_tree_fails_before_doing_anything(fetched_repo):
    before = WORK.exists()
    proc = run_cli("hpct-build", "build", "pytorch", "--root", str(REPO), timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert "cannot build torch 2.6.0+hpct." in proc.stderr
    assert "submodule" in proc.stderr and "--source pytorch-v2.6.0.tar.gz" in proc.stderr
    assert WORK.exists() == before


def test_build_document_names_the_resources():
    doc = (REPO / "docs" / "pytorch-build.md").read_text()
    for needle in ("--dry-run", "pytorch-v2.6.0.tar.gz", "MAX_JOBS", "TORCH_CUDA_ARCH_LIST", "disk", "memory"):
        assert needle in doc, needle
