"""Any number of live hpct groups: every group of a process on one port (patch 0018).

Each test runs tests/groups_worker.py in every rank of a local job, bounded by a deadline.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from hpct.demo.agent import free_port_block
from util import forked_job

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]

WORKER = Path(__file__).with_name("groups_worker.py")
SLOTS = 2        # HPCT_PORT_SLOTS: no cap on hpct groups any more, whatever it says


def run(tmp: Path, scenario: str, world: int, limit_s: float = 150) -> tuple[list[dict], int]:
    base = free_port_block(SLOTS * world)
    j = forked_job([sys.executable, str(WORKER), scenario, str(tmp)], world, base, tmp,
                   time.monotonic() + limit_s, env={"HPCT_CONNECT_TIMEOUT": "60", "HPCT_PORT_SLOTS": str(SLOTS)})
    with j:
        j.start_all()
        codes = j.wait_all()
        assert codes == {r: 0 for r in range(world)}, [j.output(r) for r in range(world)]
    return [json.loads((tmp / f"{scenario}-{r}.json").read_text()) for r in range(world)], base


def test_64_live_groups_each_all_reduce_then_destroyed(tmp_path):
    world = 4
    res, base = run(tmp_path, "many", world)
    for r, got in enumerate(res):
        assert got["sums"] == [float(sum(range(world)) + world * i) for i in range(64)], got
        assert got["listening"] == [base + r], got          # one port for the world and 64 groups
        assert got["keys"] == list(range(1, 65)), got
        assert got["world"] == float(world) and got["left"] == 1, got
    print(f"64 new_group + first all_reduce, world {world}: "
          f"{max(g['seconds'] for g in res):.3f} s")


def test_3d_device_mesh_collectives_on_every_dimension(tmp_path):
    res, base = run(tmp_path, "mesh", 8, limit_s=240)
    for r, got in enumerate(res):
        for dim, stride in (("dp", 4), ("tp", 2), ("pp", 1)):
            members = got[dim]["members"]
            assert r in members and len(members) == 2, got
            assert members[1] - members[0] == stride, got
            assert got[dim]["sum"] == float(sum(members)), got
            assert got[dim]["gathered"] == [float(m) for m in members], got
        assert got["listening"] == [base + r], got


def test_abort_of_one_group_leaves_another_on_the_same_port_working(tmp_path):
    res, base = run(tmp_path, "abort_one", 2)
    for r, got in enumerate(res):
        assert got["b"] == [1.0, 3.0, 5.0], got
        assert got["c"] == 2.0 and got["listening"] == [base + r], got
    assert "test abort of group a" in res[0]["a"], res[0]
    # The peer's group a learns it at its next op (the abort reset its connection).
    assert res[1]["a"].startswith("CollectiveError"), res[1]


def test_a_repeated_group_key_is_refused_naming_the_live_group(tmp_path):
    res, _ = run(tmp_path, "key_clash", 2, limit_s=240)
    for got in res:
        assert got["keep"] == 1
        assert "would share Gloo group key 1 with the live group" in got["clash"], got
        assert "keys repeat every 1023 subgroup indexes" in got["clash"], got
        assert "fix: destroy group" in got["clash"], got
        assert got["after"][1] == 2.0, got
