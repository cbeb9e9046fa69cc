"""DiLoCo (hpct.distributed.training.diloco, issue 18 item 5): outer syncs keep every member's global
parameters bit-identical, average what they must, and move what the options say."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from hpct.demo.agent import free_port_block
from util import forked_job

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = pytest.mark.serial

WORKER = Path(__file__).with_name("diloco_worker.py")


def run(tmp_path: Path, scenario: str, world: int) -> list[dict]:
    j = forked_job([sys.executable, str(WORKER), str(tmp_path), scenario], world, free_port_block(8 * world),
                   tmp_path, time.monotonic() + 120)
    with j:
        j.start_all()
        codes = j.wait_all()
        assert codes == {r: 0 for r in range(world)}, "\n".join(j.output(r) for r in range(world))
    return [json.loads((tmp_path / f"diloco-{r}.json").read_text()) for r in range(world)]


def same_across_ranks(got: list[dict]) -> None:
    first = got[0]["records"]
    for rec in got[1:]:
        assert [r["global"] for r in rec["records"]] == [r["global"] for r in first]
    assert len({g["final_global"] for g in got}) == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scenario", ["plain", "fp16", "int8"])
def test_every_sync_leaves_identical_global_parameters_and_takes_them(tmp_path, scenario, world):
    got = run(tmp_path, scenario, world)
    same_across_ranks(got)
    for g in got:
        assert g["syncs"] == 4 and len(g["records"]) == 4
        assert all(r["local_is_global"] for r in g["records"])   # no overlap: the members take them
        assert g["last_loss"] < 0.5 * g["first_loss"], g          # it trains
    # Bytes handed to collectives per value and sync: 4 (fp32 all_reduce); coded: the whole
    # fragment to all_to_all plus this member's chunk to all_gather, 2 or 1 byte(s) each.
    per_value = got[0]["payload_bytes"] / (4 * got[0]["numel"])
    want = {"plain": 4.0, "fp16": 2.0 * (1 + 1 / world), "int8": 1.0 + 1.0 / world}[scenario]
    assert abs(per_value - want) < 0.05, (per_value, want)


@pytest.mark.multiprocess
def test_outer_lr_one_without_momentum_is_the_mean_of_the_replicas(tmp_path):
    got = run(tmp_path, "average", 3)
    same_across_ranks(got)
    for g in got:
        assert len(g["records"]) == 2
        assert all(r["max_err_vs_mean"] < 1e-6 for r in g["records"]), g["records"]


@pytest.mark.multiprocess
def test_streaming_fragments_with_overlap_and_int8(tmp_path):
    got = run(tmp_path, "streaming", 3)
    same_across_ranks(got)
    for g in got:
        assert g["syncs"] == 3 * 36 // 6                       # every fragment once per period
        # Overlap: a sync lands one inner step after it started, on top of that step's progress.
        assert not any(r["local_is_global"] for r in g["records"])
        assert g["last_loss"] < 0.5 * g["first_loss"], g


@pytest.mark.unit
@pytest.mark.parametrize("kwargs, needle", [
    ({"sync_every": 0}, "sync_every=0 is not a positive integer"),
    ({"fragments": 5, "sync_every": 4}, "fragments=5 must be an integer from 1 to min(sync_every"),
    ({"quantize": "int4"}, "quantize='int4' is not one of"),
])
def test_bad_options_are_named(kwargs, needle, monkeypatch):
    import torch.distributed as dist
    from hpct.distributed.training.diloco import DiLoCo
    from hpct.errors import HpctArgumentError
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with pytest.raises(HpctArgumentError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        DiLoCo(torch.nn.Linear(4, 4), **kwargs)
