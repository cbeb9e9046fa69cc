"""Shrink (issue 18, item 1): survivors go on with fewer ranks, no store, no replacement.

4 ranks train; rank 1 leaves; the other three shrink the default group (torch's
``dist.shrink_group`` and ``hd.shrink``, one job each) and train on at world 3.  The result
must be bit-identical to a fresh 3-rank world that starts from the shrunk world's state and
trains on the same data.  The same jobs check that bad input is refused with torch's words
and changes nothing, that the shrink destroys the other groups, and that a subgroup shrinks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from hpct.demo.agent import free_port_block
from util import forked_job
from util import REPO

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = pytest.mark.serial



WORKER = REPO / "tests" / "elastic_worker.py"
DEADLINE = 120.0


def run(out: Path, world: int, *args: str) -> list[dict]:
    import sys
    out.mkdir(parents=True, exist_ok=True)
    job = forked_job([sys.executable, str(WORKER), *args], world, free_port_block(8 * 4), out,
                     time.monotonic() + DEADLINE, env={"HPCT_CONNECT_TIMEOUT": "30"})
    with job:
        job.start_all()
        codes = job.wait_all()
        outputs = [job.output(r) for r in range(world)]
    assert codes == {r: 0 for r in range(world)}, "\n".join(outputs)
    return [json.loads((out / f"res-{r}.json").read_text()) if (out / f"res-{r}.json").exists() else {}
            for r in range(world)]


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].view(torch.uint8).equal(b[k].view(torch.uint8)) for k in a)


@pytest.fixture(scope="module", params=["torch", "hd"])
def shrunk(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"shrink-{request.param}")
    return request.param, out, run(out, 4, request.param, str(out))


@pytest.mark.multiprocess
def test_bad_input_is_refused_with_torchs_words_and_changes_nothing(shrunk):
    method, _, res = shrunk
    kind = "HpctArgumentError" if method == "hd" else ""
    for r in range(4):
        got = res[r]
        assert f"Current rank {r} is in the exclusion list and should not call shrink_group()" in got["self"]
        assert "Cannot exclude all 4 ranks from process group" in got["all"]
        assert "Rank 7 at index 0 is out of bounds for group size 4" in got["unknown"]
        assert "Duplicate rank 2 found in ranks_to_exclude at index 1" in got["duplicate"]
        assert "ranks_to_exclude cannot be empty" in got["empty"]
        for name in ("self", "all", "unknown", "duplicate", "empty"):
            assert got[name].startswith(kind), got[name]
            if method == "hd":
                assert "shrink refused, nothing changed" in got[name] and "fix: pass ranks_to_exclude" in got[name]
        assert got["after_bad"] == [4.0, 4, r, 0]


@pytest.mark.multiprocess
def test_shrink_renumbers_moves_to_the_next_generation_and_destroys_other_groups(shrunk):
    _, _, res = shrunk
    assert set(res[1]) == {"self", "all", "unknown", "duplicate", "empty", "after_bad"}   # it left
    for old, new in ((0, 0), (2, 1), (3, 2)):
        assert res[old]["world"] == [True, new, 3, 1], res[old]
        assert res[old]["other_destroyed"] and res[old]["live_groups"] == 1
        assert res[old]["other_used"] != "no error"
        assert res[old]["sub_before"] == 3.0


@pytest.mark.multiprocess
def test_a_subgroup_shrinks_to_its_survivors_at_its_next_generation(shrunk):
    _, _, res = shrunk
    # new ranks 1 and 2 (old 2 and 3) keep the subgroup; their listening addresses are old 2's and 3's
    assert res[2]["sub_after"] == [3.0, 2, 0, 1, [1, 2]]
    assert res[3]["sub_after"] == [3.0, 2, 1, 1, [1, 2]]
    assert "sub_after" not in res[0]


@pytest.mark.multiprocess
def test_training_after_the_shrink_is_bit_identical_to_a_fresh_three_rank_world(shrunk, tmp_path):
    _, out, _ = shrunk
    run(tmp_path, 3, "ref", str(tmp_path), str(out / "ckpt.pt"))
    finals = [torch.load(out / f"final-{r}.pt") for r in range(3)]
    refs = [torch.load(tmp_path / f"final-{r}.pt") for r in range(3)]
    assert all(identical(finals[0], f) for f in finals[1:] + refs)
    start = torch.load(out / "ckpt.pt")["model"]
    assert not identical(start, finals[0])       # it did train after the shrink


@pytest.mark.unit
def test_a_plan_that_does_not_fit_the_world_is_refused_before_anything_starts():
    import hpct.distributed as hd
    from hpct.errors import ConfigError
    with pytest.raises(ConfigError, match=r"plan_ranks places 2 ranks in the port plan, but the world has 3"
                                          r"(.|\n)*fix: pass one plan place per global rank"):
        hd.init_process_group(0, 3, plan_ranks=[0, 2])
