"""The build cache (hpct/builder/build_cache.py): a finished build is reused only when every input
that decides it is the same and every file is still what was stored; anything else is a miss."""

from __future__ import annotations

import json
import os

import pytest

from hpct.builder import build_cache

pytestmark = pytest.mark.unit
INPUTS = {"series_id": "abc", "cuda": "13.0", "cuda_archs": ["80"], "funcs": "SendRecv", "nvcc": "release 13.0"}


@pytest.fixture
def env(tmp_path):
    return {"XDG_CACHE_HOME": str(tmp_path / "cache"), "HOME": str(tmp_path)}


def prefix(tmp_path, name="install"):
    p = tmp_path / name
    (p / "lib").mkdir(parents=True)
    (p / "lib" / "libnccl.so.2.30.7").write_bytes(b"\x7fELF library bytes")
    os.symlink("libnccl.so.2.30.7", p / "lib" / "libnccl.so.2")
    (p / "hpct-series.json").write_text(json.dumps({"seconds": 1412.0}))
    return p


def test_every_input_is_part_of_the_key():
    k = build_cache.key(INPUTS)
    assert build_cache.key(dict(INPUTS)) == k
    for name, other in (("series_id", "abd"), ("cuda_archs", ["90"]), ("funcs", None), ("nvcc", "release 13.1")):
        assert build_cache.key({**INPUTS, name: other}) != k, name


def test_a_stored_build_is_taken_back_whole_links_included(tmp_path, env):
    built = prefix(tmp_path)
    k = build_cache.key(INPUTS)
    stored = build_cache.store("nccl", "2.30.7", k, built, INPUTS, env)
    assert stored == build_cache.root(env) / f"nccl-2.30.7-{k}" and build_cache.verified(stored)
    assert not any(p.name.startswith(".") for p in stored.parent.iterdir())       # no staging left
    target = tmp_path / "other" / "install"
    target.parent.mkdir()
    assert build_cache.take("nccl", "2.30.7", k, target, env)
    assert (target / "lib" / "libnccl.so.2").is_symlink()
    assert (target / "lib" / "libnccl.so.2").read_bytes() == b"\x7fELF library bytes"
    assert json.loads((target / "hpct-series.json").read_text()) == {"seconds": 1412.0}
    assert not build_cache.take("nccl", "2.30.7", build_cache.key({**INPUTS, "funcs": None}), target, env)


def test_a_changed_file_is_a_miss_and_the_entry_goes(tmp_path, env):
    k = build_cache.key(INPUTS)
    stored = build_cache.store("nccl", "2.30.7", k, prefix(tmp_path), INPUTS, env)
    (stored / "install" / "lib" / "libnccl.so.2.30.7").write_bytes(b"\x7fELF library bytez")   # same size
    assert not build_cache.take("nccl", "2.30.7", k, tmp_path / "target", env)
    assert not stored.exists() and not (tmp_path / "target").exists()


def test_the_cache_can_be_turned_off_for_a_cold_run():
    assert build_cache.enabled({}) and build_cache.enabled({"HPCT_BUILD_CACHE": "1"})
    assert not build_cache.enabled({"HPCT_BUILD_CACHE": "0"})


def test_an_unwritable_cache_stores_nothing_and_says_so(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    env = {"XDG_CACHE_HOME": str(blocked)}
    assert build_cache.store("nccl", "2.30.7", "k", prefix(tmp_path), INPUTS, env) is None


def test_a_pinned_download_is_kept_and_reused_only_while_its_sha256_is_the_pins(tmp_path, env):
    from hpct.builder.sources import sha256_of
    got = tmp_path / "a" / "pkg_x-1.0-py3-none-any.whl"
    got.parent.mkdir()
    got.write_bytes(b"the pinned wheel")
    pin = sha256_of(got)
    build_cache.keep_download(got, env)
    dest = tmp_path / "b"
    assert build_cache.reuse_download("pkg_x-1.0-*.whl", pin, dest, env) == dest / got.name
    assert (dest / got.name).read_bytes() == b"the pinned wheel"
    assert build_cache.reuse_download("pkg_x-1.0-*.whl", pin, tmp_path / "c", {**env, "HPCT_BUILD_CACHE": "0"}) is None
    (build_cache.downloads(env) / got.name).write_bytes(b"a changed file")
    assert build_cache.reuse_download("pkg_x-1.0-*.whl", pin, tmp_path / "d", env) is None
    assert not (build_cache.downloads(env) / got.name).exists()        # removed, to be fetched again


def test_a_second_checkout_takes_the_cuda_wheel_without_the_network(tmp_path, monkeypatch):
    """The CUDA 12.4 toolchain's wheels are fetched once per machine, not once per clone: with
    PyPI unreachable, a fresh checkout still gets the kept copy (sha256 checked)."""
    from hpct.builder import cuda
    from hpct.builder.layout import Layout
    from hpct.builder.progress import Progress
    from hpct.builder.sources import sha256_of
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for name, value in {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:1/simple",
                        "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "5"}.items():
        monkeypatch.setenv(name, value)
    first = tmp_path / "first" / "third_party" / "cache" / "cuda-12.4" / "wheels"
    first.mkdir(parents=True)
    wheel = first / "nvidia_fake_cu12-1.0-py3-none-any.whl"
    wheel.write_bytes(b"a pinned wheel's bytes")
    pin = sha256_of(wheel)
    assert cuda._wheel(Layout(tmp_path / "first"), "12.4", "nvidia-fake-cu12", "1.0", pin, Progress(quiet=True)) == wheel
    second = cuda._wheel(Layout(tmp_path / "second"), "12.4", "nvidia-fake-cu12", "1.0", pin, Progress(quiet=True))
    assert second == tmp_path / "second" / "third_party" / "cache" / "cuda-12.4" / "wheels" / wheel.name
    assert second.read_bytes() == wheel.read_bytes()
    with pytest.raises(Exception, match="could not download nvidia-fake-cu12==1.0 with pip"):
        cuda._wheel(Layout(tmp_path / "third"), "12.4", "nvidia-fake-cu12", "1.0", "0" * 64, Progress(quiet=True))
