"""Source installs and the installed hpct-build.

``pip install .``, ``pip install <sdist>`` and ``pip install git+<url>`` build the
patched Gloo inside the scikit-build-core build (fetch, verify, patch, build); with
no provider reachable the build stops with hpct-build's message and fix.  An
installed hpct-build works in a work folder (``--workdir`` / ``HPCT_BUILD_DIR``)
with the manifests and series the wheel carries.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hpct
from util import REPO, run_cli

INSTALLED_INPUTS = Path(hpct.__file__).resolve().parent / "_build_inputs"
CLOSED = "http://127.0.0.1:9"            # a proxy on a closed port: "no network" even where there is one
NO_NETWORK = {"http_proxy": CLOSED, "https_proxy": CLOSED, "HTTP_PROXY": CLOSED, "HTTPS_PROXY": CLOSED}
PIP_TIMEOUT = 900


def _hpct_build(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed hpct-build, run from / (outside every checkout), no work folder inherited."""
    return run_cli("hpct-build", *args, env={"HPCT_BUILD_DIR": "", **(env or {})}, timeout=timeout, cwd=Path("/"))


# ---------------------------------------------------------------- the installed hpct-build

@pytest.mark.unit
def test_the_wheel_carries_the_series_its_extension_was_built_with():
    from hpct import _gloo
    from hpct.builder.layout import Layout
    from hpct.builder.patches import load_series
    from hpct.builder.sources import load_manifest
    layout = Layout(INSTALLED_INPUTS)
    for name in ("gloo", "pytorch", "nccl"):
        assert (INSTALLED_INPUTS / "third_party" / f"{name}.toml").is_file(), name
    assert (INSTALLED_INPUTS / "build_scripts" / "gloo.cmake").is_file()
    series = load_series(layout, load_manifest(layout, "gloo"))
    assert series.identity() == _gloo.series_id()
    # NCCL's series are applied over the shared ring core: every pin's project files come along,
    # found in the installed inputs (no checkout is needed to patch NCCL).
    for version in ("2.21.5", "2.30.7"):
        nccl = load_series(layout, load_manifest(layout, "nccl", version))
        assert nccl.project_files, version
        for rel, path in nccl.project_files:
            assert path.is_file() and INSTALLED_INPUTS in path.parents, (version, rel, path)


@pytest.mark.unit
def test_outside_a_checkout_without_a_work_folder_names_both_fixes():
    proc = _hpct_build("status")
    assert proc.returncode == 3, proc.stderr
    assert "/ is not inside an hpct checkout" in proc.stderr
    assert "pass --workdir PATH or set HPCT_BUILD_DIR=PATH" in proc.stderr


@pytest.mark.unit
def test_workdir_gets_the_installed_inputs_and_fetches_and_patches_there(tmp_path, gloo_archive):
    work = tmp_path / "work"
    (work / "third_party" / "cache").mkdir(parents=True)
    shutil.copy2(gloo_archive, work / "third_party" / "cache" / gloo_archive.name)
    proc = _hpct_build("patch", "gloo", "--workdir", str(work))
    assert proc.returncode == 0, proc.stderr
    stamp = json.loads((work / ".hpct-inputs.json").read_text())
    assert stamp["from"] == str(INSTALLED_INPUTS)
    assert (work / "patches" / "gloo" / "5354032" / "series").read_bytes() == \
        (INSTALLED_INPUTS / "patches" / "gloo" / "5354032" / "series").read_bytes()
    patched = json.loads((work / "third_party" / "patched" / "gloo-5354032" / ".hpct-patched.json").read_text())
    from hpct import _gloo
    assert patched["series_id"] == _gloo.series_id()
    status = _hpct_build("status", "--json", "--workdir", str(work))
    assert status.returncode == 0, status.stderr
    rows = {r["name"]: r for r in json.loads(status.stdout)["components"]}
    assert json.loads(status.stdout)["root"] == str(work.resolve())
    assert rows["gloo"]["patched"], rows["gloo"]


@pytest.mark.unit
def test_hpct_build_dir_is_the_work_folder(tmp_path):
    work = tmp_path / "env-work"
    proc = _hpct_build("status", env={"HPCT_BUILD_DIR": str(work)})
    assert proc.returncode == 0, proc.stderr
    assert (work / "third_party" / "gloo.toml").read_text() == \
        (INSTALLED_INPUTS / "third_party" / "gloo.toml").read_text()


@pytest.mark.unit
def test_workdir_follows_the_checkout_it_copies(tmp_path, scratch_root):
    work = tmp_path / "work"
    assert _hpct_build("status", "--root", str(scratch_root), "--workdir", str(work)).returncode == 0
    assert json.loads((work / ".hpct-inputs.json").read_text())["from"] == str(scratch_root.resolve())
    manifest = scratch_root / "third_party" / "gloo.toml"
    manifest.write_text(manifest.read_text() + "\n# changed in the checkout\n")
    (scratch_root / "third_party" / "pytorch.toml").unlink()
    proc = _hpct_build("status", "--root", str(scratch_root), "--workdir", str(work))
    assert proc.returncode == 0, proc.stderr
    assert (work / "third_party" / "gloo.toml").read_text().endswith("# changed in the checkout\n")
    assert not (work / "third_party" / "pytorch.toml").exists()


@pytest.mark.unit
def test_workdir_never_overwrites_inputs_it_did_not_copy(tmp_path, scratch_root):
    proc = _hpct_build("status", "--workdir", str(scratch_root))
    assert proc.returncode == 2, proc.stderr
    assert "already holds manifests or patches that hpct-build did not copy there" in proc.stderr
    assert "to build inside a checkout, use --root instead" in proc.stderr


@pytest.mark.unit
def test_workdir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    proc = _hpct_build("status", "--workdir", str(f))
    assert proc.returncode == 2, proc.stderr
    assert f"work folder {f} is not a directory" in proc.stderr


@pytest.mark.unit
def test_the_hpct_wheel_needs_its_sources(tmp_path):
    proc = _hpct_build("wheel", "--workdir", str(tmp_path / "w"))
    assert proc.returncode == 3, proc.stderr
    assert "no hpct sources to build a wheel from" in proc.stderr
    assert "checkout or an unpacked sdist" in proc.stderr


@pytest.mark.unit
def test_gloo_has_a_provider_beside_debian():
    from hpct.builder.layout import Layout
    from hpct.builder.sources import load_manifest
    m = load_manifest(Layout(INSTALLED_INPUTS), "gloo")
    kinds = [p.kind for p in m.providers]
    assert kinds == ["debian", "url"]
    url = m.providers[1]
    assert url.url.endswith(f"/archive/{m.extra['commit']}.tar.gz") and url.strip_components == 1
    assert url.file == f"gloo-{m.extra['commit']}.tar.gz" and len(url.sha256) == 64


# ---------------------------------------------------------------- source builds through pip

@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    from hpct.builder.progress import Progress
    from hpct.builder.wheel import build_sdist
    out = tmp_path_factory.mktemp("sdist")
    return build_sdist(REPO, out, out / "sdist.log", Progress(quiet=True))


@pytest.mark.slow
def test_no_reachable_provider_stops_the_build_with_the_fix(sdist, tmp_path):
    # The build requirements come from this interpreter: pip itself needs no network here.
    env = {**os.environ, **NO_NETWORK, "HPCT_BUILD_DIR": str(tmp_path / "work")}
    env.pop("HPCT_GLOO_PREFIX", None)
    env.pop("HPCT_GLOO_SOURCE", None)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                           "--disable-pip-version-check", "-w", str(tmp_path / "out"), str(sdist)],
                          capture_output=True, text=True, timeout=PIP_TIMEOUT, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "hpct-build fetch gloo` failed (exit 3)" in out
    assert "no provider could supply gloo 5354032" in out
    assert "github.com/pytorch/gloo/archive/5354032ea08eadd7fc4456477f7f7c6308818509.tar.gz" in out
    assert "HPCT_GLOO_SOURCE=PATH" in out
    assert not list(tmp_path.glob("out/*.whl"))


def _venv_python() -> Path:
    """3.12 when this machine has it (what HyperPod runs), else this interpreter."""
    from hpct.builder.wheel import candidate_paths, probe
    for path in candidate_paths():
        it = probe(path)
        if it and it.minor == "3.12":
            return it.path
    return Path(sys.executable)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("venv")
    subprocess.run([str(_venv_python()), "-m", "venv", str(home)], check=True, timeout=300)
    py = home / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "pytest"],
                   check=True, timeout=PIP_TIMEOUT)
    return py


@pytest.fixture(scope="module")
def gloo_work(tmp_path_factory) -> Path:
    """One work folder for the source builds below: the first fetches and builds Gloo, the
    others find it built (HPCT_BUILD_DIR is what a user sets to keep it between installs)."""
    return tmp_path_factory.mktemp("gloo-work")


def _pip_install(py: Path, target: str, work: Path, cwd: Path) -> str:
    env = {**os.environ, "HPCT_BUILD_DIR": str(work)}
    env.pop("HPCT_GLOO_PREFIX", None)
    proc = subprocess.run([str(py), "-m", "pip", "install", "--disable-pip-version-check", "--force-reinstall",
                           "--no-deps", target], capture_output=True, text=True, timeout=PIP_TIMEOUT, env=env, cwd=cwd)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


def _installed_series(py: Path) -> str:
    proc = subprocess.run([str(py), "-c", "import hpct._gloo as g; print(g.series_id())"], capture_output=True,
                          text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.slow
def test_sdist_installs_into_a_fresh_venv_building_gloo_itself(sdist, venv, gloo_work, tmp_path):
    _pip_install(venv, str(sdist), gloo_work, tmp_path)
    from hpct import _gloo
    assert _installed_series(venv) == _gloo.series_id()
    built = json.loads((gloo_work / "third_party" / "build" / "gloo-5354032" / "install" /
                        "hpct-series.json").read_text())
    assert built["series_id"] == _gloo.series_id()
    fetched = json.loads((gloo_work / "third_party" / "src" / "gloo-5354032" / ".hpct-source.json").read_text())
    assert fetched["provider"] in ("debian", "url") and len(fetched["sha256"]) == 64
    proc = subprocess.run([str(venv), "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_gloo_storeless.py",
                           "-k", "collectives_exact and 4"], capture_output=True, text=True, timeout=300,
                          cwd=REPO / "tests")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout


@pytest.fixture(scope="module")
def clone(sdist, tmp_path_factory) -> Path:
    """A clean git clone: the tracked tree, as the sdist holds it, and nothing built."""
    import tarfile
    top = tmp_path_factory.mktemp("clone")
    with tarfile.open(sdist) as tar:            # Debian 12's Python 3.11.2 has no extraction filters
        tar.extractall(top, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (src,) = [p for p in top.iterdir() if p.is_dir()]
    (src / "PKG-INFO").unlink()
    git = ["git", "-c", "user.name=hpct-test", "-c", "user.email=hpct-test@invalid", "-c", "init.defaultBranch=main"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "clone"]):
        subprocess.run(git + cmd, cwd=src, check=True, timeout=120, capture_output=True)
    return src


@pytest.mark.slow
def test_pip_install_dot_and_git_url_build_gloo_themselves(clone, venv, gloo_work, tmp_path):
    from hpct import _gloo
    _pip_install(venv, ".", gloo_work, clone)
    assert _installed_series(venv) == _gloo.series_id()
    assert (clone / "build").is_dir()            # scikit-build-core's build-dir, inside the clone
    out = _pip_install(venv, f"git+{clone.as_uri()}", gloo_work, tmp_path)
    assert "git clone" in out or "Cloning" in out
    assert _installed_series(venv) == _gloo.series_id()
