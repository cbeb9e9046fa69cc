"""Build the ``hpct`` wheel (scikit-build-core) against the patched Gloo prefix."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import BuildError, ToolchainError
from .builder import build_gloo, run_logged
from .layout import Layout
from .progress import Progress
from .sources import load_manifest

BUILD_REQUIREMENTS = ("scikit_build_core", "pybind11")


def build_wheel(layout: Layout, progress: Progress, install: bool = False) -> Path:
    missing = [m for m in BUILD_REQUIREMENTS if importlib.util.find_spec(m) is None]
    if missing:
        # No build isolation: an isolated build would resolve an unpinned torch-free
        # environment from the network each time; the project's setup installs these.
        raise ToolchainError(f"missing Python build requirement(s): {', '.join(missing)}",
                             fix="pip install scikit-build-core pybind11  (or run ci/setup.sh)")
    gloo = load_manifest(layout, "gloo")
    prefix = build_gloo(layout, gloo, progress)
    log = layout.root / "build" / "wheel.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("# hpct-build wheel\n")
    dist = layout.root / "dist"
    dist.mkdir(exist_ok=True)
    env = {**os.environ, "HPCT_GLOO_PREFIX": str(prefix)}
    progress.step(f"building the hpct wheel; log: {log}")
    with tempfile.TemporaryDirectory(prefix="hpct-wheel-", dir=dist) as tmp:
        run_logged([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                    "-w", tmp, str(layout.root)], log, progress, "pip wheel", env=env)
        built = sorted(Path(tmp).glob("hpct-*.whl"))
        if not built:
            raise BuildError("pip wheel produced no hpct wheel", fix=f"see the log: {log}")
        wheel = dist / built[0].name
        os.replace(built[0], wheel)
    progress.step(f"wheel: {wheel}")
    if install:
        run_logged([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(wheel)],
                   log, progress, "pip install", env=env)
        progress.step("installed the wheel")
    return wheel


def installed_wheel_info() -> dict:
    """What this interpreter has installed (for ``status``), asked of a fresh process run
    outside the checkout: here ``hpct`` may be imported from the source tree itself."""
    probe = ("import json, importlib.metadata as md\n"
             "try:\n    info = {'installed': True, 'hpct_version': md.version('hpct')}\n"
             "except md.PackageNotFoundError:\n    info = {'installed': False}\n"
             "if info['installed']:\n"
             "    try:\n        import hpct._gloo as ext\n"
             "        info.update(extension=True, series_id=ext.series_id())\n"
             "    except ImportError as err:\n"
             "        info.update(extension=False, extension_error=str(err))\n"
             "print(json.dumps(info))\n")
    proc = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd="/")
    if proc.returncode != 0:
        return {"installed": False, "extension_error": proc.stderr.strip()[-500:]}
    return json.loads(proc.stdout)


def wheel_files(layout: Layout) -> list[Path]:
    return sorted((layout.root / "dist").glob("hpct-*.whl"))


def clean_dist(layout: Layout) -> None:
    shutil.rmtree(layout.root / "dist", ignore_errors=True)
