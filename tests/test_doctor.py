"""hpct doctor: a good node, then each failing row with its fix.

PyTorch and the extension are replaced by small fakes through ``Probe.import_module``
(so the rows can be driven into every state); the NCCL rows use the real
``nvidia-nccl-cu12==2.21.5`` library, obtained once into ~/.cache/hpct.
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from hpct import doctor, doctor_nccl, doctor_run
from hpct.cli import main
from hpct.doctor import Probe, Row
from hpct.doctor_nccl import check_nccl, find_libnccl
from hpct.doctor_run import run_checks
from hpct.ports import busy_ports
from util import REPO, run_cli

NCCL_PIN = "2.21.5"
FETCH = f"{sys.executable} -m pip download --no-deps nvidia-nccl-cu12=={NCCL_PIN} -d ~/.cache/hpct"
# Which torch to install when none is importable: the stock CPU pin CI uses; for GPUs, PyPI's
# newest supported CUDA build with hpct's NCCL, or hpct's patched 2.6.0.
TORCH_FIX = (f"{sys.executable} -m pip install torch==2.13.0 (the CPU build hpct is tested with, as "
             f"ci/setup.sh installs it); for GPUs, torch 2.15.0 from PyPI with hpct's NCCL (hpct-build build "
             f"nccl=2.30.7), or hpct's patched PyTorch 2.6.0: hpct-build wheel torch=2.6.0")
# An installed CUDA torch outside the range: a CUDA torch in it, never the CPU wheel.
CUDA_TORCH_FIX = f"{sys.executable} -m pip install torch==2.15.0 (its CUDA build, as PyPI serves it)"


# ---------------------------------------------------------------- fakes and fixtures

def fake_torch(version="2.6.0+hpct.s1", cuda="12.4", dist=True, gloo=True, nccl=True):
    distributed = types.SimpleNamespace(is_available=lambda: dist, is_gloo_available=lambda: gloo,
                                        is_nccl_available=lambda: nccl)
    torch = types.SimpleNamespace(__version__=version, version=types.SimpleNamespace(cuda=cuda),
                                  distributed=distributed)
    return torch


def fake_ext(series="s1", names=("0001-fixed-listen-port", "0002-storeless-connect")):
    return types.SimpleNamespace(__file__="/x/hpct/_gloo.so", series_id=lambda: series,
                                 gloo_series=lambda: list(names))


def importer(**modules):
    """An import_module replacement: torch=..., ext=...; a value that is an exception is raised."""
    table = {}
    if "torch" in modules:
        table["torch"] = modules["torch"]
        table["torch.distributed"] = getattr(modules["torch"], "distributed", modules["torch"])
    if "ext" in modules:
        table["hpct._gloo"] = modules["ext"]

    def import_module(name):
        value = table.get(name)
        if value is None:
            raise ModuleNotFoundError(f"No module named {name!r}")
        if isinstance(value, BaseException):
            raise value
        return value
    return import_module


def _c_library(tmp_path: Path, name: str, source: str) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build a stand-in libnccl")
    (tmp_path / f"{name}.c").write_text(source)
    out = tmp_path / f"{name}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(tmp_path / f"{name}.c")],
                   check=True, timeout=60, capture_output=True)
    return str(out)


@pytest.fixture
def rootless_nccl(tmp_path) -> str:
    """A stand-in for hpct's patched libnccl: ncclGetVersion plus the rootless entry point."""
    return _c_library(tmp_path, "libnccl_rootless",
                      "int ncclGetVersion(int *v) { *v = 22105; return 0; }\n"
                      "int ncclCommInitRankRootless(void) { return 0; }\n")


@pytest.fixture(scope="session")
def real_nccl() -> str:
    """libnccl.so.2 from the real nvidia-nccl-cu12==2.21.5 wheel (fetched once into the cache)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpct"
    lib = cache / f"nccl-{NCCL_PIN}" / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    if lib.is_file():
        return str(lib)
    wheels = glob.glob(str(cache / f"nvidia_nccl_cu12-{NCCL_PIN}-*.whl"))
    if not wheels:
        cache.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                            f"nvidia-nccl-cu12=={NCCL_PIN}", "-d", str(cache)],
                           check=True, timeout=600, capture_output=True)
        except (subprocess.SubprocessError, OSError) as err:
            pytest.skip(f"nvidia-nccl-cu12=={NCCL_PIN} cannot be obtained ({type(err).__name__}); "
                        f"fetch it with: {FETCH}")
        wheels = glob.glob(str(cache / f"nvidia_nccl_cu12-{NCCL_PIN}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as whl:
        whl.extract("nvidia/nccl/lib/libnccl.so.2", cache / f"nccl-{NCCL_PIN}")
    return str(lib)


@pytest.fixture
def proc_sys(tmp_path) -> str:
    """A fake /proc/sys after `hpct ports apply`: floor 20000, nothing reserved."""
    ipv4 = tmp_path / "proc" / "net" / "ipv4"
    ipv4.mkdir(parents=True)
    (ipv4 / "ip_local_port_range").write_text("20000\t60999\n")
    (ipv4 / "ip_local_reserved_ports").write_text("\n")
    return str(tmp_path / "proc")


@pytest.fixture(scope="session")
def free_base() -> int:
    """A port base whose 16 default-plan ports are free on this machine right now."""
    for base in range(12000, 19000, 160):
        if not busy_ports(range(base, base + 16)):
            return base
    pytest.skip("no free block of 16 ports below 19000")


@pytest.fixture
def good(tmp_path, proc_sys, free_base, rootless_nccl) -> Probe:
    """Everything right: patched CUDA PyTorch, matching extension, rootless NCCL, safe ports."""
    series = tmp_path / "_series.json"
    series.write_text(json.dumps({"series_id": "s1"}))
    return Probe(env={"HPCT_USE_ROOTLESS": "1", "HPCT_PORT_BASE": str(free_base)}, proc_sys=proc_sys,
                 import_module=importer(torch=fake_torch(), ext=fake_ext()), series_file=series,
                 nccl_paths=[rootless_nccl], use_ldconfig=False, torch_series=lambda: "s1",
                 sys_path=[])    # no nvidia-nccl wheel row: a CUDA torch's site-packages holds one


def rows_by_name(rows):
    return {r.check: r for r in rows}


def with_(probe: Probe, **changes) -> Probe:
    import dataclasses
    return dataclasses.replace(probe, **changes)


# ---------------------------------------------------------------- the good node

@pytest.mark.unit
def test_good_node_passes_every_row(good):
    rows = run_checks(good)
    assert [r.check for r in rows] == ["python", "pytorch", "dependencies", "hpct extension", "gloo series",
                                      "torch backends",
                                      "c10d patches", "libnccl", "nccl for hpct", "configuration",
                                      "kernel port ranges",
                                      "free ports"]
    assert {r.check: r.status for r in rows} == {r.check: "ok" for r in rows}, doctor.render_table(rows)
    by = rows_by_name(rows)
    assert by["pytorch"].detail == "2.6.0+hpct.s1 (CUDA 12.4)"
    assert by["hpct extension"].detail.endswith(
        "Gloo series s1 (2 patches, compiled in; `hpct doctor --json` lists them)")
    assert by["hpct extension"].data == {"series_id": "s1",
                                         "patches": ["0001-fixed-listen-port", "0002-storeless-connect"]}
    assert by["libnccl"].detail.endswith("NCCL 2.21.5 (22105), exports ncclCommInitRankRootless")
    assert by["free ports"].detail == "16 ports of all local ranks are free"
    assert doctor.failures(rows) == []
    assert doctor.render_table(rows).splitlines()[-1] == "all required checks passed"


# ---------------------------------------------------------------- each failing row

@pytest.mark.unit
def test_old_python_fails(monkeypatch):
    class Version(tuple):
        major, minor, micro = 3, 9, 18
    monkeypatch.setattr(sys, "version_info", Version((3, 9, 18, "final", 0)))
    row = doctor.check_python()         # the floor comes from the installed wheel's Requires-Python
    import importlib.metadata as md
    floor = md.metadata("hpct")["Requires-Python"]            # pyproject.toml's, e.g. ">=3.10"
    assert (row.status, row.fix) == ("fail", f"use Python {floor.removeprefix('>=')} or newer")
    assert row.detail.endswith(f"does not satisfy hpct's requires-python {floor}")


@pytest.mark.unit
def test_missing_torch_fails_with_pip_fix(good):
    rows = rows_by_name(run_checks(with_(good, import_module=importer(ext=fake_ext()))))
    assert rows["pytorch"].status == "fail"
    assert rows["pytorch"].detail == "not importable (No module named 'torch')"
    assert rows["pytorch"].fix == TORCH_FIX
    assert rows["torch backends"].status == rows["c10d patches"].status == "skip"


@pytest.mark.unit
@pytest.mark.parametrize("torch,detail,fix", [
    (fake_torch(version="2.5.1+cu124"), "2.5.1+cu124 is outside hpct's supported range torch<2.16,>=2.6",
     CUDA_TORCH_FIX),
    (fake_torch(version="2.5.1+cpu", cuda=None), "2.5.1+cpu is outside hpct's supported range torch<2.16,>=2.6",
     TORCH_FIX),
    (fake_torch(version="2.16.0", cuda="13.2"), "2.16.0 is outside hpct's supported range torch<2.16,>=2.6",
     f"torch 2.16.0 is newer than hpct supports (2.6 through 2.15.0): {CUDA_TORCH_FIX}, or an hpct release "
     "that admits 2.16"),
    (OSError("libcudart.so.12: cannot open shared object file"),
     "import failed: OSError: libcudart.so.12: cannot open shared object file", TORCH_FIX),
])
def test_bad_torch_fails_with_advice_for_the_build_it_is(good, torch, detail, fix):
    row = rows_by_name(run_checks(with_(good, import_module=importer(torch=torch, ext=fake_ext()))))["pytorch"]
    assert (row.status, row.detail, row.fix) == ("fail", detail, fix)
    assert "2.13.0" not in row.fix or getattr(torch, "version", None) is None or not torch.version.cuda


@pytest.mark.unit
@pytest.mark.parametrize("version,cuda", [("2.14.1", "13.0"), ("2.15.0", "13.2"), ("2.11.0", "13.0")])
def test_cuda_torch_in_the_range_passes(good, version, cuda):
    row = rows_by_name(run_checks(with_(good, import_module=importer(torch=fake_torch(version=version, cuda=cuda),
                                                                     ext=fake_ext()))))["pytorch"]
    assert (row.status, row.detail) == ("ok", f"{version} (CUDA {cuda})")


@pytest.mark.unit
def test_missing_extension_fails(good):
    rows = rows_by_name(run_checks(with_(good, import_module=importer(torch=fake_torch()))))
    assert rows["hpct extension"].status == "fail"
    assert rows["hpct extension"].detail == \
        "hpct._gloo does not load (ModuleNotFoundError: No module named 'hpct._gloo')"
    assert rows["hpct extension"].fix.startswith("run hpct-build wheel")
    assert rows["gloo series"].status == "skip"


@pytest.mark.unit
def test_patch_names_from_the_build_record(good):
    ext = types.SimpleNamespace(__file__="/x/hpct/_gloo.so", series_id=lambda: "s1")   # no gloo_series()
    good.series_file.write_text(json.dumps({"series_id": "s1", "patches": ["0001-a.patch", "0002-b.patch"]}))
    rows = rows_by_name(run_checks(with_(good, import_module=importer(torch=fake_torch(), ext=ext))))
    assert rows["hpct extension"].detail == \
        "/x/hpct/_gloo.so: Gloo series s1 (2 patches, from _series.json; `hpct doctor --json` lists them)"
    assert rows["gloo series"].status == "ok"


@pytest.mark.unit
def test_extension_without_series_id_fails(good):
    ext = types.SimpleNamespace(__file__="/x/hpct/_gloo.so")
    row = rows_by_name(run_checks(with_(good, import_module=importer(torch=fake_torch(), ext=ext))))["hpct extension"]
    assert row.status == "fail" and "AttributeError" in row.detail


@pytest.mark.unit
def test_series_mismatch_fails(good):
    rows = rows_by_name(run_checks(with_(good, import_module=importer(torch=fake_torch(), ext=fake_ext("s0")))))
    row = rows["gloo series"]
    assert (row.status, row.detail) == ("fail", "the extension carries s0 but this package expects s1")
    assert "hpct-build wheel" in row.fix


@pytest.mark.unit
def test_series_file_absent_is_unknown_not_a_failure(good, tmp_path):
    row = rows_by_name(run_checks(with_(good, series_file=tmp_path / "none.json")))["gloo series"]
    assert (row.status, row.detail) == ("info", "s1; expected series unknown (no none.json)")
    assert doctor.expected_series_id(tmp_path / "none.json") is None


@pytest.mark.unit
def test_series_file_broken_fails(good, tmp_path):
    broken = tmp_path / "_series.json"
    broken.write_text("{not json")
    row = rows_by_name(run_checks(with_(good, series_file=broken)))["gloo series"]
    assert row.status == "fail" and "is unreadable or has no \"series_id\"" in row.detail


@pytest.mark.unit
@pytest.mark.parametrize("torch,detail", [
    (fake_torch(dist=False), "torch.distributed is not available in this build"),
    (fake_torch(gloo=False), "gloo no, nccl yes"),
])
def test_torch_backends_fail(good, torch, detail):
    row = rows_by_name(run_checks(with_(good, import_module=importer(torch=torch, ext=fake_ext()))))["torch backends"]
    assert (row.status, row.detail) == ("fail", detail)
    assert row.fix.endswith(TORCH_FIX)


def _out_of_tree(installed=True, record=None, error=None):
    """torch.distributed._hpct_out_of_tree of hpct's out-of-tree wheel, and its torch._C module."""
    record = record or {"gloo_series_id": "g1", "module": {"nccl": True, "needs": ["glibc 2.34"]}}
    oot = types.SimpleNamespace(record=lambda: record)
    c10d = types.SimpleNamespace(_hpct_out_of_tree=installed)
    def import_module(name):
        if name == "torch.distributed._hpct_out_of_tree":
            if error is not None:
                raise error
            return oot
        if name == "torch._C._distributed_c10d":
            return c10d
        return importer(torch=fake_torch(), ext=fake_ext())(name)
    return import_module


@pytest.mark.unit
def test_a_torch_of_this_hpcts_series_is_recognised_out_of_tree(good):
    row = rows_by_name(run_checks(with_(good, import_module=_out_of_tree())))["c10d patches"]
    assert (row.status, row.detail) == ("ok", "2.6.0+hpct.s1 carries hpct's c10d series s1, this hpct's own "
                                              "(out of tree in torch._hpct_c10d with Gloo series g1, "
                                              "ProcessGroupNCCL too; needs glibc 2.34)")


@pytest.mark.unit
def test_a_torch_of_another_series_fails_with_the_rebuild(good):
    row = rows_by_name(run_checks(with_(good, torch_series=lambda: "s2")))["c10d patches"]
    assert (row.status, row.detail) == ("fail", "2.6.0+hpct.s1 carries c10d series s1, but this hpct's series is s2")
    assert row.fix.startswith("build and install the torch of this hpct's series: hpct-build wheel torch=2.6.0")


@pytest.mark.unit
@pytest.mark.parametrize("probe, detail", [
    (dict(installed=False), "2.6.0+hpct.s1: torch._hpct_c10d is installed but not in use (torch.distributed did "
                            "not put its classes in place)"),
    (dict(error=ImportError("hpct's patched torch cannot load its c10d module torch._hpct_c10d: GLIBCXX")),
     "2.6.0+hpct.s1: hpct's patched torch cannot load its c10d module torch._hpct_c10d: GLIBCXX"),
])
def test_an_out_of_tree_module_not_in_use_fails(good, probe, detail):
    row = rows_by_name(run_checks(with_(good, import_module=_out_of_tree(**probe))))["c10d patches"]
    assert (row.status, row.detail) == ("fail", detail)


@pytest.mark.unit
def test_an_hpct_from_a_source_tree_cannot_say_which_series_it_expects(good):
    row = rows_by_name(run_checks(with_(good, torch_series=lambda: None)))["c10d patches"]
    assert row.status == "ok" and row.detail.endswith("the series this hpct expects is unknown (it is not "
                                                      "installed from a wheel)")


@pytest.mark.unit
def test_the_expected_series_is_that_of_the_inputs_the_wheel_carries():
    from hpct.builder.layout import Layout, packaged_inputs
    from hpct.builder.patches import load_series
    from hpct.builder.sources import load_manifest
    from hpct.doctor_c10d import expected_torch_series
    inputs = packaged_inputs()
    assert inputs is not None, "the installed hpct carries no hpct/_build_inputs"
    want = load_series(Layout(REPO), load_manifest(Layout(REPO), "pytorch")).identity()
    assert expected_torch_series() == want


@pytest.mark.unit
def test_stock_torch_is_informational(good):
    torch = fake_torch(version="2.6.0+cu124")
    rows = rows_by_name(run_checks(with_(good, import_module=importer(torch=torch, ext=fake_ext()))))
    assert rows["c10d patches"].status == "info"
    assert rows["c10d patches"].detail == \
        "stock PyTorch 2.6.0+cu124: rootless start-up goes through hpct's own backend"


@pytest.mark.unit
def test_invalid_configuration_fails_with_its_fix(good):
    rows = rows_by_name(run_checks(with_(good, env={"HPCT_PORT_BSE": "1"})))
    assert rows["configuration"].status == "fail"
    assert rows["configuration"].detail == "unknown variable HPCT_PORT_BSE='1'"
    assert rows["configuration"].fix.startswith("did you mean HPCT_PORT_BASE?")
    assert rows["kernel port ranges"].status == rows["free ports"].status == "skip"


@pytest.mark.unit
def test_ports_in_the_ephemeral_range_fail(good, tmp_path):
    (Path(good.proc_sys) / "net" / "ipv4" / "ip_local_port_range").write_text("10000\t60999\n")
    row = rows_by_name(run_checks(good))["kernel port ranges"]
    assert row.status == "fail"
    assert "lie in the ephemeral range 10000-60999 and are not reserved" in row.detail
    assert row.fix.startswith("run `hpct ports apply`")


@pytest.mark.unit
def test_unreadable_kernel_values_fail(good, tmp_path):
    row = rows_by_name(run_checks(with_(good, proc_sys=str(tmp_path / "nothing"))))["kernel port ranges"]
    assert row.status == "fail" and row.detail.startswith("cannot read net.ipv4.ip_local_port_range")


@pytest.mark.unit
def test_busy_port_fails(good):
    base = int(good.env["HPCT_PORT_BASE"])
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + 9))       # nccl block, slot 1
        holder.listen()
        row = rows_by_name(run_checks(good))["free ports"]
    assert row.status == "fail"
    assert row.detail == f"in use: {base + 9} (Address already in use) of all local ranks"
    assert f"ss -ltnp 'sport = :{base + 9}'" in row.fix


@pytest.mark.unit
def test_free_ports_of_one_local_rank(good):
    env = {**good.env, "LOCAL_RANK": "1", "N_PROC_PER_NODE": "2"}
    row = rows_by_name(run_checks(with_(good, env=env)))["free ports"]
    assert row.detail == "16 ports of local rank 1 are free"


# ---------------------------------------------------------------- the libnccl row

@pytest.mark.unit
def test_real_nccl_without_rootless_is_a_warning(good, real_nccl):
    row = check_nccl(with_(good, nccl_paths=[real_nccl]), fake_torch(version="2.6.0+cu124"), None)
    assert row.status == "warn"
    assert row.detail == (f"{real_nccl} (given): NCCL 2.21.5 (22105), stock: no ncclCommInitRankRootless "
                          "(rootless NCCL start-up unavailable)")


@pytest.mark.unit
def test_real_nccl_without_rootless_fails_when_required(good, real_nccl):
    from hpct.config import Config
    config = Config.from_mapping({"HPCT_USE_ROOTLESS": "1"})
    row = check_nccl(with_(good, nccl_paths=[real_nccl]), fake_torch(), config)
    assert row.status == "fail"
    assert row.detail.endswith("(required: HPCT_USE_ROOTLESS=1 with hpct's PyTorch)")
    assert "hpct-build build nccl && hpct-build wheel nccl --install" in row.fix


@pytest.mark.unit
def test_nccl_search_order(tmp_path, real_nccl):
    site, other, ld = tmp_path / "site", tmp_path / "other", tmp_path / "ld"
    (site / "nvidia" / "nccl" / "lib").mkdir(parents=True)
    os.symlink(real_nccl, site / "nvidia" / "nccl" / "lib" / "libnccl.so.2")
    ld.mkdir()
    (ld / "libnccl.so.2").write_bytes(b"")
    probe = Probe(env={"LD_LIBRARY_PATH": f"{ld}:"}, sys_path=[str(other), str(site)], use_ldconfig=False)
    assert find_libnccl(probe) == [(str(site / "nvidia/nccl/lib/libnccl.so.2"), "nvidia-nccl wheel"),
                                   (str(ld / "libnccl.so.2"), "LD_LIBRARY_PATH")]
    (other / "torch" / "lib").mkdir(parents=True)
    (other / "torch" / "lib" / "libnccl.so.2").write_bytes(b"")
    assert find_libnccl(probe)[0] == (str(other / "torch/lib/libnccl.so.2"), "torch/lib")
    # End to end through the search: the wheel's library answers ncclGetVersion.
    row = check_nccl(Probe(env={}, sys_path=[str(site)], use_ldconfig=False), fake_torch(), None)
    assert "NCCL 2.21.5 (22105)" in row.detail and "(nvidia-nccl wheel)" in row.detail


@pytest.mark.unit
def test_nccl_missing(good):
    probe = with_(good, nccl_paths=[])
    cuda = check_nccl(probe, fake_torch(), None)
    assert (cuda.status, cuda.fix) == ("fail", f"{sys.executable} -m pip install --no-deps nvidia-nccl-cu12==2.21.5")
    cpu = check_nccl(probe, fake_torch(cuda=None), None)
    assert (cpu.status, cpu.detail) == ("info", "none found; a CPU-only PyTorch does not need one")


@pytest.mark.unit
def test_nccl_that_does_not_load_or_errors(good, tmp_path):
    junk = tmp_path / "libnccl.so.2"
    junk.write_text("not an ELF file")
    row = check_nccl(with_(good, nccl_paths=[str(junk)]), fake_torch(), None)
    assert row.status == "fail" and row.detail.startswith(f"loading {junk} failed: OSError")
    erring = _c_library(tmp_path, "libnccl_err", "int ncclGetVersion(int *v) { return 3; }\n")
    row = check_nccl(with_(good, nccl_paths=[erring]), fake_torch(), None)
    assert (row.status, row.detail) == ("fail", f"{erring}: ncclGetVersion returned error 3")
    assert check_nccl(with_(good, nccl_paths=[erring]), fake_torch(cuda=None), None).status == "warn"


@pytest.mark.unit
def test_nccl_version_text():
    assert doctor_nccl.nccl_version_text(22105) == "2.21.5"
    assert doctor_nccl.nccl_version_text(2804) == "2.8.4"


# ---------------------------------------------------------------- output and the CLI

@pytest.mark.unit
def test_table_and_exit_code(monkeypatch, capsys):
    rows = [Row("python", "ok", "3.11"), Row("hpct extension", "fail", "missing", "run hpct-build wheel"),
            Row("libnccl", "warn", "stock", "build it")]
    monkeypatch.setattr(doctor_run, "run_checks", lambda: rows)
    assert main(["doctor"]) == 10
    out, err = capsys.readouterr()
    assert out.splitlines() == ["STATUS  CHECK           DETAIL",
                                "ok      python          3.11",
                                "FAIL    hpct extension  missing",
                                "                        fix: run hpct-build wheel",
                                "warn    libnccl         stock",
                                "                        fix: build it",
                                "1 required check(s) failed"]
    assert err.startswith("hpct: error: 1 required check(s) failed: hpct extension\n")
    assert main(["doctor", "--json"]) == 10
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and doc["ok"] is False
    assert doc["checks"][1] == {"check": "hpct extension", "status": "fail", "detail": "missing",
                                "fix": "run hpct-build wheel"}
    monkeypatch.setattr(doctor_run, "run_checks", lambda: rows[:1])
    assert main(["doctor"]) == 0


@pytest.mark.unit
def test_live_doctor_json_is_consistent():
    proc = run_cli("hpct", "doctor", "--json", timeout=180,
                   env={k: "" for k in os.environ if k.startswith("HPCT_")})
    doc = json.loads(proc.stdout)
    assert doc["schema_version"] == 1
    assert proc.returncode == (0 if doc["ok"] else 10), proc.stderr
    assert [c["check"] for c in doc["checks"]][:2] == ["python", "pytorch"]


@pytest.mark.unit
def test_live_extension_row_when_built():
    try:
        importlib.import_module("hpct._gloo")
    except ImportError:
        pytest.skip("hpct._gloo is not built in this install (CI installs the wheel, where it must be)")
    rows = doctor.check_extension(Probe())
    assert rows[0].status == "ok", rows[0].detail
    assert rows[1].status in ("ok", "info"), rows[1].detail


@pytest.mark.multihost
def test_kernel_row_against_a_real_namespace():
    from hpct.testing.netns import netns, unavailable_reason
    if unavailable_reason():
        pytest.skip(unavailable_reason())
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HPCT_")}, "HPCT_PORT_BASE": "40000"}
    with netns("hpct-doctor") as ns:
        before = rows_by_name_json(ns.hpct("doctor", "--json", env=env, timeout=180))
        assert before["kernel port ranges"]["status"] == "fail"
        assert "ephemeral range 32768-60999" in before["kernel port ranges"]["detail"]
        assert ns.hpct("ports", "apply", env=env).returncode == 0
        after = rows_by_name_json(ns.hpct("doctor", "--json", env=env, timeout=180))
        assert after["kernel port ranges"]["status"] == "ok", after["kernel port ranges"]
        assert after["free ports"]["status"] == "ok"


def rows_by_name_json(proc) -> dict:
    doc = json.loads(proc.stdout)
    assert proc.returncode == (0 if doc["ok"] else 10), proc.stderr
    return {c["check"]: c for c in doc["checks"]}


# ---------------------------------------------------------------- the nccl wheel row (hpct-build wheel nccl)

def _nccl_site(site: Path, version: str | None, record: dict | str | None, cuda: str = "cu12") -> Path:
    """A site-packages holding an nvidia-nccl-cu12 (or cu13) install: metadata, library, series record."""
    (site / "nvidia" / "nccl" / "lib").mkdir(parents=True)
    (site / "nvidia" / "nccl" / "lib" / "libnccl.so.2").write_bytes(b"")
    if version is not None:
        info = site / f"nvidia_nccl_{cuda}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nvidia-nccl-{cuda}\nVersion: {version}\n")
    if record is not None:
        text = record if isinstance(record, str) else json.dumps(record)
        (site / "nvidia" / "nccl" / "hpct-series.json").write_text(text)
    return site


@pytest.mark.unit
def test_nccl_wheel_rows(tmp_path):
    record = {"series_id": "abc", "patches": ["0001-x.patch"], "cuda": "12.4", "cuda_archs": ["80", "90"],
              "funcs": None}
    hpct = _nccl_site(tmp_path / "hpct", "2.21.5+hpct.abc", record)
    assert doctor_nccl.check_nccl_wheel(Probe(sys_path=[str(tmp_path / "none"), str(hpct)])) == [Row(
        "nccl wheel", "ok", f"nvidia-nccl-cu12 2.21.5+hpct.abc in {hpct}: hpct series abc, 1 patches "
                            "(0001-x.patch), CUDA 12.4, sm 80,90, collectives all")]
    stock = _nccl_site(tmp_path / "stock", "2.21.5", None)
    # The first site-packages on the path that holds a libnccl is the one reported.
    assert doctor_nccl.check_nccl_wheel(Probe(sys_path=[str(stock), str(hpct)])) == [Row(
        "nccl wheel", "info", f"nvidia-nccl-cu12 2.21.5 in {stock}: NVIDIA's build, no hpct series")]
    other = _nccl_site(tmp_path / "other", "2.21.5+hpct.def", record)
    row, = doctor_nccl.check_nccl_wheel(Probe(sys_path=[str(other)]))
    assert row.status == "warn" and row.detail.endswith("; the version label does not name that series")
    assert row.fix.startswith("reinstall it: hpct-build wheel nccl")
    broken = _nccl_site(tmp_path / "broken", "2.21.5+hpct.abc", "{not json")
    row, = doctor_nccl.check_nccl_wheel(Probe(sys_path=[str(broken)]))
    assert (row.status, row.detail) == ("warn", f"nvidia-nccl-cu12 2.21.5+hpct.abc in {broken}: its series "
                                                "record hpct-series.json is unreadable (JSONDecodeError)")
    assert doctor_nccl.check_nccl_wheel(Probe(sys_path=[str(tmp_path / "none")])) == []


@pytest.mark.unit
def test_a_libnccl_that_cannot_load_is_read_from_its_symbol_table(good, tmp_path):
    """hpct's build needs libcudart.so.12; without it on the search path the library does not
    load, and doctor still says from the ELF file whether it has the rootless entry point."""
    cc = shutil.which("cc") or shutil.which("gcc") or pytest.skip("no C compiler (cc)")
    (tmp_path / "dep.c").write_text("int hpct_dep(void) { return 1; }\n")
    dep = tmp_path / "libhpctdep.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(dep), str(tmp_path / "dep.c")], check=True, timeout=60)
    (tmp_path / "nccl.c").write_text("int hpct_dep(void);\nint ncclGetVersion(int *v) { *v = 22105; return hpct_dep() - 1; }\n"
                                     "int ncclCommInitRankRootless(void) { return 0; }\n")
    lib = tmp_path / "libnccl.so.2"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "nccl.c"), f"-L{tmp_path}", "-lhpctdep"],
                   check=True, timeout=60)
    dep.unlink()
    row = check_nccl(with_(good, nccl_paths=[str(lib)]), fake_torch(), None)
    assert row.status == "fail"
    assert row.detail.startswith(f"loading {lib} failed: OSError: libhpctdep.so")
    assert row.detail.endswith("; its symbol table exports ncclCommInitRankRootless")


# ---------------------------------------------------------------- which libnccl hpct's CUDA half uses
@pytest.mark.unit
def test_nccl_for_hpct_uses_torchs_patched_library(good, rootless_nccl):
    """A patched libnccl from before ncclCommRaiseAbortFlag: hpct uses it, with non-blocking
    communicators (a held blocking call could not be ended by NCCL's rules), and says so."""
    row = doctor_nccl.check_nccl_for_hpct(good, fake_torch())
    assert row.status == "ok", row
    assert row.detail == (f"torch: {rootless_nccl} (NCCL 2.21.5, patched); hpct: {rootless_nccl} "
                          "(NCCL 2.21.5, patched) via the one torch loads; CUDA groups use non-blocking "
                          "communicators (this libnccl lacks ncclCommRaiseAbortFlag, so a held blocking call "
                          "could not be ended by NCCL's rules; install hpct's NCCL build for blocking comms)")
    doc = doctor.as_json([row])
    assert doc["nccl"]["hpct"] == {"path": rootless_nccl, "version": "2.21.5", "patched": True, "raise_abort": False,
                                   "series_id": None, "how": "the one torch loads", "matches_torch_pin": None,
                                   "comm_kind": "non-blocking", "comm_kind_why": doc["nccl"]["hpct"]["comm_kind_why"]}


@pytest.mark.unit
def test_nccl_for_hpct_says_which_communicators_the_library_gives(good, tmp_path):
    """With ncclCommRaiseAbortFlag (hpct's current series) the groups get blocking comms, unless
    HPCT_NCCL_BLOCKING=0 asks for non-blocking ones."""
    lib = _c_library(tmp_path, "libnccl_flag", "int ncclGetVersion(int *v) { *v = 23007; return 0; }\n"
                                                "int ncclCommInitRankRootless(void) { return 0; }\n"
                                                "int ncclCommRaiseAbortFlag(void *c) { return 0; }\n")
    row = doctor_nccl.check_nccl_for_hpct(with_(good, nccl_paths=[lib]), fake_torch())
    assert row.detail.endswith("; CUDA groups use blocking communicators (held calls are woken by "
                               "ncclCommRaiseAbortFlag before ncclCommAbort)"), row.detail
    off = doctor_nccl.check_nccl_for_hpct(with_(good, nccl_paths=[lib], env={**good.env, "HPCT_NCCL_BLOCKING": "0"}),
                                     fake_torch())
    assert off.detail.endswith("; CUDA groups use non-blocking communicators (HPCT_NCCL_BLOCKING=0)"), off.detail


@pytest.mark.unit
def test_nccl_for_hpct_stock_torch_library_falls_back_to_the_variable(good, real_nccl, rootless_nccl, tmp_path):
    # torch loads NVIDIA's build; HPCT_NCCL_LIBRARY names hpct's, with its series record beside it
    (Path(rootless_nccl).parent / "hpct-series.json").write_text(json.dumps({"series_id": "n7"}))
    probe = with_(good, nccl_paths=[real_nccl], env={**good.env, "HPCT_NCCL_LIBRARY": rootless_nccl})
    row = doctor_nccl.check_nccl_for_hpct(probe, fake_torch())
    assert row.status == "ok"
    assert row.detail.startswith(f"torch: {real_nccl} (NCCL 2.21.5, stock); hpct: {rootless_nccl} "
                                 "(NCCL 2.21.5, hpct series n7) via HPCT_NCCL_LIBRARY; CUDA groups use ")
    assert row.data["torch"]["patched"] is False and row.data["hpct"]["series_id"] == "n7"


@pytest.mark.unit
def test_nccl_for_hpct_stock_only_warns_with_the_fix(good, real_nccl):
    probe = with_(good, nccl_paths=[real_nccl])
    row = doctor_nccl.check_nccl_for_hpct(probe, fake_torch())
    assert row.status == "warn"
    assert row.detail.endswith("(no ncclCommInitRankRootless: hpct's CUDA groups cannot start)")
    # the advice follows the installed torch: 2.6 pins 2.21.5, which has an hpct drop-in
    assert row.fix.startswith("torch 2.6.0+hpct.s1 pins NCCL 2.21.5: install hpct's drop-in wheel of it")
    assert "hpct-build wheel nccl=2.21.5" in row.fix
    assert doctor_nccl.check_nccl_for_hpct(probe, fake_torch(cuda=None)).status == "info"


@pytest.mark.unit
@pytest.mark.parametrize("version,want", [
    ("2.15.0", "torch 2.15.0 pins NCCL 2.30.7: install hpct's drop-in wheel of it (hpct-build build "
               "nccl=2.30.7 --cuda-arch <your GPUs> && hpct-build wheel nccl=2.30.7"),
    ("2.14.1", "torch 2.14.1 pins NCCL 2.30.7: install hpct's drop-in wheel of it"),
    ("2.11.0", "torch 2.11.0 pins an NCCL hpct has no series for: build hpct's 2.30.7 (hpct-build build "
               "nccl=2.30.7 --cuda-arch <your GPUs>) and set HPCT_NCCL_LIBRARY to its lib/libnccl.so.2"),
])
def test_nccl_advice_follows_the_cuda_torch(good, real_nccl, version, want):
    probe = with_(good, nccl_paths=[real_nccl])          # NVIDIA's stock libnccl: no rootless call
    row = doctor_nccl.check_nccl_for_hpct(probe, fake_torch(version=version, cuda="13.0"))
    assert row.status == "warn" and row.fix.startswith(want), row.fix


@pytest.mark.unit
def test_nccl_for_hpct_bad_variable_fails_on_cuda(good, real_nccl, tmp_path):
    missing = str(tmp_path / "no" / "libnccl.so.2")
    probe = with_(good, nccl_paths=[real_nccl], env={**good.env, "HPCT_NCCL_LIBRARY": missing})
    row = doctor_nccl.check_nccl_for_hpct(probe, fake_torch())
    assert row.status == "fail" and f"hpct: {missing}: " in row.detail
    assert row.fix == "point HPCT_NCCL_LIBRARY at a working libnccl.so.2"


@pytest.mark.unit
def test_live_doctor_json_has_the_nccl_fields():
    proc = run_cli("hpct", "doctor", "--json", timeout=180,
                   env={k: "" for k in os.environ if k.startswith("HPCT_")})
    doc = json.loads(proc.stdout)
    assert doc["schema_version"] == 1 and set(doc["nccl"]) == {"torch", "hpct", "torch_pin"}
    assert "nccl for hpct" in [c["check"] for c in doc["checks"]]


@pytest.mark.unit
def test_nccl_wheel_row_for_torch_2_14_1s_cu13_wheel(tmp_path):
    record = {"series_id": "n13", "patches": ["0001-init.patch", "0002-bootstrap.patch"], "cuda": "13.0",
              "cuda_archs": ["90"], "funcs": None}
    hpct = _nccl_site(tmp_path / "hpct", "2.30.7+hpct.n13", record, cuda="cu13")
    assert doctor_nccl.check_nccl_wheel(Probe(sys_path=[str(hpct)])) == [Row(
        "nccl wheel", "ok", f"nvidia-nccl-cu13 2.30.7+hpct.n13 in {hpct}: hpct series n13, 2 patches "
                            "(0001-init.patch, 0002-bootstrap.patch), CUDA 13.0, sm 90, collectives all")]
    stock = _nccl_site(tmp_path / "stock", "2.30.7", None, cuda="cu13")
    assert doctor_nccl.check_nccl_wheel(Probe(sys_path=[str(stock)])) == [Row(
        "nccl wheel", "info", f"nvidia-nccl-cu13 2.30.7 in {stock}: NVIDIA's build, no hpct series")]


@pytest.mark.unit
def test_every_libnccl_row_follows_the_installed_torch(good, real_nccl):
    """Issue 41: on PyPI's torch 2.15.0 (which pins NCCL 2.30.7, cu13) the libnccl row told the fix
    for torch 2.6 (nvidia-nccl-cu12, nccl-2.21.5-1.tar.gz) while the nccl-for-hpct row rightly named
    the 2.30.7 drop-in: both rows now give the same advice, the one for the installed torch."""
    torch = fake_torch(version="2.15.0+cu130", cuda="13.0")
    stock = check_nccl(with_(good, nccl_paths=[real_nccl]), torch, None)
    hpct_row = doctor_nccl.check_nccl_for_hpct(with_(good, nccl_paths=[real_nccl]), torch)
    assert stock.fix == hpct_row.fix and "torch 2.15.0+cu130 pins NCCL 2.30.7" in stock.fix
    assert "2.21.5" not in stock.fix and "cu12" not in stock.fix
    missing = check_nccl(with_(good, nccl_paths=[]), torch, None)
    assert missing.fix.endswith("install --no-deps nvidia-nccl-cu13==2.30.7")
    patched = check_nccl(with_(good, nccl_paths=[real_nccl]), fake_torch(), None)     # hpct's torch 2.6.0
    assert "nccl-2.21.5-1.tar.gz" in patched.fix


@pytest.mark.unit
def test_the_drop_in_wheel_names_are_the_nccl_manifests():
    import tomllib
    from hpct.requirements import NCCL_DROP_IN, NCCL_WHEEL
    pins = {p["version"]: p["wheel"] for p in tomllib.loads((REPO / "third_party" / "nccl.toml").read_text())["pins"]}
    assert NCCL_WHEEL == pins and set(NCCL_DROP_IN.values()) <= set(pins)
