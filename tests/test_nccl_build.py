"""hpct-build build nccl / wheel nccl, the CUDA toolchain, and the wheel replacing torch's NCCL.

Two tiers.  Everything but the last section runs without NCCL's source and without a
GPU (CI): option checks, toolchain failures, CUDA headers from PyPI wheels, and the
wheel built from a stand-in libnccl compiled here.  The integration tier builds the
real, patched NCCL (SendRecv only, ~2 min on 2 cores) and skips unless its source is
handed over (HPCT_NCCL_SOURCE=<tarball or tree>, or `hpct-build fetch nccl --source`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hpct.builder import cuda
from hpct.builder.layout import Layout
from hpct.builder.progress import Progress
from hpct.elf import manylinux_tag, read_elf
from hpct.errors import ChecksumError, ConfigError, ToolchainError
import nccl_prebuild
from nccl_prebuild import OFFLINE
from util import REPO, run_cli

SERIES = "0123456789abcdef"
VERSION = nccl_prebuild.OLD


def build(root: Path, *args: str, env: dict | None = None, timeout: float = 300):
    return run_cli("hpct-build", "build", "nccl", "--root", str(root), *args,
                   env={**OFFLINE, **(env or {})}, timeout=timeout)


# ---------------------------------------------------------------- options

@pytest.mark.unit
def test_unknown_cuda_version_names_the_known_ones(scratch_root):
    proc = build(scratch_root, "--cuda", "11.8")
    assert proc.returncode == 2, proc.stderr
    assert "unknown CUDA version '11.8'" in proc.stderr
    assert "fix: pass --cuda with one of: 12.4, 12.8, 13.0" in proc.stderr


@pytest.mark.unit
def test_each_pin_builds_with_its_own_cuda_and_runpath():
    from hpct.builder.layout import Layout
    from hpct.builder.nccl import runpath_of
    from hpct.builder.sources import load_manifest
    old, new = (load_manifest(Layout(REPO), "nccl", v) for v in ("2.21.5", "2.30.7"))
    assert (old.extra["cuda"], runpath_of(old)) == ("12.4", "$ORIGIN/../../cuda_runtime/lib")
    assert (new.extra["cuda"], runpath_of(new)) == ("13.0", "$ORIGIN/../../cu13/lib")


@pytest.mark.unit
def test_the_glibc_floor_wraps_what_libnccl_needs_above_2_28():
    from hpct.builder.nccl import GLIBC_FLOOR, glibc_floor_wraps, ldflags
    wraps = glibc_floor_wraps(REPO / GLIBC_FLOOR)
    # Measured on 2.30.7 built on glibc 2.36: GLIBC_2.34 pthread/sem/shm/dl*, 2.29 exp/log2,
    # 2.33 stat, 2.32 __libc_single_threaded; libstdc++.a adds fstat64, arc4random, clockwait.
    for name in ("pthread_create", "sem_timedwait", "shm_open", "dlopen", "exp", "log2", "stat",
                 "__libc_single_threaded", "fstat64", "arc4random", "pthread_cond_clockwait", "__pthread_key_create"):
        assert name in wraps, name
    flags = ldflags("$ORIGIN/x", Path("/o/floor.o"), wraps)
    assert flags.startswith("-Wl,-rpath,'$$ORIGIN/x' -static-libstdc++ -Wl,--wrap=")
    assert flags.endswith(" /o/floor.o")


@pytest.mark.unit
@pytest.mark.parametrize("value, needle", [
    ("85,90", "bad --cuda-arch '85' in '85,90' for CUDA 12.4"),
    ("8.0;9.0", "bad --cuda-arch '8.0', '9.0' in '8.0;9.0'"),
    ("abc", "bad --cuda-arch 'abc'"),
    (",", "bad --cuda-arch ','"),
])
def test_bad_cuda_arch(scratch_root, value, needle):
    proc = build(scratch_root, "--cuda-arch", value)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert "e.g. 80,90; CUDA 12.4 knows 50,52" in proc.stderr


@pytest.mark.unit
def test_cuda_arch_becomes_gencode_flags():
    from hpct.builder.nccl import gencode, parse_archs
    assert parse_archs("90, 80,sm_90", "12.4") == ["90", "80"]
    assert parse_archs(None, "12.4") == ["80", "90"]
    assert gencode(["80", "90"]) == ("-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90 "
                                     "-gencode=arch=compute_90,code=compute_90")
    assert parse_archs("100", "12.8") == ["100"]
    with pytest.raises(ConfigError, match="bad --cuda-arch '100'"):
        parse_archs("100", "12.4")


@pytest.mark.unit
def test_bad_funcs(scratch_root):
    proc = build(scratch_root, "--funcs", "SendRecv|AlReduce Sum f32 * *")
    assert proc.returncode == 2, proc.stderr
    assert "bad --funcs entry 'AlReduce Sum f32 * *'" in proc.stderr
    assert "ReduceScatter, SendRecv" in proc.stderr


@pytest.mark.unit
def test_nccl_options_are_refused_for_other_components(scratch_root):
    proc = run_cli("hpct-build", "build", "gloo", "--funcs", "SendRecv", "--root", str(scratch_root))
    assert proc.returncode == 2
    assert "--funcs apply to `build nccl` only (not gloo)" in proc.stderr
    proc = run_cli("hpct-build", "build", "gloo", "--cuda", "12.4", "--root", str(scratch_root))
    assert proc.returncode == 2
    assert "--cuda apply to `build pytorch or nccl` only (not gloo)" in proc.stderr


# ---------------------------------------------------------------- source and toolchain failures

@pytest.mark.unit
def test_build_without_source_names_the_variable(scratch_root):
    proc = build(scratch_root, "--funcs", "SendRecv")
    assert proc.returncode == 3, proc.stderr
    assert "no provider could supply nccl 2.21.5" in proc.stderr
    assert "HPCT_NCCL_SOURCE=PATH" in proc.stderr and "--source PATH" in proc.stderr


def fake_nvcc(tmp_path: Path, release: str) -> Path:
    home = tmp_path / f"cuda-{release}"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    return home


@pytest.mark.unit
def test_cuda_home_with_another_release_is_refused(scratch_root, tmp_path):
    home = fake_nvcc(tmp_path, "12.8")
    proc = build(scratch_root, "--funcs", "SendRecv", env={"CUDA_HOME": str(home)})
    assert proc.returncode == 6, proc.stderr
    assert f"CUDA_HOME={home}: {home}/bin/nvcc reports release 12.8, the build asks for CUDA 12.4" in proc.stderr
    assert "unset CUDA_HOME to let hpct-build assemble CUDA 12.4 itself, or pass --cuda 12.8" in proc.stderr


@pytest.mark.unit
def test_cuda_home_without_nvcc_is_refused(scratch_root, tmp_path):
    proc = build(scratch_root, env={"CUDA_HOME": str(tmp_path)})
    assert proc.returncode == 6, proc.stderr
    assert f"{tmp_path}/bin/nvcc is missing or does not run" in proc.stderr


@pytest.mark.unit
def test_cuda_home_with_the_right_release_is_used(tmp_path, monkeypatch):
    home = fake_nvcc(tmp_path, "12.8")
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert cuda.cuda_toolchain(Layout(tmp_path), "12.8", Progress(quiet=True)) == home


@pytest.mark.unit
def test_cuda_without_a_debian_package_needs_cuda_home(scratch_root):
    proc = build(scratch_root, "--cuda", "12.8")
    assert proc.returncode == 6, proc.stderr
    assert "no CUDA 12.8 toolchain: CUDA_HOME is not set and no Debian package carries CUDA 12.8" in proc.stderr
    assert "set CUDA_HOME to a CUDA 12.8 install (bin/nvcc reporting release 12.8), or pass --cuda 12.4" \
        in proc.stderr


@pytest.mark.unit
def test_unreachable_debian_archive_names_what_was_tried(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))     # no download kept by earlier runs
    monkeypatch.setenv(cuda.APT_URI_ENV, "http://127.0.0.1:1/debian")
    with pytest.raises(ToolchainError) as err:
        cuda.cuda_toolchain(Layout(tmp_path), "12.4", Progress(quiet=True))
    assert err.value.exit_code == 6
    assert err.value.problem.startswith(
        "no CUDA 12.4 toolchain: CUDA_HOME is not set and apt-get could not download "
        "nvidia-cuda-toolkit==12.4.131~12.4.1-2 from http://127.0.0.1:1/debian trixie non-free: ")
    assert err.value.fix.startswith("set CUDA_HOME to a CUDA 12.4 install")
    assert f"set {cuda.APT_URI_ENV} to a Debian mirror" in err.value.fix
    # The machine's own APT configuration was not touched: the private one lives in the cache.
    assert (tmp_path / "third_party" / "cache" / "apt" / "sources.list").read_text() == (
        "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://127.0.0.1:1/debian trixie non-free\n")
    assert not (tmp_path / "third_party" / "cache" / "cuda-12.4" / "toolchain").exists()
    assert not list((tmp_path / "third_party" / "cache" / "cuda-12.4" / "debs").iterdir())


# ---------------------------------------------------------------- CUDA headers from PyPI wheels

@pytest.mark.unit
def test_unknown_cuda_for_headers():
    with pytest.raises(ConfigError, match=r"unknown CUDA version '11.8'") as err:
        cuda.cuda_headers(Layout(REPO), "11.8", Progress(quiet=True))
    assert "12.4, 12.8" in err.value.fix


@pytest.mark.unit
def test_pip_failure_is_a_toolchain_error(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))     # no download kept by earlier runs
    for name, value in {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:1/simple",
                        "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "5"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ToolchainError, match=r"could not download nvidia-cuda-runtime-cu12==12.4.127 with pip") \
            as err:
        cuda.cuda_headers(Layout(tmp_path), "12.4", Progress(quiet=True))
    assert "PIP_INDEX_URL" in err.value.fix and "CUDA_HOME" in err.value.fix
    assert not (tmp_path / "third_party" / "cache" / "cuda-12.4" / "include").exists()


@pytest.mark.unit
def test_a_wheel_with_another_sha256_is_deleted(tmp_path):
    wheels = tmp_path / "third_party" / "cache" / "cuda-12.4" / "wheels"
    wheels.mkdir(parents=True)
    bad = wheels / "nvidia_cuda_runtime_cu12-12.4.127-py3-none-manylinux2014_x86_64.whl"
    bad.write_bytes(b"not the pinned wheel")
    with pytest.raises(ChecksumError, match="pinned 64403288fa21"):
        cuda.cuda_headers(Layout(tmp_path), "12.4", Progress(quiet=True))
    assert not bad.exists()


@pytest.fixture(scope="session")
def cuda_include() -> Path:
    """CUDA 12.4 headers from the pinned wheels, cached in the real checkout (PyPI once)."""
    return cuda.cuda_headers(Layout(REPO), "12.4", Progress(quiet=True))


@pytest.mark.unit
def test_cuda_headers_compile_with_gxx(cuda_include, tmp_path):
    cxx = shutil.which("g++") or pytest.fail("g++ is missing: apt-get install g++")
    src = tmp_path / "t.cc"
    src.write_text("#include <cuda_runtime.h>\n#include <cuda.h>\n#include <cuda_fp16.h>\n"
                   "#include <cuda_bf16.h>\n"
                   "int main() { cudaStream_t s = nullptr; CUdevice d = 0; __half h; __nv_bfloat16 b;\n"
                   "  (void)s; (void)d; (void)h; (void)b; return CUDART_VERSION == 12040 ? 0 : 1; }\n")
    proc = subprocess.run([cxx, "-fsyntax-only", f"-I{cuda_include}", str(src)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    stamp = json.loads((cuda_include / cuda.STAMP).read_text())
    assert stamp["cuda"] == "12.4"
    assert [w[:2] for w in stamp["pins"]["wheels"]] == [[p, v] for p, v, _ in cuda.CUDA_PINS["12.4"]["wheels"]]
    # Without any of the three wheels' parts the same file does not compile: each is needed.
    for part in ("crt", "nv", "cuda_runtime.h"):
        partial = tmp_path / f"without-{part}"
        shutil.copytree(cuda_include, partial)
        (shutil.rmtree if (partial / part).is_dir() else os.unlink)(partial / part)
        proc = subprocess.run([cxx, "-fsyntax-only", f"-I{partial}", str(src)], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode != 0, part


# ---------------------------------------------------------------- wheel nccl from a stand-in library

def stand_in_prefix(tmp_path: Path, series: str = SERIES, rootless: bool = True, floor: bool = True) -> Path:
    """An install prefix shaped like `build nccl`'s, around a tiny libnccl.so.2 built here; with
    ``floor``, linked with the glibc floor as `build nccl` links the real one."""
    cxx = shutil.which("g++") or pytest.fail("g++ is missing: apt-get install g++")
    prefix = tmp_path / "prefix"
    (prefix / "lib").mkdir(parents=True)
    (prefix / "include").mkdir()
    src = tmp_path / "nccl_stub.cc"
    # pthread_create: glibc >= 2.34 versions it GLIBC_2.34, as the real build's library is.
    src.write_text("#include <pthread.h>\nextern \"C\" {\n"
                   "int ncclGetVersion(int* v) { *v = 22105; return 0; }\n"
                   + ("int ncclCommInitRankRootless(void**, int, int, const void*, void*) { return 0; }\n"
                      if rootless else "")
                   + "void* hpctTouch(void*(*f)(void*)) { pthread_t t; pthread_create(&t, 0, f, 0); return 0; }\n}\n")
    lib = prefix / "lib" / "libnccl.so.2.21.5"
    cmd = [cxx, "-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", "-o", str(lib), str(src)]
    if floor:
        from hpct.builder.nccl import GLIBC_FLOOR, glibc_floor_wraps
        obj = tmp_path / "floor.o"
        subprocess.run([shutil.which("cc") or cxx, "-O2", "-fPIC", "-c", str(REPO / GLIBC_FLOOR), "-o", str(obj)],
                       check=True, timeout=120, capture_output=True)
        cmd += [f"-Wl,--wrap={name}" for name in glibc_floor_wraps(REPO / GLIBC_FLOOR)] + [str(obj)]
    subprocess.run(cmd + ["-lpthread"], check=True, timeout=120, capture_output=True)
    os.symlink(lib.name, prefix / "lib" / "libnccl.so.2")
    os.symlink("libnccl.so.2", prefix / "lib" / "libnccl.so")
    (prefix / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 21\n#define NCCL_PATCH 5\n")
    (prefix / "include" / "nccl_net.h").write_text("/* stand-in */\n")
    if rootless:
        (prefix / "include" / "nccl_rootless.h").write_text("/* stand-in */\n")
    (prefix / "LICENSE.txt").write_text("stand-in license\n")
    (prefix / "hpct-series.json").write_text(json.dumps({
        "name": "nccl", "version": VERSION, "series_id": series, "patches": ["0001-a.patch", "0002-b.patch"],
        "cuda": "12.4", "cuda_archs": ["80", "90"], "funcs": "SendRecv"}))
    return prefix


def wheel_nccl(root: Path, *args: str):
    return run_cli("hpct-build", "wheel", "nccl", "--root", str(root), *args, timeout=300)


@pytest.fixture
def stand_in_wheel(scratch_root, tmp_path) -> Path:
    prefix = stand_in_prefix(tmp_path)
    proc = wheel_nccl(scratch_root, "--prefix", str(prefix), "--dist", str(tmp_path / "dist"))
    assert proc.returncode == 0, proc.stderr
    wheel = Path(proc.stdout.strip().splitlines()[-1])
    assert wheel.parent == tmp_path / "dist"
    return wheel


@pytest.mark.unit
def test_wheel_name_layout_metadata_and_record(stand_in_wheel, tmp_path):
    lib = tmp_path / "prefix" / "lib" / "libnccl.so.2"
    tag = manylinux_tag(read_elf(lib))
    # Linked with the glibc floor (as `build nccl` links the real library): manylinux_2_28 at most,
    # although this machine's glibc versions pthread_create GLIBC_2.34.
    assert tuple(int(x) for x in tag.split("_")[1:3]) <= (2, 28), tag
    assert stand_in_wheel.name == f"nvidia_nccl_cu12-{VERSION}+hpct.{SERIES}-py3-none-{tag}.whl"
    info = f"nvidia_nccl_cu12-{VERSION}+hpct.{SERIES}.dist-info"
    with zipfile.ZipFile(stand_in_wheel) as z:
        names = z.namelist()
        assert sorted(names) == sorted([
            "nvidia/__init__.py", "nvidia/nccl/__init__.py", "nvidia/nccl/include/__init__.py",
            "nvidia/nccl/lib/__init__.py", "nvidia/nccl/include/nccl.h", "nvidia/nccl/include/nccl_net.h",
            "nvidia/nccl/include/nccl_rootless.h", "nvidia/nccl/lib/libnccl.so.2", "nvidia/nccl/hpct-series.json",
            f"{info}/LICENSE.txt", f"{info}/METADATA", f"{info}/WHEEL", f"{info}/top_level.txt", f"{info}/RECORD"])
        assert z.read("nvidia/nccl/lib/libnccl.so.2") == lib.read_bytes()
        assert (z.getinfo("nvidia/nccl/lib/libnccl.so.2").external_attr >> 16) & 0o777 == 0o755
        meta = z.read(f"{info}/METADATA").decode()
        assert "Name: nvidia-nccl-cu12\n" in meta and f"Version: {VERSION}+hpct.{SERIES}\n" in meta
        assert "Requires-Dist" not in meta       # the stand-in does not link libcudart
        assert f"Tag: py3-none-{tag}\n" in z.read(f"{info}/WHEEL").decode()
        rows = [r.split(",") for r in z.read(f"{info}/RECORD").decode().splitlines()]
        assert sorted(r[0] for r in rows) == sorted(names)
        for name, digest, size in rows:
            if name == f"{info}/RECORD":
                assert (digest, size) == ("", "")
                continue
            data = z.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert (digest, int(size)) == (f"sha256={want}", len(data)), name
        record = json.loads(z.read("nvidia/nccl/hpct-series.json"))
    assert record["schema_version"] == 1
    assert {k: record[k] for k in ("series_id", "patches", "cuda", "cuda_archs", "funcs", "rootless_exports")} == {
        "series_id": SERIES, "patches": ["0001-a.patch", "0002-b.patch"], "cuda": "12.4",
        "cuda_archs": ["80", "90"], "funcs": "SendRecv", "rootless_exports": ["ncclCommInitRankRootless"]}


@pytest.mark.unit
def test_wheel_has_the_layout_of_nvidias(stand_in_wheel):
    stock = stock_wheels() or pytest.skip(STOCK_HINT)
    with zipfile.ZipFile(stock[0]) as z:
        theirs = {n for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")}
    with zipfile.ZipFile(stand_in_wheel) as z:
        ours = {n for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")}
    assert theirs <= ours
    assert ours - theirs == {"nvidia/nccl/include/nccl_rootless.h", "nvidia/nccl/hpct-series.json"}


@pytest.mark.unit
def test_wheel_refuses_a_library_that_needs_a_glibc_newer_than_2_28(scratch_root, tmp_path):
    glibc = tuple(int(x) for x in os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2])
    if glibc < (2, 34):
        pytest.skip(f"glibc {glibc} versions pthread_create below 2.34: no library needing more than 2.28 "
                    "can be linked here")
    prefix = stand_in_prefix(tmp_path, floor=False)
    lib = prefix / "lib" / "libnccl.so.2"
    assert read_elf(lib).max_version("GLIBC") >= (2, 34)
    proc = wheel_nccl(scratch_root, "--prefix", str(prefix), "--dist", str(tmp_path / "dist"))
    assert proc.returncode == 7, proc.stderr
    assert f"{lib} needs GLIBC_2." in proc.stderr
    assert "newer than the manylinux_2_28 the wheel must keep to: " in proc.stderr
    assert "pthread_create@GLIBC_2.34" in proc.stderr      # the symbol that needs it is named
    assert "src/nccl_rootless/glibc_floor.c" in proc.stderr
    assert not list((tmp_path / "dist").glob("*.whl"))


@pytest.mark.unit
def test_wheel_refuses_a_prefix_that_is_not_an_hpct_build(scratch_root, tmp_path):
    proc = wheel_nccl(scratch_root, "--prefix", str(tmp_path))
    assert proc.returncode == 2
    assert f"{tmp_path} is not an NCCL built by hpct-build (no hpct-series.json)" in proc.stderr
    assert "hpct-build build nccl" in proc.stderr
    proc = wheel_nccl(scratch_root)                  # the default prefix: nothing built yet
    assert proc.returncode == 2 and "is not an NCCL built by hpct-build" in proc.stderr


@pytest.mark.unit
def test_wheel_refuses_a_build_of_an_older_series(scratch_root, tmp_path):
    prefix = stand_in_prefix(tmp_path, series="0000000000000000")
    dest = scratch_root / "third_party" / "build" / f"nccl-{VERSION}" / "install"
    dest.parent.mkdir(parents=True)
    shutil.copytree(prefix, dest, symlinks=True)
    proc = wheel_nccl(scratch_root)
    assert proc.returncode == 2
    assert f"was built with series 0000000000000000, patches/nccl/{VERSION} is now" in proc.stderr
    assert "fix: rebuild it: hpct-build build nccl" in proc.stderr


@pytest.mark.unit
def test_wheel_refuses_a_library_without_nccl(scratch_root, tmp_path):
    prefix = stand_in_prefix(tmp_path)
    lib = prefix / "lib" / "libnccl.so.2.21.5"
    lib.write_bytes(b"\x7fELF truncated")
    proc = wheel_nccl(scratch_root, "--prefix", str(prefix), "--dist", str(tmp_path / "dist"))
    assert proc.returncode == 7
    assert "is not a readable shared library" in proc.stderr
    assert not list((tmp_path / "dist").glob("*.whl"))


@pytest.mark.unit
def test_plain_wheel_verb_still_means_hpct(scratch_root):
    proc = run_cli("hpct-build", "wheel", "gloo", "--root", str(scratch_root))
    assert proc.returncode == 2 and "no wheel for 'gloo'" in proc.stderr and "hpct, nccl" in proc.stderr
    proc = run_cli("hpct-build", "wheel", "--prefix", "/x", "--root", str(scratch_root))
    assert proc.returncode == 2 and "--prefix and --dist apply to `wheel nccl` only" in proc.stderr


def stock_wheels() -> list[Path]:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "hpct")
    return sorted(cache.glob(f"nvidia_nccl_cu12-{VERSION}-*.whl"))


STOCK_HINT = (f"nvidia-nccl-cu12=={VERSION} is not in ~/.cache/hpct (ci/setup.sh downloads it: "
              f"{sys.executable} -m pip download --no-deps nvidia-nccl-cu12=={VERSION} -d ~/.cache/hpct)")


@pytest.mark.unit
def test_elf_reader_on_nvidias_library(tmp_path):
    from hpct.elf import ElfError
    if not stock_wheels():
        pytest.skip(STOCK_HINT)
    with zipfile.ZipFile(stock_wheels()[0]) as z:
        z.extract("nvidia/nccl/lib/libnccl.so.2", tmp_path)
    elf = read_elf(tmp_path / "nvidia/nccl/lib/libnccl.so.2")
    assert elf.soname == "libnccl.so.2"
    assert {"ncclGetVersion", "ncclCommInitRank", "pncclCommInitRank"} <= elf.exports
    assert "ncclCommInitRankRootless" not in elf.exports
    assert manylinux_tag(elf) == "manylinux_2_17_x86_64"      # what NVIDIA's wheel is tagged
    (tmp_path / "junk").write_bytes(b"#!/bin/sh\n")
    with pytest.raises(ElfError, match="is not an ELF file"):
        read_elf(tmp_path / "junk")


# ---------------------------------------------------------------- pip and doctor in a fresh venv

def venv(path: Path) -> Path:
    # System site-packages: hpct itself (for doctor) without torch or a resolver run.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(path)], check=True,
                   timeout=300, capture_output=True)
    return path / "bin" / "python"


def pip_install(python: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-index",
                           *args], capture_output=True, text=True, timeout=600)


def doctor_json(python: Path) -> dict:
    proc = subprocess.run([str(python), "-P", "-c", "import sys; from hpct.cli import main; "
                           "sys.exit(main(['doctor', '--json']))"], capture_output=True, text=True,
                          timeout=300, cwd="/", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.stdout.strip(), proc.stderr
    return {row["check"]: row for row in json.loads(proc.stdout)["checks"]}


@pytest.mark.unit
def test_pip_picks_the_wheel_for_torchs_pin_and_doctor_reports_it(stand_in_wheel, tmp_path):
    python = venv(tmp_path / "venv")
    proc = pip_install(python, "--find-links", str(stand_in_wheel.parent), f"nvidia-nccl-cu12=={VERSION}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Successfully installed nvidia-nccl-cu12-{VERSION}+hpct.{SERIES}" in proc.stdout
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    assert (site / "nvidia" / "nccl" / "lib" / "libnccl.so.2").is_file()
    rows = doctor_json(python)
    lib = site / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    assert rows["libnccl"]["detail"] == (f"{lib} (nvidia-nccl wheel): NCCL 2.21.5 (22105), "
                                         "exports ncclCommInitRankRootless")
    assert rows["nccl wheel"]["status"] == "ok"
    assert rows["nccl wheel"]["detail"] == (
        f"nvidia-nccl-cu12 {VERSION}+hpct.{SERIES} in {site}: hpct series {SERIES}, 2 patches "
        "(0001-a.patch, 0002-b.patch), CUDA 12.4, sm 80,90, collectives SendRecv")


@pytest.mark.slow
def test_the_wheel_replaces_nvidias_and_doctor_tells_them_apart(stand_in_wheel, tmp_path):
    stock = stock_wheels() or pytest.skip(STOCK_HINT)
    python = venv(tmp_path / "venv")
    assert pip_install(python, str(stock[0])).returncode == 0
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    rows = doctor_json(python)
    assert rows["nccl wheel"] == {"check": "nccl wheel", "status": "info", "fix": None,
                                  "detail": f"nvidia-nccl-cu12 {VERSION} in {site}: NVIDIA's build, no hpct series"}
    assert rows["libnccl"]["detail"].endswith("stock: no ncclCommInitRankRootless (rootless NCCL start-up unavailable)")
    # torch's requirement nvidia-nccl-cu12==2.21.5 stays satisfied while pip swaps the library.
    proc = pip_install(python, "--find-links", str(stand_in_wheel.parent), f"nvidia-nccl-cu12=={VERSION}",
                       f"nvidia-nccl-cu12=={VERSION}+hpct.{SERIES}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Successfully uninstalled nvidia-nccl-cu12-{VERSION}" in proc.stdout
    rows = doctor_json(python)
    assert rows["nccl wheel"]["status"] == "ok" and f"hpct series {SERIES}" in rows["nccl wheel"]["detail"]
    assert rows["libnccl"]["detail"].endswith("exports ncclCommInitRankRootless")


# ---------------------------------------------------------------- integration: the real NCCL

@pytest.fixture(scope="session")
def real_build() -> Path:
    """NCCL 2.21.5 with the series, SendRecv only (tests/nccl_prebuild.py may have built it
    already: then this only relinks)."""
    return nccl_prebuild.ensure_built(VERSION)


def dynamic_symbols(lib: Path) -> set[str]:
    nm = shutil.which("nm") or pytest.fail("nm is missing: apt-get install binutils")
    out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


@pytest.mark.slow
def test_real_build_exports_the_rootless_entry_point(real_build):
    lib = real_build / "lib" / "libnccl.so.2"
    symbols = dynamic_symbols(lib)
    assert {"ncclGetVersion", "ncclCommInitRank", "ncclCommInitRankRootless"} <= symbols
    elf = read_elf(lib)
    assert elf.soname == "libnccl.so.2" and "libcudart.so.12" in elf.needed_versions
    stamp = json.loads((real_build / "hpct-series.json").read_text())
    assert (stamp["funcs"], stamp["cuda"], stamp["cuda_archs"]) == ("SendRecv", "12.4", ["80", "90"])
    assert (real_build / "include" / "nccl_rootless.h").is_file()


@pytest.mark.slow
def test_real_build_becomes_a_wheel(real_build, tmp_path):
    proc = run_cli("hpct-build", "wheel", "nccl", "--root", str(REPO), "--dist", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr
    wheel = Path(proc.stdout.strip().splitlines()[-1])
    stamp = json.loads((real_build / "hpct-series.json").read_text())
    assert wheel.name.startswith(f"nvidia_nccl_cu12-{VERSION}+hpct.{stamp['series_id']}-py3-none-manylinux_")
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(f"nvidia_nccl_cu12-{VERSION}+hpct.{stamp['series_id']}.dist-info/METADATA").decode()
        record = json.loads(z.read("nvidia/nccl/hpct-series.json"))
        assert "nvidia/nccl/include/nccl_rootless.h" in z.namelist()
    assert "Requires-Dist: nvidia-cuda-runtime-cu12>=12.4" in meta
    assert record["rootless_exports"] == ["ncclCommInitRankRootless", "ncclRootlessUniqueId"]
    out = subprocess.run(["readelf", "-d", str(real_build / "lib" / "libnccl.so.2")], capture_output=True,
                         text=True, timeout=60).stdout
    assert "$ORIGIN/../../cuda_runtime/lib" in out
    # Installed like torch's own NCCL (with the runtime wheel torch also requires), the library
    # loads without LD_PRELOAD or LD_LIBRARY_PATH: its RUNPATH finds libcudart.so.12.
    runtime = cuda.cuda_headers(Layout(REPO), "12.4", Progress(quiet=True)).parent / "wheels"
    shutil.copy2(next(runtime.glob("nvidia_cuda_runtime_cu12-*.whl")), tmp_path)
    python = venv(tmp_path / "venv")
    proc = pip_install(python, "--find-links", str(tmp_path), f"nvidia-nccl-cu12=={VERSION}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = doctor_json(python)
    assert rows["libnccl"]["detail"].endswith("(nvidia-nccl wheel): NCCL 2.21.5 (22105), "
                                              "exports ncclCommInitRankRootless")
    assert rows["nccl wheel"]["status"] == "ok"
    assert f"hpct series {stamp['series_id']}, {len(stamp['patches'])} patches" in rows["nccl wheel"]["detail"]


@pytest.mark.unit
def test_math_headers_for_a_cuda_without_pins_name_the_fix(tmp_path):
    from hpct.builder import cuda
    from hpct.builder.layout import Layout
    from hpct.builder.progress import Progress
    from hpct.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        cuda.cuda_math_headers(Layout(tmp_path), "12.8", Progress(quiet=True))
    assert "no math wheels are pinned for CUDA 12.8" in err.value.problem
    assert "CUDA_PINS" in err.value.fix


def _torch_accepts(wheel: Path, requirement: str) -> bool:
    """Whether torch's requirement (as in its metadata) accepts this wheel's name and version."""
    from packaging.requirements import Requirement
    from packaging.utils import parse_wheel_filename
    name, version, _, _ = parse_wheel_filename(wheel.name)
    req = Requirement(requirement)
    return req.name == name and req.specifier.contains(version, prereleases=True)


@pytest.mark.unit
def test_the_cu12_wheel_keeps_torch_2_6_0s_pin(stand_in_wheel):
    from hpct.builder.nccl_wheel import TORCH_PINS
    torch_version, requirement = TORCH_PINS[VERSION]
    assert torch_version == "torch==2.6.0" and _torch_accepts(stand_in_wheel, requirement)
    # The check is real: another version or another CUDA's distribution is refused.
    assert not _torch_accepts(stand_in_wheel, "nvidia-nccl-cu12==2.21.6")
    assert not _torch_accepts(stand_in_wheel, "nvidia-nccl-cu13==2.21.5")


@pytest.mark.unit
def test_the_2_30_7_wheel_is_nvidia_nccl_cu13_and_keeps_torch_2_14_1s_pin(scratch_root, tmp_path):
    from hpct.builder.nccl_wheel import TORCH_PINS
    prefix = stand_in_prefix(tmp_path)
    stamp = json.loads((prefix / "hpct-series.json").read_text())
    (prefix / "hpct-series.json").write_text(json.dumps({**stamp, "version": "2.30.7", "cuda": "13.0"}))
    proc = run_cli("hpct-build", "wheel", "nccl=2.30.7", "--root", str(scratch_root), "--prefix", str(prefix),
                   "--dist", str(tmp_path / "dist"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    wheel = Path(proc.stdout.strip().splitlines()[-1])
    assert wheel.name.startswith(f"nvidia_nccl_cu13-2.30.7+hpct.{SERIES}-py3-none-manylinux_")
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(f"nvidia_nccl_cu13-2.30.7+hpct.{SERIES}.dist-info/METADATA").decode()
        assert "nvidia/nccl/lib/libnccl.so.2" in z.namelist()
    assert "Name: nvidia-nccl-cu13\n" in meta and "CUDA 13.0" in meta
    torch_version, requirement = TORCH_PINS["2.30.7"]
    assert torch_version == "torch==2.14.1" and _torch_accepts(wheel, requirement)
    # A 2.21.5 build is not packaged as 2.30.7, and an unpinned version is named with the pins.
    stamp_230 = (prefix / "hpct-series.json").read_text()
    (prefix / "hpct-series.json").write_text(json.dumps({**stamp, "version": "2.21.5"}))
    proc = run_cli("hpct-build", "wheel", "nccl=2.30.7", "--root", str(scratch_root), "--prefix", str(prefix),
                   "--dist", str(tmp_path / "dist"), timeout=300)
    assert proc.returncode != 0 and "holds NCCL 2.21.5, this wheel is for 2.30.7" in proc.stderr
    (prefix / "hpct-series.json").write_text(stamp_230)
    proc = run_cli("hpct-build", "wheel", "nccl=2.99.0", "--root", str(scratch_root), "--prefix", str(prefix),
                   timeout=300)
    assert proc.returncode != 0 and "nccl version '2.99.0' is not pinned (pinned: 2.21.5, 2.30.7)" in proc.stderr


# ---------------------------------------------------------------- integration: NCCL 2.30.7 (torch 2.14.1's)

NEW_PIN = nccl_prebuild.NEW


@pytest.fixture(scope="session")
def real_build_230() -> Path:
    """NCCL 2.30.7 with the series, SendRecv only, one arch, CUDA 13.0 (CUDA_HOME or /usr/local/cuda)."""
    return nccl_prebuild.ensure_built(NEW_PIN)


@pytest.mark.slow
def test_real_2_30_7_build_is_rootless_loads_and_keeps_the_glibc_floor(real_build_230):
    lib = real_build_230 / "lib" / "libnccl.so.2"
    assert {"ncclGetVersion", "ncclCommInitRankRootless", "ncclRootlessUniqueId"} <= dynamic_symbols(lib)
    elf = read_elf(lib)
    assert elf.soname == "libnccl.so.2" and "libcudart.so.13" in elf.needed_versions
    glibc = elf.max_version("GLIBC")
    assert glibc is not None and glibc <= (2, 28), f"libnccl needs GLIBC_{'.'.join(map(str, glibc))}"
    # It loads (libcudart.so.13 from the toolkit) and reports its version without a GPU.
    code = ("import ctypes; l = ctypes.CDLL(%r); v = ctypes.c_int(); "
            "assert l.ncclGetVersion(ctypes.byref(v)) == 0; print(v.value)") % str(lib)
    cuda_lib = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda") / "lib64"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LD_LIBRARY_PATH": str(cuda_lib)})
    assert out.returncode == 0 and out.stdout.strip() == "23007", out.stderr


@pytest.mark.slow
def test_real_2_30_7_build_becomes_a_cu13_wheel_torch_2_14_1_accepts(real_build_230, tmp_path):
    from hpct.builder.nccl_wheel import TORCH_PINS
    proc = run_cli("hpct-build", "wheel", f"nccl={NEW_PIN}", "--root", str(REPO), "--dist", str(tmp_path),
                   timeout=600)
    assert proc.returncode == 0, proc.stderr
    wheel = Path(proc.stdout.strip().splitlines()[-1])
    platform = wheel.name.rsplit("-", 1)[1].removesuffix(".whl")
    floor = tuple(int(x) for x in platform.split("_")[1:3])
    assert platform.startswith("manylinux_") and floor <= (2, 28), platform
    assert _torch_accepts(wheel, TORCH_PINS[NEW_PIN][1])
    with zipfile.ZipFile(wheel) as z:
        assert "nvidia/nccl/include/nccl_rootless.h" in z.namelist()
