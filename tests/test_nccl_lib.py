"""The NCCL binding (hpct.distributed.nccl.library) and the engine's CPU-side behaviour, on the real
library: NVIDIA's nvidia-nccl-cu12==2.21.5 wheel (unzipped from ~/.cache/hpct into a temp dir),
and hpct's patched build when HPCT_NCCL_LIBRARY (or third_party/build) names one.  No GPU and no
fake NCCL: what needs a device is in tests/gpu (ci/gpu.sh)."""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpct.config import Config
from hpct.errors import HpctArgumentError, HpctError, TransportError
from hpct.distributed.nccl import engine as nccl_engine, find as nccl_find, library as nccl_lib, plan as nccl_plan
from util import REPO

pytestmark = pytest.mark.unit
STOCK_PIN = "2.21.5"


@pytest.fixture(scope="session")
def stock_nccl(tmp_path_factory) -> str:
    """libnccl.so.2 of NVIDIA's wheel, unzipped into a temp dir (the wheel is fetched once)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpct"
    wheels = glob.glob(str(cache / f"nvidia_nccl_cu12-{STOCK_PIN}-*.whl"))
    if not wheels:
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                            f"nvidia-nccl-cu12=={STOCK_PIN}", "-d", str(cache)],
                           check=True, timeout=600, capture_output=True)
        except (subprocess.SubprocessError, OSError) as err:
            pytest.skip(f"nvidia-nccl-cu12=={STOCK_PIN} cannot be obtained ({type(err).__name__})")
        wheels = glob.glob(str(cache / f"nvidia_nccl_cu12-{STOCK_PIN}-*.whl"))
    out = tmp_path_factory.mktemp("stock-nccl")
    with zipfile.ZipFile(wheels[0]) as whl:
        whl.extract("nvidia/nccl/lib/libnccl.so.2", out)
    return str(out / "nvidia" / "nccl" / "lib" / "libnccl.so.2")


@pytest.fixture(scope="session")
def patched_nccl() -> str:
    """hpct's patched libnccl: HPCT_NCCL_LIBRARY, else a tree built by hpct-build build nccl."""
    given = os.environ.get(nccl_lib.LIBRARY_VAR, "")
    if given:
        return given
    built = nccl_find.built_libraries(REPO)
    if not built:
        pytest.skip("no patched libnccl: set HPCT_NCCL_LIBRARY, or build one (python -m hpct.builder "
                    "build nccl) so that third_party/build/nccl-<ver>/install/lib/libnccl.so.2 exists")
    # Newest first; one whose CUDA runtime this machine lacks (libcudart.so.12 for 2.21.5 where
    # only CUDA 13 is installed) cannot be loaded here, and says so.
    why = []
    for path in reversed(built):
        try:
            nccl_lib.NcclLibrary(path, how="built")
            return path
        except nccl_lib.NcclLibraryError as err:
            why.append(str(err).splitlines()[0])
    pytest.skip("no built libnccl loads on this machine: " + "; ".join(why))


# ---------------------------------------------------------------- the stock library
def test_stock_library_loads_with_its_version_and_no_rootless_call(stock_nccl):
    lib = nccl_lib.NcclLibrary(stock_nccl, how="test")
    assert (lib.version, lib.version_text) == (22105, "2.21.5")
    assert lib.has("ncclAllReduce") and lib.has("ncclCommGetAsyncError") and lib.has("ncclSend")
    assert not lib.has_rootless
    assert not lib.has_revoke          # ncclCommRevoke is 2.28+
    assert "hpct" not in repr(lib) and "rootless=no" in repr(lib)
    # The native launch's functions, resolved once, are the library's own exports.
    table = lib.addresses()
    assert table["ncclAllReduce"] == ctypes.cast(lib._dll.ncclAllReduce, ctypes.c_void_p).value
    assert {k for k, v in table.items() if v} == {"ncclGroupStart", "ncclGroupEnd", *nccl_lib.OP_FUNCTIONS.values()}


def test_stock_library_without_rootless_call_gives_the_fix(stock_nccl):
    lib = nccl_lib.NcclLibrary(stock_nccl, how="test")
    with pytest.raises(nccl_lib.NcclRootlessMissingError) as info:
        lib.require_rootless()
    text = str(info.value)
    assert text.startswith(f"this libnccl has no ncclCommInitRankRootless: {stock_nccl} (test, NCCL 2.21.5)")
    assert "install hpct's nvidia-nccl wheel (hpct-build wheel nccl) or set HPCT_NCCL_LIBRARY" in text
    assert isinstance(info.value, TransportError)
    spec = nccl_lib.RootlessSpec("127.0.0.1:12008", "127.0.0.1:12009", 1, 0, 0, 1000)
    with pytest.raises(nccl_lib.NcclRootlessMissingError):
        lib.comm_init_rootless(2, 0, spec)
    with pytest.raises(nccl_lib.NcclLibraryError, match="has no ncclCommRevoke"):
        lib.revoke(None)


def test_error_codes_become_typed_errors_with_ncclGetErrorString(stock_nccl):
    lib = nccl_lib.NcclLibrary(stock_nccl)
    err = lib.error(6, "ncclAllReduce")
    assert type(err) is nccl_lib.NcclRemoteError and err.code == 6
    assert str(err) == ("ncclAllReduce: NCCL remote process exited or there was a network error "
                        "(ncclRemoteError, 6)")
    assert isinstance(lib.error(3, "x"), nccl_lib.NcclInternalError)
    assert type(lib.error(42, "x")) is nccl_lib.NcclError
    assert lib.check(0, "ok") == 0 and lib.check(7, "ok", allow_in_progress=True) == 7
    with pytest.raises(nccl_lib.NcclInProgressError):
        lib.check(7, "x")
    # A real call that fails: ncclCommGetAsyncError on a null communicator is an invalid argument.
    with pytest.raises(nccl_lib.NcclInvalidArgumentError, match=r"ncclCommGetAsyncError: NCCL .*\(ncclInvalidArgument, 4\)"):
        lib.async_error(None)
    assert issubclass(nccl_lib.NcclError, TransportError) and issubclass(nccl_lib.NcclError, HpctError)


def test_a_copy_outside_torch_is_loaded_local_and_not_taken_for_torchs(stock_nccl):
    nccl_lib.NcclLibrary(stock_nccl)
    # hpct's own copy never counts as "the libnccl torch loaded" ...
    assert nccl_find.torch_loaded_libnccl() is None or \
        os.path.realpath(nccl_find.torch_loaded_libnccl()) != os.path.realpath(stock_nccl)
    # ... and its symbols stay local (RTLD_LOCAL): the process's global scope cannot see them.
    import ctypes
    assert not hasattr(ctypes.CDLL(None), "ncclCommInitRankConfig")


def test_choose_order(stock_nccl, tmp_path):
    site = tmp_path / "site"
    (site / "nvidia" / "nccl" / "lib").mkdir(parents=True)
    os.symlink(stock_nccl, site / "nvidia" / "nccl" / "lib" / "libnccl.so.2")
    wheel_lib = str(site / "nvidia/nccl/lib/libnccl.so.2")
    # nothing loaded, no variable: an nvidia wheel on sys.path
    assert nccl_find.choose({}, loaded="", sys_path=[str(site)]) == (wheel_lib, "nvidia-nccl wheel", False)
    # the variable wins over a wheel
    assert nccl_find.choose({"HPCT_NCCL_LIBRARY": "/x/libnccl.so.2"}, loaded="", sys_path=[str(site)]) == \
        ("/x/libnccl.so.2", "HPCT_NCCL_LIBRARY", False)
    # torch's stock copy (no rootless call) loses to the variable, is used without it
    assert nccl_find.choose({"HPCT_NCCL_LIBRARY": "/x/libnccl.so.2"}, loaded=stock_nccl)[1] == "HPCT_NCCL_LIBRARY"
    assert nccl_find.choose({}, loaded=stock_nccl) == (stock_nccl, "loaded by torch", True)
    with pytest.raises(nccl_lib.NcclLibraryError, match="no libnccl found") as info:
        nccl_find.choose({}, loaded="", sys_path=[str(tmp_path / "empty")])
    assert "HPCT_NCCL_LIBRARY" in info.value.fix


def test_bad_library_variable_paths(tmp_path):
    missing = tmp_path / "nope" / "libnccl.so.2"
    with pytest.raises(nccl_lib.NcclLibraryError) as info:
        nccl_find.load({"HPCT_NCCL_LIBRARY": str(missing)})
    assert str(info.value).startswith(f"libnccl {missing} (HPCT_NCCL_LIBRARY): no such file")
    junk = tmp_path / "libnccl.so.2"
    junk.write_bytes(b"not an ELF file")
    with pytest.raises(nccl_lib.NcclLibraryError, match=rf"libnccl {junk} \(HPCT_NCCL_LIBRARY\) cannot be loaded"):
        nccl_find.load({"HPCT_NCCL_LIBRARY": str(junk)})
    libm = glob.glob("/lib/x86_64-linux-gnu/libm.so.6") + glob.glob("/usr/lib64/libm.so.6")
    if libm:   # a real shared library that is not NCCL
        with pytest.raises(nccl_lib.NcclLibraryError, match="is not a usable libnccl: it lacks ncclGetVersion"):
            nccl_lib.NcclLibrary(libm[0])


def test_load_through_the_variable_requires_the_rootless_call(stock_nccl):
    with pytest.raises(nccl_lib.NcclRootlessMissingError, match="this libnccl has no ncclCommInitRankRootless"):
        nccl_find.load({"HPCT_NCCL_LIBRARY": stock_nccl})
    lib = nccl_find.load({"HPCT_NCCL_LIBRARY": stock_nccl}, require_rootless=False)
    assert lib.how == "HPCT_NCCL_LIBRARY" and lib.version == 22105


# ---------------------------------------------------------------- mapping
@pytest.mark.parametrize("dtype,code", [(torch.float32, 7), (torch.float16, 6), (torch.bfloat16, 9),
                                        (torch.float64, 8), (torch.int8, 0), (torch.uint8, 1),
                                        (torch.bool, 1), (torch.int32, 2), (torch.int64, 4),
                                        (torch.float8_e4m3fn, 10), (torch.float8_e5m2, 11)])
def test_dtype_mapping(dtype, code):
    assert nccl_lib.nccl_dtype(dtype, 22400) == code
    if dtype.is_floating_point and dtype.itemsize == 1:
        with pytest.raises(HpctArgumentError, match="needs NCCL 2.24 or newer"):
            nccl_lib.nccl_dtype(dtype, 22105)       # 2.21.5 has ten types: no float8
    else:
        assert nccl_lib.nccl_dtype(dtype, 22105) == code


def test_dtype_mapping_errors():
    with pytest.raises(HpctArgumentError, match=r"NCCL has no data type for torch.complex64") as info:
        nccl_lib.nccl_dtype(torch.complex64)
    assert "view_as_real" in info.value.fix
    with pytest.raises(HpctArgumentError, match="NCCL has no data type for torch.int16"):
        nccl_lib.nccl_dtype(torch.int16)
    with pytest.raises(HpctArgumentError, match=r"torch.float8_e4m3fn needs NCCL 2.24 or newer \(this libnccl is 2.23.4\)"):
        nccl_lib.nccl_dtype(torch.float8_e4m3fn, 22304)
    assert nccl_lib.nccl_dtype(torch.float8_e5m2, 22400) == 11


def test_reduce_op_mapping():
    R = dist.ReduceOp
    assert [nccl_lib.nccl_op(op) for op in (R.SUM, R.PRODUCT, R.MAX, R.MIN, R.AVG)] == [0, 1, 2, 3, 4]
    # bool as ProcessGroupNCCL: sum is "any" (max), product is "all" (min)
    assert nccl_lib.nccl_op(R.SUM, torch.bool) == 2 and nccl_lib.nccl_op(R.PRODUCT, torch.bool) == 3
    with pytest.raises(HpctArgumentError, match="ReduceOp.AVG is not supported for torch.bool"):
        nccl_lib.nccl_op(R.AVG, torch.bool)
    for op in (R.BAND, R.BOR, R.BXOR):
        with pytest.raises(HpctArgumentError, match=r"Cannot use ReduceOp\.B(AND|OR|XOR) with NCCL"):
            nccl_lib.nccl_op(op)


def test_rootless_spec_checks_its_fields():
    good = dict(listen_addr="10.0.0.1:12008", next_addr="[fe80::1]:12009", job_key=2 ** 64 - 1,
                generation=3, group_index=1, connect_timeout_ms=10 ** 12, retry_delay_ms=100)
    info = nccl_lib.RootlessSpec(**good).info()
    assert (info.listenAddr, info.nextAddr, info.jobKey, info.generation, info.groupIndex) == \
        (b"10.0.0.1:12008", b"[fe80::1]:12009", 2 ** 64 - 1, 3, 1)
    assert info.connectTimeoutMs == 2 ** 31 - 1 and info.size == 48
    with pytest.raises(HpctArgumentError, match="listen_addr='10.0.0.1' is not a host:port address"):
        nccl_lib.RootlessSpec(**{**good, "listen_addr": "10.0.0.1"}).info()
    with pytest.raises(HpctArgumentError, match="job key -1 does not fit 64 bits"):
        nccl_lib.RootlessSpec(**{**good, "job_key": -1}).info()
    with pytest.raises(HpctArgumentError, match="generation=4294967296 does not fit 32 bits"):
        nccl_lib.RootlessSpec(**{**good, "generation": 2 ** 32}).info()
    assert nccl_lib.make_config(False).blocking == 0 and nccl_lib.make_config(False).magic == 0xCAFEBEEF


# ---------------------------------------------------------------- the engine without a device
def _engine(**kw):
    cfg = Config.from_mapping({"N_PROC_PER_NODE": "2", "HPCT_PORT_BASE": "15000"})
    args = dict(name="0", index=0, slot=1, group_rank=1, global_ranks=[0, 1], generation=4, op_timeout=30.0,
                run_id="job-7")
    args.update(kw)
    return nccl_plan.engine_for_group(cfg, **args), cfg


def test_engine_addresses_follow_the_port_plan():
    eng, cfg = _engine()
    # nccl block starts after the gloo block: 15000 + 8 slots * 2 = 15016; slot 1 -> +2; local rank 1
    assert eng.addresses == ["127.0.0.1:15018", "127.0.0.1:15019"] and eng.listen_addr == "127.0.0.1:15019"
    assert (eng.rank, eng.size, eng.generation, eng.group_index) == (1, 2, 4, 0)
    assert nccl_plan.format_addr("fe80::1", 5) == "[fe80::1]:5"
    assert eng.failure is None and eng.library is None     # nothing loaded before the first op


def test_job_key_agrees_with_the_patched_torch_plan_module():
    path = REPO / "third_party/patched/pytorch-2.6.0/torch/distributed/_hpct_rootless.py"
    if not path.is_file():
        pytest.skip(f"{path} is absent: run `hpct-build patch pytorch` to compare with the patched torch")
    spec = importlib.util.spec_from_file_location("_hpct_rootless_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(spec.name, None)
    env = {"N_PROC_PER_NODE": "2", "HPCT_PORT_BASE": "15000", "HPCT_HOSTS": "10.0.0.1,10.0.0.2",
           "TORCHELASTIC_RUN_ID": "job-7"}
    plan = mod.load_plan(env)
    cfg = Config.from_mapping({k: v for k, v in env.items() if k != "TORCHELASTIC_RUN_ID"})
    assert nccl_plan.job_key(cfg, "job-7") == mod.job_key(plan, env)
    theirs = mod.nccl_setup(plan, 1, 2, [0, 2, 3], 4, env)
    ours = nccl_plan.nccl_addresses(cfg, 1, [0, 2, 3])
    assert (theirs.listen_addr, theirs.next_addr) == (ours[2], ours[0])


def test_engine_refuses_without_a_cuda_device():
    if torch.cuda.is_available():
        pytest.skip("this process sees a CUDA device")
    eng, _ = _engine()
    with pytest.raises(nccl_lib.NoCudaDeviceError) as info:
        eng.allreduce([torch.ones(2)], dist.ReduceOp.SUM)
    assert str(info.value).startswith("hpct NCCL allreduce: no CUDA device is visible to this process")
    with pytest.raises(nccl_lib.NoCudaDeviceError, match="hpct NCCL barrier: no CUDA device"):
        eng.barrier()
    assert eng.failure is None and eng.library is None   # a refused call loads nothing, fails nothing


def test_engine_checks_its_arguments():
    with pytest.raises(HpctArgumentError, match="listen address 127.0.0.1:1 is not addresses"):
        nccl_engine.NcclEngine(rank=0, size=2, global_ranks=[0, 1], generation=0, group_index=0,
                               group_name="0", listen_addr="127.0.0.1:1", addresses=["a:1", "a:2"],
                               job_key=1, connect_timeout=1, op_timeout=1)
    with pytest.raises(HpctArgumentError, match="rank 2, size 2"):
        nccl_engine.NcclEngine(rank=2, size=2, global_ranks=[0, 1], generation=0, group_index=0,
                               group_name="0", listen_addr="a:1", addresses=["a:1", "a:2"],
                               job_key=1, connect_timeout=1, op_timeout=1)


def test_engine_abort_before_any_op_fails_later_ops_with_names():
    eng, _ = _engine()
    eng.abort("test says so")
    err = eng.failure
    assert isinstance(err, nccl_engine.NcclAbortedError)
    assert str(err).startswith("hpct NCCL op failed on group 0 (rank 1 of 2, global rank 1, generation 4): "
                               "aborted: test says so")
    eng.shutdown(1.0)     # bounded, nothing to release


# ---------------------------------------------------------------- hpct's patched library
def test_patched_library_has_the_rootless_calls(patched_nccl):
    lib = nccl_lib.NcclLibrary(patched_nccl, how="HPCT_NCCL_LIBRARY")
    lib.require_rootless()
    assert lib.has_rootless and lib.version >= 22105
    assert lib.has_revoke == (lib.version >= 22807)
    spec = nccl_lib.RootlessSpec("127.0.0.1:15016", "127.0.0.1:15017", 99, 2, 0, 1000)
    a = lib.rootless_unique_id(spec, 2)
    assert len(a) == 128 and a == lib.rootless_unique_id(spec, 2)
    assert a != lib.rootless_unique_id(nccl_lib.RootlessSpec("127.0.0.1:15016", "127.0.0.1:15017", 99, 3, 0,
                                                             1000), 2)


# ---------------------------------------------------------------- ci/gpu.sh's CPU-side preflight
def test_gpu_script_preflight_refuses_without_a_cuda_device():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: run ci/gpu.sh itself")
    done = subprocess.run(["bash", str(REPO / "ci" / "gpu.sh"), "--preflight"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 3, done.stderr
    assert ("is a CPU build: no CUDA device can be used" in done.stderr
            or "no CUDA device is visible" in done.stderr), done.stderr
    bad = subprocess.run(["bash", str(REPO / "ci" / "gpu.sh"), "--bogus"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "unknown argument '--bogus'" in bad.stderr
