"""The checks behind ``hpct doctor``: is this the patched build, and is this node ready?

Each check returns ``Row``s and never raises: an unexpected error becomes a
failing row, so one broken component cannot hide the state of the others.
Everything a check looks at comes through ``Probe`` (environment, /proc/sys
root, module importer, library search path), which is what the tests replace.

Status meanings: ``ok``; ``fail`` (a required check: doctor exits non-zero);
``warn`` (works, but a feature is unavailable); ``info`` (a fact, e.g. stock
PyTorch); ``skip`` (could not run because an earlier row failed).

This module holds the doctor's vocabulary (``Row``, ``Probe``), the rows of Python, torch,
the extension, the configuration and the ports, and the table; the c10d row is
doctor_c10d.py's, the NCCL rows doctor_nccl.py's, and doctor_run.py runs them all in order.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from .requirements import (TORCH_PATCHED_PIN, install_fix, python_floor_text, runtime_requirements, satisfies,
                           torch_fix, unmet)

TORCH_PIN = TORCH_PATCHED_PIN           # DESIGN.md's PyTorch pin (the stock CPU pin: hpct.requirements)
SERIES_FILE = Path(__file__).with_name("_series.json")

_BUILD_FIX = "run hpct-build wheel --install in the hpct checkout (it builds and installs the wheel)"


@dataclass
class Row:
    check: str
    status: str                         # ok | fail | warn | info | skip
    detail: str
    fix: str | None = None


@dataclass
class Probe:
    """What the checks look at; defaults are the live process and node."""

    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    proc_sys: str = "/proc/sys"
    import_module: Callable[[str], object] = importlib.import_module
    series_file: Path = SERIES_FILE
    sys_path: Sequence[str] = field(default_factory=lambda: list(sys.path))
    nccl_paths: Sequence[str] | None = None     # fixed candidates instead of the search
    use_ldconfig: bool = True
    bind_host: str = "0.0.0.0"
    metadata: Callable[[str], object] = importlib.metadata.metadata    # hpct's own Requires-*
    dist_version: Callable[[str], str] = importlib.metadata.version     # installed dependencies
    # The PyTorch series hpct carries; None: its build inputs' (doctor_c10d.expected_torch_series,
    # which run_checks fills in: this module is below the c10d row, which reads Row from it).
    torch_series: Callable[[], str | None] | None = None


def _hpct_metadata(probe: Probe):
    """hpct's installed metadata, or None when it runs from a source tree (not installed)."""
    try:
        return probe.metadata("hpct")
    except importlib.metadata.PackageNotFoundError:
        return None


def _requirements(probe: Probe):
    """hpct's runtime requirements from its metadata; None when hpct is not installed."""
    meta = _hpct_metadata(probe)
    return None if meta is None else runtime_requirements(meta.get_all("Requires-Dist") or [])


def expected_series_id(path: Path | None = None) -> str | None:
    """The Gloo series id this package was built for (``hpct/_series.json``'s "series_id").

    None when the file is absent (a source checkout): "unknown", not a failure.
    A file that exists but cannot be read is an error (ValueError).
    """
    path = SERIES_FILE if path is None else Path(path)
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())["series_id"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is unreadable or has no \"series_id\": {err}") from None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{path}: \"series_id\" must be a non-empty string")
    return value


def check_python(probe: Probe | None = None) -> Row:
    """The running interpreter against hpct's own ``Requires-Python`` (pyproject's requires-python)."""
    v = sys.version_info
    text = f"{v.major}.{v.minor}.{v.micro} ({sys.executable})"
    meta = _hpct_metadata(Probe() if probe is None else probe)
    spec = meta.get("Requires-Python") if meta is not None else None
    if not spec:
        return Row("python", "ok", f"{text}; hpct's requires-python unknown (hpct is not installed)")
    if not satisfies(f"{v.major}.{v.minor}.{v.micro}", spec):
        return Row("python", "fail", f"{text} does not satisfy hpct's requires-python {spec}",
                   f"use {python_floor_text(spec)}")
    return Row("python", "ok", f"{text}, requires {spec}")


def check_torch(probe: Probe) -> tuple[Row, object | None]:
    fix = torch_fix()
    try:
        torch = probe.import_module("torch")
    except ImportError as err:
        return Row("pytorch", "fail", f"not importable ({err})", fix), None
    except Exception as err:    # a broken install raises OSError, RuntimeError, ...
        return Row("pytorch", "fail", f"import failed: {type(err).__name__}: {err}", fix), None
    version = str(getattr(torch, "__version__", "?"))
    reqs = _requirements(probe) or []
    spec = next((r.spec for r in reqs if r.name == "torch"), "")
    try:
        fits = satisfies(version, spec)
    except ValueError:
        fits = False
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if not fits:
        return Row("pytorch", "fail", f"{version} is outside hpct's supported range torch{spec}",
                   torch_fix(installed=version, cuda=cuda)), torch
    return Row("pytorch", "ok", f"{version} ({'CUDA ' + cuda if cuda else 'CPU-only'})"), torch


def _patch_names(ext, series_file: Path) -> tuple[list[str], str]:
    """The extension's own list when it has one, else the list the build recorded beside it."""
    if hasattr(ext, "gloo_series"):
        return [str(n) for n in ext.gloo_series()], "compiled in"
    try:
        names = json.loads(series_file.read_text()).get("patches", [])
        return [str(n) for n in names], f"from {series_file.name}"
    except (OSError, ValueError, AttributeError):
        return [], "not recorded"


def check_extension(probe: Probe) -> list[Row]:
    try:
        ext = probe.import_module("hpct._gloo")
        series_id = str(ext.series_id())
        names, source = _patch_names(ext, probe.series_file)
    except Exception as err:    # ImportError, or a module that lacks the series functions
        return [Row("hpct extension", "fail", f"hpct._gloo does not load ({type(err).__name__}: {err})",
                    _BUILD_FIX),
                Row("gloo series", "skip", "the extension is not loaded")]
    rows = [Row("hpct extension", "ok", f"{getattr(ext, '__file__', 'hpct._gloo')}: Gloo series {series_id} "
                                        f"({len(names)} patches, {source}; `hpct doctor --json` lists them)")]
    rows[0].data = {"series_id": series_id, "patches": names}
    try:
        expected = expected_series_id(probe.series_file)
    except ValueError as err:
        return rows + [Row("gloo series", "fail", str(err), f"reinstall hpct ({_BUILD_FIX})")]
    if expected is None:
        rows.append(Row("gloo series", "info", f"{series_id}; expected series unknown (no {probe.series_file.name})"))
    elif expected != series_id:
        rows.append(Row("gloo series", "fail",
                        f"the extension carries {series_id} but this package expects {expected}",
                        f"the extension and the Python files come from different builds: {_BUILD_FIX}"))
    else:
        rows.append(Row("gloo series", "ok", f"{series_id} (as expected)"))
    return rows


def check_dependencies(probe: Probe) -> Row:
    """Every runtime dependency hpct declares, other than torch (the pytorch row checks it)."""
    reqs = _requirements(probe)
    if reqs is None:
        return Row("dependencies", "info", "hpct's metadata not found (running from a source tree?)")
    others = [r for r in reqs if r.name != "torch"]
    if not others:
        return Row("dependencies", "ok", "none besides torch (declared: "
                   f"{', '.join(str(r) for r in reqs) or 'nothing'})")
    bad = unmet(others, probe.dist_version)
    if bad:
        return Row("dependencies", "fail", "; ".join(f"{r}: {why}" for r, why in bad),
                   "; ".join(install_fix(r) for r, _ in bad))
    return Row("dependencies", "ok", ", ".join(f"{r.name} {probe.dist_version(r.name)} ({r.spec or 'any'})"
                                                for r in others))


def check_torch_backends(probe: Probe, torch) -> Row:
    if torch is None:
        return Row("torch backends", "skip", "PyTorch is not importable")
    try:
        dist = probe.import_module("torch.distributed")
        if not dist.is_available():
            return Row("torch backends", "fail", "torch.distributed is not available in this build",
                       f"install a PyTorch build with distributed support: {torch_fix()}")
        gloo, nccl = bool(dist.is_gloo_available()), bool(dist.is_nccl_available())
    except Exception as err:
        return Row("torch backends", "fail", f"{type(err).__name__}: {err}", torch_fix())
    detail = f"gloo {'yes' if gloo else 'no'}, nccl {'yes' if nccl else 'no'}"
    if not gloo:
        return Row("torch backends", "fail", detail, f"install a PyTorch build with Gloo: {torch_fix()}")
    return Row("torch backends", "ok", detail)


def check_config(probe: Probe) -> tuple[Row, object | None]:
    from .config import Config, nproc_source
    from .errors import ConfigError
    try:
        config = Config.from_mapping(probe.env)
    except ConfigError as err:
        return Row("configuration", "fail", err.problem, err.fix), None
    text = (f"rootless {'on' if config.use_rootless else 'off'}, {len(config.hosts)} host(s) x "
            f"{config.nproc_per_node} process(es) (from {nproc_source(probe.env)}), {config.port_slots} slots, gloo block "
            f"{config.blocks['gloo'].start}-{config.blocks['gloo'].stop - 1}, nccl block "
            f"{config.blocks['nccl'].start}-{config.blocks['nccl'].stop - 1}")
    return Row("configuration", "ok", text), config


def check_kernel_ports(probe: Probe, plan) -> Row:
    from .errors import SysctlError
    from .ports import check_plan
    from .sysctl import Sysctl
    try:
        sysctl = Sysctl(probe.proc_sys)
        low, high = sysctl.port_range()
        problems = check_plan(plan, (low, high), sysctl.reserved_ports())
    except SysctlError as err:
        return Row("kernel port ranges", "fail", err.problem, err.fix)
    if problems:
        return Row("kernel port ranges", "fail", "; ".join(p.message for p in problems), problems[0].fix)
    return Row("kernel port ranges", "ok", f"ephemeral range {low}-{high}; every block port is safe")


def check_free_ports(probe: Probe, config, plan) -> Row:
    from .ports import busy_ports
    local = [config.local_rank] if config.local_rank is not None else range(config.nproc_per_node)
    ports = sorted({p for b, _ in plan.bases for l in local for p in plan.local_ports(b, l)})
    who = f"local rank {config.local_rank}" if config.local_rank is not None else "all local ranks"
    busy = busy_ports(ports, probe.bind_host)
    if not busy:
        return Row("free ports", "ok", f"{len(ports)} ports of {who} are free")
    first = min(busy)
    from .ports import compress
    return Row("free ports", "fail", f"in use: {compress(busy)} ({busy[first]}) of {who}",
               f"find the owner with `ss -ltnp 'sport = :{first}'` and stop it, or move the blocks "
               f"with HPCT_PORT_BASE")


def failures(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r.status == "fail"]


def render_table(rows: Sequence[Row]) -> str:
    width = max(len(r.check) for r in rows)
    lines = [f"{'STATUS':6}  {'CHECK':{width}}  DETAIL"]
    for r in rows:
        lines.append(f"{r.status.upper() if r.status == 'fail' else r.status:6}  {r.check:{width}}  {r.detail}")
        if r.fix and r.status in ("fail", "warn"):
            lines.append(f"{'':6}  {'':{width}}  fix: {r.fix}")
    bad = failures(rows)
    lines.append(f"{len(bad)} required check(s) failed" if bad else "all required checks passed")
    return "\n".join(lines)


def as_json(rows: Sequence[Row]) -> dict:
    """``{"ok", "checks"}``, plus ``"nccl"`` (torch's and hpct's libnccl: path, version, patched,
    series_id, how, matches_torch_pin) when the rows include the NCCL check, and ``"gloo_series"``
    (the extension's series id and its patches) when the extension loads; fields only added."""
    doc = {"ok": not failures(rows), "checks": [asdict(r) for r in rows]}
    for key, check in (("nccl", "nccl for hpct"), ("gloo_series", "hpct extension")):
        data = next((getattr(r, "data", None) for r in rows if r.check == check), None)
        if data is not None:
            doc[key] = data
    return doc
