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


ROUTING = r'''
import datetime, os, torch
import hpct.distributed as hd
from hpct.ports import free_port_block
os.environ["HPCT_PORT_BASE"] = str(free_port_block(16))


class Recorder:                      # an engine for the "meta" device that records its calls
    device_type, failure = "meta", None
    def __init__(self): self.calls = []
    def allreduce(self, tensors, op): self.calls.append(("allreduce", len(tensors))); return "meta-work"
    def start_coalescing(self): self.calls.append(("start",))
    def end_coalescing(self): self.calls.append(("end",)); return "group-work"
    def set_timeout(self, s): self.calls.append(("timeout", s))
    def abort(self, reason): self.calls.append(("abort",))
    def shutdown(self, timeout): self.calls.append(("shutdown",))


hd.init_process_group(rank=0, world_size=1)
pg = hd.live_groups()[0]
rec = Recorder()
pg.attach(rec)
assert pg.allreduce([torch.zeros(2, device="meta")]) == "meta-work"
try:
    pg.allreduce([torch.zeros(1, device="meta"), torch.zeros(1, device="meta")])
    raise SystemExit("several tensors per rank were taken on a non-CPU engine")
except hd.HpctArgumentError as err:
    assert "requires a single-element tensor list on meta" in str(err), err
pg._start_coalescing(torch.device("meta"))
assert pg._end_coalescing(torch.device("meta")) == "group-work"
pg._set_default_timeout(datetime.timedelta(seconds=7))
assert pg.context.timeout == 7.0 and pg.options._timeout == datetime.timedelta(seconds=7)
t = torch.ones(3)
pg.allreduce([t]).wait()                     # the CPU engine still serves CPU tensors
assert t.tolist() == [1.0, 1.0, 1.0]
hd.shutdown_all()
print(rec.calls)
'''


def test_the_facade_routes_by_device_type_and_runs_the_lifecycle_on_every_engine():
    out = subprocess.run([sys.executable, "-P", "-c", ROUTING], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == ("[('allreduce', 1), ('start',), ('end',), ('timeout', 7.0), ('shutdown',)]")
