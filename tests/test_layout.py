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
from hpct.distributed.backend import checks

pytestmark = pytest.mark.unit

RUNTIME = Path(hd.__file__).parent
PACKAGE = Path(hpct.__file__).parent
# What each concern of hpct.distributed may import of the others (docs/architecture.md draws it).
MAY_IMPORT = {"backend": set(), "nccl": set(), "diagnostics": set(), "training": {"backend"},
              "membership": {"backend", "nccl"}}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    """Every Python module of the installed hpct, by its dotted name."""
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, known) -> set[str]:
    """The hpct modules ``name`` imports, at any depth of the file (a function's own import too): for
    ``from X import y``, the module X.y when it is one, else X."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [(base, a.name) for a in node.names]
        else:
            continue
        for module, attr in targets:
            if attr is not None and f"{module}.{attr}" in known:
                found.add(f"{module}.{attr}")
            elif module in known:
                found.add(module)
    return found - {name}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan), each a circle of imports."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_importing_the_runtime_loads_no_harness_and_no_build_pipeline():
    code = ("import sys, hpct.distributed; "
            "print(sorted(m for m in sys.modules if m.startswith(('hpct.demo', 'hpct.builder', 'hpct.build', "
            "'hpct.launch', 'hpct.testing'))))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_module_of_hpct_imports_itself_in_a_circle():
    graph = _graph()
    assert graph["hpct.distributed.membership.recovery"] >= {"hpct.distributed.membership.world"}, \
        "the graph is read: recovery imports world"
    assert _circles(graph) == []


def test_the_library_imports_nothing_of_the_launcher():
    """hpct.distributed and hpct/launch share the agents' wire (hpct/wire.py); neither imports the
    other for it.  A worker's library never loads the launcher."""
    offenders = {m: sorted(d) for m, d in _graph().items()
                 if m.startswith("hpct.distributed") and any(i.startswith("hpct.launch") for i in d)}
    assert offenders == {}


def test_runtime_concerns_import_in_one_direction():
    # membership -> backend/nccl, training -> backend; the engines and the facade import no concern
    # above them, and only membership/world.py builds groups.
    graph = _graph()
    concerns = {p.name for p in RUNTIME.iterdir() if (p / "__init__.py").is_file()}
    assert concerns == set(MAY_IMPORT), concerns
    prefix = "hpct.distributed."
    for name, deps in graph.items():
        if not name.startswith(prefix) or name.count(".") < 3:
            continue
        own = name[len(prefix):].split(".")[0]
        others = {d[len(prefix):].split(".")[0] for d in deps if d.startswith(prefix) and d.count(".") >= 2}
        assert others - {own} <= MAY_IMPORT[own], f"{name} imports {sorted(others - {own} - MAY_IMPORT[own])}"
    importers_of_group = {m for m, d in graph.items() if prefix + "backend.group" in d and m != "hpct.distributed"}
    assert importers_of_group == {prefix + "membership.world"}, importers_of_group
    for low in ("slots", "world_state", "agent_link"):
        assert prefix + "membership.world" not in graph[prefix + "membership." + low], f"{low} imports world"


def test_the_modules_docs_name_keep_their_old_paths():
    import importlib

    from hpct.distributed.diagnostics import profile_comm
    from hpct.distributed.training import diloco, striping
    for old, new in (("diloco", diloco), ("striping", striping), ("profile_comm", profile_comm)):
        assert importlib.import_module(f"hpct.distributed.{old}") is new
    from hpct.distributed.diloco import DiLoCo
    from hpct.distributed.striping import StripedGroup
    assert (DiLoCo, StripedGroup) == (diloco.DiLoCo, striping.StripedGroup)
    assert hd.profile_comm is profile_comm.profile_comm, "the package exports the function, not the module"


def test_harness_lives_beside_the_demo_not_in_the_runtime():
    assert not any((RUNTIME / f"{m}.py").exists() for m in ("agent", "trainer", "measure"))
    demo = Path(hpct.__file__).parent / "demo"
    assert all((demo / f"{m}.py").is_file() for m in ("agent", "trainer", "measure"))


def test_the_installed_harness_carries_what_it_runs():
    """The tests and benchmarks import the harness from the installed hpct (hpct.testing), never
    from the checkout; its null NCCL compiles null.c from beside null.py at run time, so the wheel
    carries that source with the package's modules."""
    from hpct.testing.nccl_sim import null
    assert Path(null.__file__).is_relative_to(Path(hpct.__file__).parent)
    assert null.SOURCE.is_file(), f"{null.SOURCE}: not installed with hpct.testing"


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
