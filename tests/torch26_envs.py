"""Two virtual environments of torch 2.6.0 for the patched-torch tests and benchmark (issue 58).

* ``stock``: PyPI's torch 2.6.0 (the sha256-pinned wheel ``hpct-build`` keeps), numpy, pytest,
  expecttest;
* ``patched``: the wheel ``hpct-build wheel torch=2.6.0`` makes from that same wheel, installed
  with plain pip (so its dependencies resolve as a user's would), and the same test packages.

Both also get this checkout's hpct wheel (dist/), for ``hpct doctor`` and the hpct backend.  Each
lives under ~/.cache/hpct, keyed by what goes into it (the interpreter, the requirements, the
patched wheel's sha256), and counts as made only once its ready mark is written, last, so a warm
run reuses them and an interrupted one is made again.  ci/test.sh starts ``python tests/torch26_envs.py`` in the
background after the build tier (log: build/torch26-prepare.log); the tests' fixture calls
``ensure()`` under the same lock, so it waits for that run instead of repeating it.

    python tests/torch26_envs.py            prepare both (prints build/torch26.json's content)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STATE = REPO / "build" / "torch26.json"
LOCK = REPO / "build" / "torch26.lock"
DIST = REPO / "build" / "torch26-dist"
TEST_PACKAGES = ("numpy", "pytest>=7", "expecttest>=0.2")
VERSION = "2.6.0"
PIP_TIMEOUT_S = 1800
LOCK_WAIT_S = 3600


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpct"


def _key(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def _run(cmd: list, what: str, timeout: float = PIP_TIMEOUT_S, cwd: Path | None = None) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout


def _venv(name: str, requirements: list[str], log) -> Path:
    """A cached venv named ``name`` holding ``requirements``.  It is made where it stays (its console
    scripts name their interpreter by absolute path, so a renamed venv's torchrun would not start)
    and is complete only once its ready mark is written last; one without it is made again."""
    path = _cache() / name
    ready = path / ".hpct-ready"
    if ready.is_file():
        print(f"torch26: cache hit: {path}", file=log, flush=True)
        return path
    shutil.rmtree(path, ignore_errors=True)
    started = time.monotonic()
    _run([sys.executable, "-m", "venv", path], f"python -m venv {path}")
    _run([path / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", *requirements],
         f"pip install into {path}")
    ready.write_text(json.dumps(requirements) + "\n")
    print(f"torch26: made {path} in {time.monotonic() - started:.0f} s", file=log, flush=True)
    return path


def _hpct_wheel() -> Path:
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    found = sorted((REPO / "dist").glob(f"hpct-*-{tag}-*.whl"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RuntimeError(f"no hpct wheel for {tag} in dist/: build it first (python -m hpct.builder wheel)")
    return found[-1]


def _prepare(log) -> dict:
    started = time.monotonic()
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    # The patched wheel first: it downloads the pinned stock wheel, which the stock venv then installs.
    out = _run([sys.executable, "-m", "hpct.builder", "wheel", f"torch={VERSION}", "--dist", DIST],
               "hpct-build wheel torch=2.6.0", timeout=3 * 3600, cwd=REPO)
    patched_wheel = Path(out.strip().splitlines()[-1])
    from hpct.builder.layout import Layout
    from hpct.builder.sources import load_manifest, sha256_of
    pin = load_manifest(Layout(REPO), "pytorch").extra["wheel"]["files"][tag]
    stock_wheel = REPO / "third_party" / "cache" / "torch-wheels" / pin["file"]
    stock = _venv(f"venv-torch-{VERSION}-{_key(tag, pin['sha256'], *TEST_PACKAGES)}",
                  [str(stock_wheel), *TEST_PACKAGES], log)
    patched = _venv(f"venv-torch-{VERSION}+hpct-{_key(tag, sha256_of(patched_wheel), *TEST_PACKAGES)}",
                    [str(patched_wheel), *TEST_PACKAGES], log)
    for stale in _cache().glob(f"venv-torch-{VERSION}+hpct-*"):     # 4.7 GB each: only the current one stays
        if stale != patched:
            shutil.rmtree(stale, ignore_errors=True)
    hpct = _hpct_wheel()
    for venv in (stock, patched):
        _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
              "--disable-pip-version-check", hpct], f"pip install {hpct.name} into {venv}")
    state = {"stock": str(stock / "bin" / "python"), "patched": str(patched / "bin" / "python"),
             "patched_wheel": str(patched_wheel), "stock_wheel": str(stock_wheel), "hpct_wheel": str(hpct),
             "seconds": round(time.monotonic() - started, 1)}
    STATE.parent.mkdir(parents=True, exist_ok=True)
    tmp = STATE.with_name(STATE.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, STATE)
    return state


def ensure(log=None) -> dict:
    """Both environments ready (made now, or waited for under the prepare's lock): build/torch26.json."""
    from hpct.builder.locks import file_lock
    log = log or sys.stderr
    with file_lock(LOCK, "the torch 2.6.0 environments (the prepare's log: build/torch26-prepare.log)",
                   wait_s=LOCK_WAIT_S):
        return _prepare(log)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))      # the checkout's builder, as ci/test.sh runs it before the tests
    print(json.dumps(ensure(sys.stdout), indent=1))
