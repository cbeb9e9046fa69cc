"""hpct's drop-in NCCL under the torch users install (issue 28, item 3).

ci/torch_tier.sh packages the suite's NCCL 2.30.7 build as ``nvidia-nccl-cu13 2.30.7+hpct.<series>``
and pip installs it into torch 2.15's environment with pip's resolver, under torch's own pin
``nvidia-nccl-cu13==2.30.7``.  These tests then check what a user gets: ``import torch`` maps
hpct's libnccl (not a copy elsewhere), reports 2.30.7, the library is rootless, and ``hpct
doctor`` is green on it.  Where the stock wheel is installed (the CPU pin, or no NCCL build)
they skip, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit


def _drop_in():
    try:
        dist = metadata.distribution("nvidia-nccl-cu13")
    except metadata.PackageNotFoundError:
        pytest.skip("no nvidia-nccl-cu13 here (a CPU torch): the torch tier checks the drop-in")
    if "+hpct." not in dist.version:
        pytest.skip(f"nvidia-nccl-cu13 {dist.version} is NVIDIA's: ci/torch_tier.sh installs hpct's "
                    "drop-in when an NCCL 2.30.7 build is present (the slow tier makes it)")
    return dist


def test_import_torch_maps_hpcts_libnccl_and_reports_2_30_7():
    dist = _drop_in()
    import torch
    from hpct.distributed.nccl.find import exports, torch_loaded_libnccl
    from hpct.distributed.nccl.library import NcclLibrary
    assert torch.version.cuda is not None, "this check needs a CUDA build of torch"
    mapped = torch_loaded_libnccl()
    assert mapped is not None, "import torch mapped no libnccl"
    # torch.cuda.nccl.version() is the NCCL torch was compiled against; ask the library it runs on.
    assert NcclLibrary(mapped, how="loaded by torch", shared_with_torch=True).version == 23007
    shipped = {os.path.realpath(dist.locate_file(f)) for f in dist.files if "libnccl.so" in str(f)}
    assert os.path.realpath(mapped) in shipped, (mapped, shipped)
    assert exports(mapped, "ncclCommInitRankRootless")
    # The wheel's own record of the series it carries.
    series = dist.version.split("+hpct.")[1]
    stamp = [f for f in dist.files if str(f).endswith("hpct-series.json")]
    if stamp:
        assert json.loads(Path(dist.locate_file(stamp[0])).read_text())["series_id"] == series


def test_doctor_is_green_on_the_drop_in():
    _drop_in()
    proc = subprocess.run([sys.executable, "-P", "-c", "from hpct.cli import main; main()", "doctor", "--json"],
                          capture_output=True, text=True, timeout=120)
    report = json.loads(proc.stdout)
    bad = [row for row in report["checks"] if row["status"] not in ("ok", "info")]
    assert proc.returncode == 0 and report["ok"] and not bad, (bad, proc.stderr[-2000:])
    rows = {row["check"]: row for row in report["checks"]}
    # torch's libnccl is hpct's: the NCCL engine uses the library torch already mapped
    assert rows["libnccl"]["status"] == "ok" and "2.30.7" in rows["libnccl"]["detail"], rows["libnccl"]
    assert rows["nccl for hpct"]["status"] == "ok", rows["nccl for hpct"]


_MAPPED = """
import sys
sys.path.insert(0, sys.argv[1])
import torch, proof_settings
print(proof_settings.mapped_libnccl())
"""


def test_the_gpu_proofs_settings_leave_torch_one_libnccl_the_packs(tmp_path):
    """The GPU proof's rule that both stacks run one libnccl (tests/gpu/proof_settings.py), with a
    real CUDA torch and no GPU.  A copy of torch's libnccl at another path stands for the pack's.
    LD_PRELOAD alone leaves two mapped, because torch's __init__ opens its wheel's by path (what the
    first device run found, torch 2.11); with the overlay first on PYTHONPATH only the pack's is."""
    import shutil
    import torch
    from hpct.distributed.nccl.find import torch_loaded_libnccl
    if torch.version.cuda is None:
        pytest.skip("a CPU torch maps no libnccl: the torch tier's CUDA torch 2.15 runs this")
    theirs = torch_loaded_libnccl()
    assert theirs, "import torch mapped no libnccl"
    gpu_tests = Path(__file__).resolve().parent / "gpu"
    sys.path.insert(0, str(gpu_tests))
    import proof_settings as ps
    lib = tmp_path / "pack" / "nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    shutil.copyfile(os.path.realpath(theirs), lib)
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTHONPATH")}

    def mapped(env):
        proc = subprocess.run([sys.executable, "-P", "-c", _MAPPED, str(gpu_tests)], env={**base, **env},
                              capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1].replace("'", '"'))
    without = mapped(ps.proof_env(lib, None, base=base))
    assert sorted(without) == sorted({os.path.realpath(lib), os.path.realpath(theirs)}), without
    overlay = ps.torch_overlay(lib, tmp_path / "overlay")
    assert mapped(ps.proof_env(lib, None, base=base, overlay=overlay)) == [os.path.realpath(lib)]
