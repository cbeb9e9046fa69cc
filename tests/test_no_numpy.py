"""hpct runs where numpy is not installed (torch does not require it; hpct does not declare it).

Every process here sees a ``numpy`` package that refuses to import, put first on
PYTHONPATH, so torch behaves as in a fresh venv with only torch and the wheel: torch
imports, but ``Tensor.numpy()`` raises "Numpy is not available".
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = pytest.mark.serial


@pytest.fixture
def no_numpy(tmp_path, monkeypatch) -> dict:
    """An environment (also set in os.environ, for child ranks) where numpy cannot be imported."""
    hidden = tmp_path / "hide-numpy"
    (hidden / "numpy").mkdir(parents=True)
    (hidden / "numpy" / "__init__.py").write_text(
        # what a missing package raises (torch catches exactly this type)
        'raise ModuleNotFoundError("No module named \'numpy\' (hidden by the test)", name="numpy")\n')
    path = os.pathsep.join(filter(None, [str(hidden), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PYTHONPATH", path)
    return {**os.environ, "PYTHONPATH": path}


def run_py(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd="/")


@pytest.mark.unit
def test_the_hiding_reproduces_a_venv_without_numpy(no_numpy):
    proc = run_py("import torch\ntry:\n    torch.zeros(2).numpy()\nexcept RuntimeError as e:\n    print(e)\n",
                  no_numpy)
    assert proc.returncode == 0, proc.stderr
    assert "Numpy is not available" in proc.stdout


BUFFERS = r"""
import io, struct, sys, torch
from hpct.distributed.backend.ops import as_bytes, byte_view, to_bytes
assert "numpy" not in sys.modules or sys.modules["numpy"] is None
t = torch.tensor([1.5, -2.0], dtype=torch.float32)
assert to_bytes(t) == struct.pack("<2f", 1.5, -2.0)
b = as_bytes(t)
mv = memoryview(b).cast("B")
assert len(b) == 8 and mv.nbytes == 8 and not mv.readonly
mv[0:4] = to_bytes(torch.tensor([7.25], dtype=torch.float32))
assert t.tolist() == [7.25, -2.0], t                    # the buffer is the tensor's own memory
assert to_bytes(torch.tensor([1, 2, 255], dtype=torch.uint8)) == b"\x01\x02\xff"
assert byte_view(torch.tensor([1], dtype=torch.int32)).tolist() == [1, 0, 0, 0]
assert len(as_bytes(torch.empty(0))) == 0 and byte_view(torch.empty(0, dtype=torch.int64)).numel() == 0
try:
    as_bytes(torch.zeros(3, 4).t())
except ValueError as err:
    assert "contiguous" in str(err)
else:
    raise AssertionError("a non-contiguous tensor was accepted")
state = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "step": 3}
buf = io.BytesIO(); torch.save(state, buf)
payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
back = torch.load(io.BytesIO(to_bytes(payload)), weights_only=False)
assert back["step"] == 3 and torch.equal(back["w"], state["w"])
print("ok")
"""


@pytest.mark.unit
def test_byte_buffers_without_numpy(no_numpy):
    proc = run_py(BUFFERS, no_numpy)
    assert (proc.returncode, proc.stdout) == (0, "ok\n"), proc.stderr


@pytest.mark.multiprocess
def test_every_collective_matches_processgroupgloo_without_numpy(no_numpy, tmp_path):
    """The backend parity run (tests/test_backend.py's workers), with numpy hidden from every rank."""
    from backend_parity import SUPERSET, WORLD, run
    from util import same
    gloo, _ = run(tmp_path, "gloo", [0, 1, 2, 3])
    hpct, _ = run(tmp_path, "hpct", [3, 2, 1, 0])
    def errors(runs):
        return sorted(k for k, v in runs[0]["results"].items() if isinstance(v, str) and v.startswith("ERR"))
    # stock torch's own all_gather_object decodes through Tensor.numpy(): it fails on any
    # backend without numpy; nothing else may
    assert errors(hpct) == ["all_gather_object"], errors(hpct)
    assert errors(gloo) == sorted(SUPERSET | {"all_gather_object"}), errors(gloo)
    mismatches = [f"rank {r} {name}" for r in range(WORLD) for name, g in gloo[r]["results"].items()
                  if not (name in SUPERSET and isinstance(g, str)) and not same(g, hpct[r]["results"][name])]
    assert mismatches == [], mismatches[:20]
    assert len(hpct[0]["results"]) > 80
