"""The house rules of the installed package: what imports what, one error hierarchy, dispatch by device.

These hold the layout of docs/architecture.md in place: a training job's import of
hpct.distributed pulls in no harness, the runtime modules import in one direction, every
error is an HpctError with its own exit code, and a tensor on a device no engine serves is
refused at the call with a message that names the device and the fix.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hpct
import hpct.distributed as hd
from hpct import errors
from hpct.distributed import checks

pytestmark = pytest.mark.unit

RUNTIME = Path(hd.__file__).parent


def _imports(path: Path) -> set[str]:
    """The hpct.distributed siblings a module imports (relative imports, any depth in the file)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                names.add(node.module.split(".")[0])
            else:
                names.update(a.name for a in node.names)
    return names


def test_importing_the_runtime_loads_no_harness_and_no_build_pipeline():
    code = ("import sys, hpct.distributed; "
            "print(sorted(m for m in sys.modules if m.startswith(('hpct.demo', 'hpct.builder', 'hpct.build'))))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_runtime_modules_import_in_one_direction():
    # world -> group -> engines/monitor/checks -> ops/work: nothing below the facade imports it
    # (the old backend <-> monitor cycle), and only world builds groups.
    deps = {p.stem: _imports(p) for p in RUNTIME.glob("*.py") if p.stem != "__init__"}
    assert "group" in deps and "gloo_engine" in deps and "backend" not in deps
    importers_of_group = {m for m, d in deps.items() if "group" in d}
    assert importers_of_group == {"world"}, importers_of_group
    for low in ("gloo_engine", "monitor", "checks", "ops", "work", "slots", "state"):
        assert "world" not in deps[low], f"{low} imports world"


def test_harness_lives_beside_the_demo_not_in_the_runtime():
    assert not any((RUNTIME / f"{m}.py").exists() for m in ("agent", "trainer", "measure"))
    demo = Path(hpct.__file__).parent / "demo"
    assert all((demo / f"{m}.py").is_file() for m in ("agent", "trainer", "measure"))


def test_one_hierarchy_with_distinct_exit_codes():
    codes = errors.EXIT_CODES
    assert len(set(codes.values())) == len(codes), codes
    assert {"CollectiveError", "HpctArgumentError", "TransportError"} <= set(codes)
    for name in codes:
        assert issubclass(getattr(errors, name), errors.HpctError)
    # a failed collective is a RuntimeError, as torch's backends raise; a refusal is also a ValueError
    assert issubclass(errors.HpctError, RuntimeError)
    assert issubclass(errors.HpctArgumentError, ValueError)
    assert hd.HpctError is errors.HpctError and hd.CollectiveError is errors.CollectiveError
    assert hd.HpctArgumentError is errors.HpctArgumentError


def test_tensors_on_several_device_types_are_refused_at_the_call():
    with pytest.raises(hd.HpctArgumentError, match=r"hpct allreduce: tensors on several device types "
                                                   r"\(cpu, meta\); pass the tensors of one call"):
        checks.device("allreduce", [torch.zeros(1), torch.zeros(1, device="meta")], {"cpu": None})


def test_a_device_no_engine_serves_is_named_with_the_fix():
    with pytest.raises(hd.HpctArgumentError) as err:
        checks.device("broadcast", [torch.zeros(1, device="meta")], {"cpu": None})
    msg = str(err.value)
    assert "hpct broadcast: unsupported device type meta: this group serves cpu tensors" in msg
    assert "hpct doctor" in msg
    assert checks.device("broadcast", [torch.zeros(1)], {"cpu": None}) == "cpu"
    assert checks.device("barrier", [], {"cpu": None}) == "cpu"
