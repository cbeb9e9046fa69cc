"""The Dockerfile and .dockerignore, read statically; tests/test_image.py builds and runs the image."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
NODE_ROWS = re.compile(r"node = \{([^}]*)\}")


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _stages(text: str) -> tuple[list[tuple[str, str]], list[list[tuple[str, str]]]]:
    """(the instructions before the first FROM, one instruction list per stage)."""
    head: list[tuple[str, str]] = []
    stages: list[list[tuple[str, str]]] = []
    for word, rest in _instructions(text):
        if word == "FROM":
            stages.append([])
        (stages[-1] if stages else head).append((word, rest))
    return head, stages


def _arg_default(steps, name: str) -> str | None:
    for word, rest in steps:
        if word == "ARG" and rest.startswith(f"{name}="):
            return rest.split("=", 1)[1].strip('"')
    return None


@pytest.fixture(scope="module")
def dockerfile(repo) -> str:
    return (repo / "Dockerfile").read_text()


def test_base_is_an_arg_pinned_by_digest(dockerfile):
    head, stages = _stages(dockerfile)
    base = _arg_default(head, "BASE")
    assert base, "ARG BASE=<image>@sha256:<digest> must come before the first FROM"
    assert DIGEST.search(base), f"the default base {base!r} is not pinned by a sha256 digest"
    assert "python:3.11" in base and "bookworm" in base, base
    assert all(s[0][1].split()[0] == "${BASE}" for s in stages), "every stage starts FROM ${BASE}"


def test_two_stages_and_the_runtime_one_has_no_toolchain(dockerfile):
    _, stages = _stages(dockerfile)
    assert len(stages) == 2, "a build stage and a runtime stage"
    assert stages[0][0][1].split()[-2:] == ["AS", "build"]
    runtime = stages[-1]
    copies = [rest for word, rest in runtime if word == "COPY"]
    assert copies == ["--from=build /opt/hpct /opt/hpct"], copies
    runs = " ".join(rest for word, rest in runtime if word == "RUN")
    for tool in ("apt-get", "ci/setup.sh", "hpct.builder", "pip install"):
        assert tool not in runs, f"the runtime stage runs {tool}"


def test_build_stage_runs_only_the_projects_commands(repo, dockerfile):
    from hpct.builder.cli import VERBS as BUILD_VERBS
    _, stages = _stages(dockerfile)
    runs = " ".join(rest for word, rest in stages[0] if word == "RUN")
    scripts = re.findall(r"bash (\S+\.sh)", runs)
    assert scripts == ["ci/setup.sh"]
    assert all((repo / s).is_file() for s in scripts)
    verbs = re.findall(r"-m hpct\.builder (\w+)", runs)
    # `wheel` fetches and builds Gloo only: `all` would fetch the PyTorch source the image never builds.
    assert verbs == ["wheel"], verbs
    assert all(v in BUILD_VERBS for v in verbs)


def test_runs_as_a_non_root_user_created_in_the_runtime_stage(dockerfile):
    _, stages = _stages(dockerfile)
    runtime = stages[-1]
    users = [rest for word, rest in runtime if word == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    assert any(word == "RUN" and "useradd" in rest and rest.endswith(users[-1]) for word, rest in runtime)
    words = [word for word, _ in runtime]
    assert words.index("USER") < words.index("ENTRYPOINT")


def test_doctor_runs_at_build_time_and_skips_only_real_node_rows(dockerfile):
    from hpct.doctor_run import run_checks
    _, stages = _stages(dockerfile)
    runtime = stages[-1]
    words = [word for word, _ in runtime]
    doctor = [i for i, (word, rest) in enumerate(runtime) if word == "RUN" and "hpct doctor" in rest]
    assert doctor and doctor[0] > words.index("USER"), "doctor runs in the runtime stage as its user"
    node = set(re.findall(r'"([^"]+)"', NODE_ROWS.search(runtime[doctor[0]][1]).group(1)))
    produced = {row.check for row in run_checks()}
    # A renamed doctor row would silently stop being skipped (or being judged): keep them in step.
    assert node == {"kernel port ranges", "free ports"}
    assert node <= produced, node - produced
    assert {"python", "pytorch", "hpct extension", "gloo series"} <= produced - node


def _doctor_run(dockerfile: str, tmp_path: Path, hpct_body: str) -> subprocess.CompletedProcess:
    """The Dockerfile's build-time doctor step, run by sh with a stand-in `hpct` (``hpct_body``)."""
    _, stages = _stages(dockerfile)
    script = next(rest for word, rest in stages[-1] if word == "RUN" and "hpct doctor" in rest)
    script = script.replace("/tmp/doctor.json", str(tmp_path / "doctor.json"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "hpct").write_text(f"#!/bin/sh\n{hpct_body}\n")
    (bin_dir / "hpct").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    return subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin"})


def _doctor_printing(tmp_path: Path, statuses: dict[str, str]) -> str:
    """A stand-in doctor body: prints ``--json`` rows, exits 3 when one fails (as hpct doctor does)."""
    import json
    rows = [{"check": c, "status": s, "detail": f"{c} detail", "fix": None} for c, s in statuses.items()]
    doc = tmp_path / "rows.json"
    doc.write_text(json.dumps({"ok": "fail" not in statuses.values(), "checks": rows}))
    return f"cat {doc}\nexit {3 if 'fail' in statuses.values() else 0}"


def test_build_time_doctor_fails_the_build_on_an_image_row(dockerfile, tmp_path):
    body = _doctor_printing(tmp_path, {"python": "ok", "configuration": "fail", "free ports": "ok"})
    res = _doctor_run(dockerfile, tmp_path, body)
    assert res.returncode != 0
    assert "hpct doctor in the image: failing: configuration" in res.stderr
    assert "doctor: fail  configuration: configuration detail" in res.stdout


def test_build_time_doctor_shows_but_does_not_judge_the_node_rows(dockerfile, tmp_path):
    body = _doctor_printing(tmp_path, {"python": "ok", "kernel port ranges": "fail", "free ports": "fail"})
    res = _doctor_run(dockerfile, tmp_path, body)
    assert res.returncode == 0, res.stderr
    assert "doctor: fail  kernel port ranges" in res.stdout
    assert not (tmp_path / "doctor.json").exists()


def test_build_time_doctor_fails_when_doctor_prints_nothing(dockerfile, tmp_path):
    res = _doctor_run(dockerfile, tmp_path, "echo 'Traceback: boom' >&2\nexit 1")
    assert res.returncode != 0
    assert "JSONDecodeError" in res.stderr


def test_no_arg_is_an_hpct_variable(dockerfile):
    # An ARG is an environment variable in every later RUN step, and hpct's configuration
    # refuses HPCT_* names it does not know: the build-time doctor would fail on it.
    names = [rest.split("=", 1)[0] for word, rest in _instructions(dockerfile) if word == "ARG"]
    assert names and not [n for n in names if n.startswith("HPCT_")], names


def test_entrypoint_is_hpct_with_a_real_verb(dockerfile):
    from hpct.cli import VERBS
    _, stages = _stages(dockerfile)
    entry = dict(stages[-1])
    assert entry["ENTRYPOINT"] == '["hpct"]'
    assert entry["CMD"].strip('[]"') in VERBS


def test_torch_pin_is_the_cpu_pin_everywhere(repo, dockerfile):
    from hpct.requirements import TORCH_CPU_PIN
    _, stages = _stages(dockerfile)
    assert _arg_default(stages[0], "TORCH_VERSION") == f"{TORCH_CPU_PIN}+cpu"
    setup = re.search(r"^TORCH_VERSION=(\S+)", (repo / "ci" / "setup.sh").read_text(), re.M)
    assert setup and setup.group(1) == TORCH_CPU_PIN


# --- .dockerignore, with Docker's rules: the last matching pattern wins, `!` re-includes, a
# pattern that matches a folder matches everything under it, `*` stays within one path segment.

def _ignore_patterns(text: str) -> list[tuple[bool, str]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            neg = line.startswith("!")
            out.append((neg, line.lstrip("!").strip("/")))
    return out


def _segment_match(path: str, pattern: str) -> bool:
    regex = ""
    for part in re.split(r"(\*\*/?|\*|\?)", pattern):
        if part in ("**", "**/"):
            regex += "(.*/)?" if part == "**/" else ".*"
        elif part == "*":
            regex += "[^/]*"
        elif part == "?":
            regex += "[^/]"
        else:
            regex += re.escape(part)
    return re.fullmatch(regex, path) is not None


def _in_context(path: str, patterns: list[tuple[bool, str]]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for neg, pattern in patterns:
        if any(_segment_match(p, pattern) for p in prefixes):
            excluded = not neg
    return not excluded


def test_matcher_follows_dockers_rules():
    pats = _ignore_patterns("*\n!keep/\n!third_party/*.toml\n**/__pycache__\n")
    assert _in_context("keep/a/b.py", pats) and _in_context("third_party/gloo.toml", pats)
    assert not _in_context("third_party/cache/x.tar.xz", pats)
    assert not _in_context("keep/__pycache__/b.pyc", pats)
    assert not _in_context("other.txt", pats)


def test_dockerignore_sends_what_the_build_reads_and_nothing_else(repo):
    pats = _ignore_patterns((repo / ".dockerignore").read_text())
    assert pats[0] == (False, "*"), "an allow-list: everything is excluded first"
    tracked = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True,
                             timeout=60, check=True).stdout.split()
    needed = ["pyproject.toml", "CMakeLists.txt", "README.md", "ci/setup.sh", "ci/python.sh",
              "build_scripts/gloo.cmake",
              "build_scripts/compiler_cache.cmake",
              "third_party/gloo.toml", "patches/gloo/5354032/series",
              *[f for f in tracked if f.startswith(("hpct/", "src/"))]]
    missing = [f for f in needed if not _in_context(f, pats)]
    assert not missing, f".dockerignore keeps out what the build needs: {missing}"
    for path in ("third_party/cache/pytorch_2.6.0+dfsg.orig.tar.xz", "third_party/src/gloo-5354032/CMakeLists.txt",
                 "third_party/build/gloo-5354032/install/lib/libgloo.a", "dist/hpct-0.1.0-cp311.whl",
                 "build/wheel.log", ".git/HEAD", "tests/test_cli.py", "benchmarks/startup.py",
                 "hpct/__pycache__/cli.cpython-311.pyc", "ci/main.sh"):
        assert not _in_context(path, pats), f"{path} would enter the build context"
    assert _in_context(".whl/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", pats)


# --- ci/image.sh refuses clearly, before building anything.

def _image_script_copy(repo: Path, tmp_path: Path, dockerfile: str | None = None) -> Path:
    (tmp_path / "ci").mkdir()
    for name in ("image.sh", "python.sh"):
        shutil.copy2(repo / "ci" / name, tmp_path / "ci" / name)
    (tmp_path / "Dockerfile").write_text(dockerfile if dockerfile is not None
                                         else (repo / "Dockerfile").read_text())
    return tmp_path / "ci" / "image.sh"


def _run(script: Path, env: dict, timeout: float = 120, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/bash", str(script), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=script.parent.parent)


def test_image_script_without_buildah(repo, tmp_path):
    script = _image_script_copy(repo, tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("id", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    res = _run(script, {"PATH": str(bin_dir)})
    if "needs root" in res.stderr:
        pytest.skip("not root: ci/image.sh stops earlier")
    assert res.returncode == 1
    assert "buildah is not installed" in res.stderr and "fix: apt-get install buildah" in res.stderr


needs_buildah = pytest.mark.skipif(shutil.which("buildah") is None, reason="buildah is not installed")


@needs_buildah
def test_image_script_without_a_torch_pin(repo, tmp_path):
    text = re.sub(r"^ARG TORCH_VERSION=.*\n", "", (repo / "Dockerfile").read_text(), flags=re.M)
    res = _run(_image_script_copy(repo, tmp_path, text), {"PATH": "/usr/bin:/bin"})
    if "needs root" in res.stderr:
        pytest.skip("not root")
    assert res.returncode == 1
    assert "the Dockerfile has no 'ARG TORCH_VERSION=' default" in res.stderr
    assert "fix: restore the pin line" in res.stderr


@needs_buildah
def test_image_script_when_pip_has_no_such_torch(repo, tmp_path):
    text = re.sub(r"^ARG TORCH_VERSION=.*$", "ARG TORCH_VERSION=0.0.1+cpu", (repo / "Dockerfile").read_text(),
                  flags=re.M)
    env = {**os.environ, "PYTHON": sys.executable, "HPCT_IMAGE_BASE": "localhost/hpct-test-absent:none"}
    res = _run(_image_script_copy(repo, tmp_path, text), env, timeout=300)
    if "needs root" in res.stderr:
        pytest.skip("not root")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "pip finds no torch==0.0.1+cpu wheel for Python 3.11" in res.stderr
    assert "fix: put that wheel in .whl/" in res.stderr
    assert not (tmp_path / "build" / "image" / "hpct-image.tar").exists()


@needs_buildah
def test_image_script_with_a_missing_ca_bundle(repo, tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "HPCT_IMAGE_BASE": "localhost/hpct-test-absent:none",
           "HPCT_BUILD_CA": str(tmp_path / "no-such-ca.pem")}
    res = _run(_image_script_copy(repo, tmp_path), env, timeout=300)
    if "needs root" in res.stderr:
        pytest.skip("not root")
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"the CA bundle {tmp_path / 'no-such-ca.pem'} (HPCT_BUILD_CA, PIP_CERT or pip's global.cert) " \
           "does not exist" in res.stderr
    assert "fix: point HPCT_BUILD_CA at an existing PEM bundle" in res.stderr


@needs_buildah
def test_image_script_takes_the_ca_bundle_from_pips_config_files(repo, tmp_path):
    """No PIP_CERT in the environment (a clean login shell): the CA bundle pip trusts comes
    from its configuration files and is lent to the build.  `pip config get global.cert`
    misses values from the system-wide files, and the image build then failed behind a
    TLS-inspecting proxy (the build's pip did not trust it)."""
    import ssl
    system = Path(ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt")
    if not system.is_file():
        pytest.skip("no system CA bundle to copy")
    bundle = tmp_path / "from-config.pem"
    shutil.copy2(system, bundle)
    # PIP_CONFIG_FILE replaces the user's file: carry over what pip is configured with now
    # (where it finds torch, say), with the cert moved to ours.
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            timeout=60).stdout
    settings = dict(re.findall(r"^(?:global|:env:)\.([\w-]+)='(.*)'$", listed, re.M))
    settings["cert"] = str(bundle)
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_CERT", "HPCT_BUILD_CA")}
    env.update({"PYTHON": sys.executable, "HPCT_IMAGE_BASE": "localhost/hpct-test-absent:none",
                "PIP_CONFIG_FILE": str(conf)})
    res = _run(_image_script_copy(repo, tmp_path), env, timeout=300)
    if "needs root" in res.stderr:
        pytest.skip("not root")
    # the absent base then fails the build itself; what matters is the bundle it was given
    assert f"(pip CA: {bundle})" in res.stdout, res.stdout + res.stderr


def test_image_script_refuses_an_unknown_argument(repo, tmp_path):
    script = _image_script_copy(repo, tmp_path)
    res = _run(script, {"PATH": "/usr/bin:/bin"}, 60, "--cpu")
    assert res.returncode == 2
    assert "unknown argument '--cpu'" in res.stderr and "fix: bash ci/image.sh [--gpu]" in res.stderr


def _gpu_env() -> dict:
    return {**os.environ, "PYTHON": sys.executable, "HPCT_IMAGE_BASE": "localhost/hpct-test-absent:none"}


@needs_buildah
def test_gpu_image_needs_the_nccl_build_and_says_how_to_make_it(repo, tmp_path):
    script = _image_script_copy(repo, tmp_path)
    res = _run(script, _gpu_env(), 120, "--gpu")
    if "needs root" in res.stderr:
        pytest.skip("not root")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "no NCCL 2.30.7 build in third_party/build/nccl-2.30.7/install and not exactly one drop-in wheel" \
        in res.stderr and "(found none)" in res.stderr
    assert "fix: build it first: hpct-build build nccl=2.30.7 --cuda-arch 80,90" in res.stderr
    assert "or put one prebuilt wheel (hpct-build wheel nccl=2.30.7) in .whl/" in res.stderr


@needs_buildah
def test_gpu_image_refuses_two_prebuilt_nccl_wheels(repo, tmp_path):
    script = _image_script_copy(repo, tmp_path)
    (tmp_path / ".whl").mkdir()
    for series in ("0123456789abcdef", "fedcba9876543210"):
        (tmp_path / ".whl" / f"nvidia_nccl_cu13-2.30.7+hpct.{series}-py3-none-manylinux_2_25_x86_64.whl").write_bytes(b"")
    res = _run(script, _gpu_env(), 120, "--gpu")
    if "needs root" in res.stderr:
        pytest.skip("not root")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "not exactly one drop-in wheel" in res.stderr and "hpct.0123456789abcdef" in res.stderr
