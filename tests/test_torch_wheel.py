"""``hpct-build wheel torch=2.6.0``'s own logic, without building (issue 58): the wheel rewrite,
the series' Python changes applied to the wheel's own files, and every bad input's message.

The build itself, the installed wheel and PyTorch's suites on it: tests/test_patched_torch.py.
"""

from __future__ import annotations

import csv
import hashlib
import io
import sys
import zipfile
from pathlib import Path

import pytest

from util import REPO, run_cli

pytestmark = pytest.mark.unit

DIST_INFO = "demo-1.0.dist-info"


def _wheel(path: Path, files: dict[str, bytes], *, unrecorded: tuple[str, ...] = ()) -> Path:
    """A small wheel with a correct RECORD (names in ``unrecorded`` left out of it)."""
    from hpct.builder.wheelzip import record_hash
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator="\n")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, (2020, 5, 6, 7, 8, 10))
            info.external_attr = (0o100755 if name.endswith(".so") else 0o100644) << 16
            z.writestr(info, data, zipfile.ZIP_DEFLATED)
            if name not in unrecorded:
                writer.writerow((name, record_hash(data), len(data)))
        writer.writerow((f"{DIST_INFO}/RECORD", "", ""))
        z.writestr(f"{DIST_INFO}/RECORD", rows.getvalue())
    return path


def _record(z: zipfile.ZipFile, dist_info: str) -> dict:
    return {row[0]: row[1:] for row in csv.reader(io.StringIO(z.read(f"{dist_info}/RECORD").decode())) if row}


def test_a_rewritten_wheel_keeps_every_other_member_and_a_true_record(tmp_path):
    from hpct.builder.wheelzip import rewrite
    big = bytes(range(256)) * 4000
    src = _wheel(tmp_path / "demo-1.0-py3-none-any.whl", {
        "demo/__init__.py": b"x = 1\n", "demo/big.bin": big, "demo/lib.so": b"\x7fELF" + big[:999],
        f"{DIST_INFO}/METADATA": b"Name: demo\nVersion: 1.0\n", f"{DIST_INFO}/WHEEL": b"Tag: py3-none-any\n"})
    dest = tmp_path / "dist" / "demo-1.0+x-py3-none-any.whl"
    new_info = "demo-1.0+x.dist-info"
    rewrite(src, dest, dist_info=DIST_INFO, new_dist_info=new_info,
            changes={"demo/__init__.py": b"x = 2\n", "demo/new.py": b"y = 3\n",
                     f"{new_info}/METADATA": b"Name: demo\nVersion: 1.0+x\n"})
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]      # no temporary file left
    with zipfile.ZipFile(src) as old, zipfile.ZipFile(dest) as new:
        assert new.testzip() is None
        assert new.read("demo/__init__.py") == b"x = 2\n" and new.read("demo/new.py") == b"y = 3\n"
        assert new.read("demo/big.bin") == big                   # copied as it lay, still inflates
        assert new.getinfo("demo/big.bin").compress_size == old.getinfo("demo/big.bin").compress_size
        assert new.getinfo("demo/lib.so").external_attr >> 16 == 0o100755
        assert new.read(f"{new_info}/WHEEL") == b"Tag: py3-none-any\n"
        assert not [n for n in new.namelist() if n.startswith(DIST_INFO + "/")]
        record = _record(new, new_info)
        assert set(record) == set(new.namelist())
        for name in new.namelist():
            if name != f"{new_info}/RECORD":
                data = new.read(name)
                from hpct.builder.wheelzip import record_hash
                assert record[name] == [record_hash(data), str(len(data))], name
        assert record[f"{new_info}/RECORD"] == ["", ""]


def test_a_wheel_whose_record_misses_a_member_is_refused_and_nothing_is_left(tmp_path):
    from hpct.builder.wheelzip import rewrite
    from hpct.errors import BuildError
    src = _wheel(tmp_path / "demo-1.0-py3-none-any.whl", {"demo/a.py": b"a\n", "demo/b.py": b"b\n"},
                 unrecorded=("demo/b.py",))
    dest = tmp_path / "dist" / "out.whl"
    with pytest.raises(BuildError, match=r"demo/b.py is not in its RECORD"):
        rewrite(src, dest, dist_info=DIST_INFO, new_dist_info=DIST_INFO, changes={})
    assert list(dest.parent.iterdir()) == []


def test_a_cpython_without_a_torch_wheel_is_named_with_those_it_has():
    from hpct.builder.layout import Layout
    from hpct.builder.sources import load_manifest
    from hpct.builder.torch_inputs import pin_for
    from hpct.errors import ConfigError
    m = load_manifest(Layout(REPO), "pytorch")
    assert pin_for(m, (3, 11))["file"] == "torch-2.6.0-cp311-cp311-manylinux1_x86_64.whl"
    with pytest.raises(ConfigError) as err:
        pin_for(m, (3, 8))
    assert str(err.value).startswith("torch 2.6.0 has no wheel for CPython 3.8; it has wheels for CPython "
                                     "3.9, 3.10, 3.11, 3.12, 3.13")
    assert "--python" in err.value.fix


def _cli(*args, timeout=600):
    return run_cli("hpct-build", "wheel", *args, "--root", str(REPO), timeout=timeout)


def test_the_cli_names_a_cpython_without_a_torch_wheel():
    old = sorted(Path.home().glob(".pyenv/versions/3.8*/bin/python3"))
    if not old:
        pytest.skip("no CPython 3.8 here to ask for")
    proc = _cli("torch=2.6.0", "--python", str(old[0]))
    assert proc.returncode == 2, proc.stderr
    assert "torch 2.6.0 has no wheel for CPython 3.8; it has wheels for CPython 3.9, 3.10, 3.11, 3.12, 3.13" \
        in proc.stderr


def test_a_torch_wheel_with_another_sha256_is_refused_naming_the_file_and_both_digests(tmp_path):
    fake = tmp_path / "torch-2.6.0-cp311-cp311-manylinux1_x86_64.whl"
    fake.write_bytes(b"not the wheel PyPI serves")
    dist = tmp_path / "dist"
    proc = _cli("torch=2.6.0", "--python", sys.executable, "--torch-wheel", str(fake), "--dist", str(dist))
    assert proc.returncode == 4, proc.stderr          # ChecksumError, a SourceError
    from hpct.builder.layout import Layout
    from hpct.builder.sources import load_manifest
    from hpct.builder.torch_inputs import pin_for
    want = pin_for(load_manifest(Layout(REPO), "pytorch"), sys.version_info)["sha256"]
    got = hashlib.sha256(fake.read_bytes()).hexdigest()
    assert f"{fake}: sha256 {got}, but torch 2.6.0's cp{sys.version_info[0]}{sys.version_info[1]} wheel is " \
           f"pinned at sha256 {want}" in proc.stderr
    assert not dist.exists() or not list(dist.glob("torch-*"))


def test_wheel_options_of_other_components_are_refused():
    proc = _cli("torch=2.5.0")
    assert proc.returncode == 2 and "pytorch version '2.5.0' is not pinned (pinned: 2.6.0)" in proc.stderr
    proc = _cli("nccl", "--torch-wheel", "/nonexistent.whl")
    assert proc.returncode == 2 and "--torch-wheel, --no-nccl and --jobs apply to `wheel torch=VERSION` only" \
        in proc.stderr


@pytest.fixture(scope="module")
def series():
    from hpct.builder.layout import Layout
    from hpct.builder.patches import load_series
    from hpct.builder.sources import load_manifest
    proc = run_cli("hpct-build", "patch", "pytorch", "--root", str(REPO), timeout=900)
    assert proc.returncode == 0, proc.stderr
    layout = Layout(REPO)
    m = load_manifest(layout, "pytorch")
    return [load_series(layout, m), load_series(layout, m, "wheel")]


def test_the_series_python_changes_apply_to_the_wheels_own_files(series, tmp_path):
    """The recipe's Python step, on files as the wheel carries them (the Debian tree's are the
    same bytes as PyPI's 2.6.0 wheel's): the result is the patched tree's file, plus the hook."""
    from hpct.builder.torch_wheel import python_changes
    pristine = REPO / "third_party" / "src" / "pytorch-2.6.0"
    patched = REPO / "third_party" / "patched" / "pytorch-2.6.0"
    names = ("torch/distributed/distributed_c10d.py", "torch/distributed/__init__.py", "torch/version.py")
    wheel = tmp_path / "torch.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in names[:2]:
            z.writestr(name, (pristine / name).read_bytes())
    changed = python_changes(series, wheel, tmp_path / "scratch")
    assert sorted(changed) == ["torch/distributed/__init__.py", "torch/distributed/_hpct_out_of_tree.py",
                               "torch/distributed/_hpct_rootless.py", "torch/distributed/distributed_c10d.py"]
    for name in ("torch/distributed/distributed_c10d.py", "torch/distributed/_hpct_rootless.py"):
        assert changed[name] == (patched / name).read_bytes(), name
    hooked = changed["torch/distributed/__init__.py"].decode()
    assert hooked.count("_hpct_out_of_tree.install()") == 1
    assert hooked.index("_hpct_out_of_tree.install()") < hooked.index("from torch._C._distributed_c10d import")
    compile(changed["torch/distributed/_hpct_out_of_tree.py"], "_hpct_out_of_tree.py", "exec")


def test_a_python_change_that_does_not_apply_is_named(series, tmp_path):
    from hpct.builder.torch_wheel import python_changes
    from hpct.errors import BuildError
    wheel = tmp_path / "torch.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("torch/distributed/distributed_c10d.py", "# another torch's file\n")
        z.writestr("torch/distributed/__init__.py", "# another torch's file\n")
    with pytest.raises(BuildError, match=r"^0005-.*\.patch does not apply to the wheel's files"):
        python_changes(series, wheel, tmp_path / "scratch")


def test_the_wheels_pybind11_abi_and_string_abi_are_read_from_its_libraries(tmp_path):
    from hpct.builder.torch_inputs import pybind11_abi
    from hpct.errors import SourceError
    lib = tmp_path / "libtorch_python.so"
    lib.write_bytes(b"\0junk__pybind11_internals_v4_gcc_libstdcpp_cxxabi1011__\0more")
    assert pybind11_abi(lib) == ("__pybind11_internals_v4_gcc_libstdcpp_cxxabi1011__", "_cxxabi1011")
    lib.write_bytes(b"no internals here")
    with pytest.raises(SourceError, match="names no pybind11 internals"):
        pybind11_abi(lib)


def test_the_wheel_series_is_a_series(series):
    wheel = series[1]
    assert [e.patch for e in wheel.entries] == ["0001-distributed-take-ProcessGroupGloo-NCCL-from-the-out-.patch"]
    assert "init_process_group must create the series' ones" in wheel.entries[0].why
    text = wheel.paths[0].read_text()
    for field in ("Description:", "Origin: vendor, hpct", "Forwarded:", "Last-Update:"):
        assert field in text
