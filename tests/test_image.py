"""The image, really built: ci/image.sh builds it with buildah from a debootstrap base, runs
`hpct doctor` and `hpct demo` in it, and exports a docker-archive; here the archive is read
back the way `docker load` reads it (manifest.json, the config blob, every layer's digest)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

IMAGE = "localhost/hpct-test:ci"
BUILD_TIMEOUT = 45 * 60      # debootstrap, the toolchain, Gloo, the wheel, torch, demo on 2 cores
CHUNK = 1 << 20

needs_tools = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("buildah") is None or shutil.which("debootstrap") is None,
    reason="building the image needs root, buildah and debootstrap (apt-get install buildah debootstrap)")


def _sha256(f) -> str:
    h = hashlib.sha256()
    for block in iter(lambda: f.read(CHUNK), b""):
        h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module")
def built(repo, tmp_path_factory):
    archive = tmp_path_factory.mktemp("image") / "hpct-image.tar"
    env = {**os.environ, "HPCT_IMAGE": IMAGE, "HPCT_IMAGE_ARCHIVE": str(archive)}
    proc = subprocess.run(["bash", "ci/image.sh"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT)
    yield proc, archive
    # ~1 GB each: neither the image nor the tarball outlives the module.
    subprocess.run(["buildah", "--storage-driver", "vfs", "rmi", IMAGE], capture_output=True, timeout=300)
    archive.unlink(missing_ok=True)


@needs_tools
def test_image_builds_runs_doctor_and_the_demo(built):
    proc, archive = built
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    # The build-time doctor judged the image's own rows...
    for row in ("doctor: ok    python:", "doctor: ok    pytorch: 2.13.0+cpu", "doctor: ok    hpct extension:",
                "doctor: ok    gloo series:"):
        assert row in out, out
    # ...the run-time doctor judged this node too, as the image's non-root user.
    assert "run: hpct doctor (as hpct)" in out
    assert "all required checks passed" in out
    assert "bit-identical after recovery: yes" in out
    assert "survivors kept their processes: yes" in out
    assert archive.is_file()


@needs_tools
def test_archive_is_what_docker_load_reads(built):
    proc, archive = built
    assert proc.returncode == 0, proc.stderr[-4000:]
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        manifest = json.load(tar.extractfile("manifest.json"))
        assert len(manifest) == 1
        entry = manifest[0]
        # `hpct-test:ci` as docker normalizes it (what `docker load` tags), beside buildah's own name.
        ref = IMAGE.removeprefix("localhost/")
        assert f"docker.io/library/{ref}" in entry["RepoTags"], entry["RepoTags"]
        repositories = json.load(tar.extractfile("repositories"))
        assert {f"{repo}:{tag}" for repo, tags in repositories.items() for tag in tags} == set(entry["RepoTags"])
        config_bytes = tar.extractfile(entry["Config"]).read()
        # docker load names the image by its config's digest, and refuses a layer whose
        # uncompressed digest differs from the config's rootfs.diff_ids.
        assert hashlib.sha256(config_bytes).hexdigest() == Path(entry["Config"]).name.removesuffix(".json")
        config = json.loads(config_bytes)
        assert set(entry["Layers"]) <= names
        diff_ids = [_sha256(tar.extractfile(layer)) for layer in entry["Layers"]]
        assert [f"sha256:{d}" for d in diff_ids] == config["rootfs"]["diff_ids"]
        assert config["os"] == "linux" and config["architecture"] == "amd64"
        run = config["config"]
        assert run["User"] == "hpct"
        assert run["Entrypoint"] == ["hpct"] and run["Cmd"] == ["doctor"]
        files = set()
        for layer in entry["Layers"]:
            with tarfile.open(fileobj=tar.extractfile(layer)) as lt:
                files.update(m.name.removeprefix("./") for m in lt.getmembers())
    # The runtime stage: Python, torch, the hpct wheel; not the toolchain, sources or build tools.
    site = "opt/hpct/lib/python3.11/site-packages"
    assert "opt/hpct/bin/hpct" in files
    assert f"{site}/torch/__init__.py" in files
    assert any(f.startswith(f"{site}/hpct/_gloo.") for f in files)
    for absent in ("usr/bin/g++", "usr/bin/cmake", "usr/bin/ninja", "usr/bin/git", "src/pyproject.toml",
                   "opt/build/bin/python", f"{site}/scikit_build_core/__init__.py", f"{site}/pybind11/__init__.py"):
        assert absent not in files, f"{absent} is in the runtime image"
    assert not any(f.startswith("usr/include/gloo/") or f.startswith("run/secrets") for f in files)


@needs_tools
def test_skopeo_reads_the_archive(built):
    proc, archive = built
    if shutil.which("skopeo") is None:
        pytest.skip("skopeo is not installed")
    assert proc.returncode == 0
    res = subprocess.run(["skopeo", "inspect", f"docker-archive:{archive}"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["Os"] == "linux" and info["Architecture"] == "amd64"
    assert info["Labels"]["org.opencontainers.image.title"] == "hpct"
