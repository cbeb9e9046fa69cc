"""The port plan against the shared vectors, and check_plan against kernel ranges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpct.config import Config
from hpct.errors import PortPlanError
from hpct.ports import PortPlan, check_plan, compress, host_of, peer_table, port_of, port_set

VECTORS = json.loads((Path(__file__).parent / "vectors" / "port_plan.json").read_text())
pytestmark = pytest.mark.unit


def _ids(cases):
    return [c["name"] for c in cases]


def test_vectors_are_self_describing():
    assert VECTORS["format_version"] == 1
    assert "group mod slots" in VECTORS["description"]
    assert all(VECTORS[k] for k in ("port_of", "peer_table", "invalid_port_of", "defaults"))


@pytest.mark.parametrize("case", VECTORS["port_of"], ids=_ids(VECTORS["port_of"]))
def test_port_of_vectors(case):
    args = {k: case[k] for k in ("block_base", "group", "local_rank", "nproc_per_node", "slots")}
    assert port_of(**args) == case["expect"]


@pytest.mark.parametrize("case", VECTORS["peer_table"], ids=_ids(VECTORS["peer_table"]))
def test_peer_table_vectors(case):
    args = {k: case[k] for k in ("hosts", "block_base", "group", "world_size", "nproc_per_node", "slots")}
    assert peer_table(**args) == [tuple(p) for p in case["expect"]]


@pytest.mark.parametrize("case", VECTORS["invalid_port_of"], ids=_ids(VECTORS["invalid_port_of"]))
def test_invalid_port_of_vectors(case):
    args = {k: case[k] for k in ("block_base", "group", "local_rank", "nproc_per_node", "slots")}
    with pytest.raises(PortPlanError):
        port_of(**args)


@pytest.mark.parametrize("case", VECTORS["defaults"], ids=_ids(VECTORS["defaults"]))
def test_default_vectors_through_config(case):
    config = Config.from_mapping(case["env"])
    plan = PortPlan.from_config(config)
    want = case["expect"]
    assert (config.nproc_per_node, config.port_slots) == (want["nproc_per_node"], want["slots"])
    assert plan.block("gloo").start == want["gloo_base"]
    assert plan.block("nccl").start == want["nccl_base"]


def test_invalid_messages_name_the_problem():
    with pytest.raises(PortPlanError, match=r"local rank 8 is outside 0\.\.7"):
        port_of(12000, 0, 8, 8, 8)
    with pytest.raises(PortPlanError, match="group index -1 is negative"):
        port_of(12000, -1, 0, 1, 8)
    with pytest.raises(PortPlanError, match="port 65537 .* is not a valid TCP port"):
        port_of(65530, 7, 0, 1, 8)
    with pytest.raises(PortPlanError, match="needs node 2, but the host list has 2 entries") as err:
        host_of(["a", "b"], 4, 2)
    assert "HPCT_HOSTS" in err.value.fix


def test_host_of_block_placement():
    hosts = ["n0", "n1", "n2"]
    assert [host_of(hosts, r, 4) for r in range(12)] == ["n0"] * 4 + ["n1"] * 4 + ["n2"] * 4


def _plan(**env) -> PortPlan:
    return PortPlan.from_config(Config.from_mapping({k: str(v) for k, v in env.items()}))


def test_plan_blocks_ports_and_peers():
    plan = _plan(N_PROC_PER_NODE=2, HPCT_PORT_SLOTS=4, HPCT_HOSTS="10.0.0.1,10.0.0.2")
    assert plan.block("gloo") == range(12000, 12008)
    assert plan.block("nccl") == range(12008, 12016)
    assert plan.max_groups == 4
    assert plan.world_size == 4
    assert plan.listen_port("nccl", 5, 1) == 12008 + 1 * 2 + 1
    assert plan.local_ports("gloo", 1) == [12001, 12003, 12005, 12007]
    # the hpct backend's Gloo: every group of local rank l on B + l (slot 0), whatever S is
    assert [plan.shared_port("gloo", l) for l in (0, 1)] == [12000, 12001]
    assert plan.shared_port("gloo", 1) == plan.listen_port("gloo", 0, 1)
    assert plan.peers("gloo", 3) == [("10.0.0.1", 12006), ("10.0.0.1", 12007),
                                     ("10.0.0.2", 12006), ("10.0.0.2", 12007)]
    assert plan.peers("gloo", 3, ranks=[3, 0]) == [("10.0.0.2", 12007), ("10.0.0.1", 12006)]
    assert plan.as_dict()["blocks"] == {"gloo": {"first": 12000, "last": 12007},
                                        "nccl": {"first": 12008, "last": 12015}}


def test_plan_uses_world_size_when_set():
    plan = _plan(N_PROC_PER_NODE=2, WORLD_SIZE=3, HPCT_HOSTS="a,b")
    assert len(plan.peers("nccl", 0)) == 3


def test_plan_unknown_backend():
    with pytest.raises(PortPlanError, match="unknown backend 'mpi'") as err:
        _plan().block("mpi")
    assert err.value.fix == "use one of: gloo, nccl"


def test_check_plan_blocks_below_the_floor_are_safe():
    assert check_plan(_plan(), (20000, 65535), set()) == []


def test_check_plan_block_inside_the_range_is_a_problem():
    plan = _plan(HPCT_PORT_BASE=30000)          # gloo 30000-30007, nccl 30008-30015
    problems = check_plan(plan, (20000, 65535), set())
    assert [p.backend for p in problems] == ["gloo", "nccl"]
    assert problems[0].message == ("8 of the gloo block's ports (30000-30007) lie in the ephemeral range "
                                   "20000-65535 and are not reserved")
    assert "hpct ports apply" in problems[0].fix


def test_check_plan_reserved_block_is_safe_and_partial_reservation_is_not():
    plan = _plan(HPCT_PORT_BASE=30000)
    assert check_plan(plan, (20000, 65535), [range(30000, 30016)]) == []
    problems = check_plan(plan, (20000, 65535), {30000, 30001, 30002} | set(range(30008, 30016)))
    assert len(problems) == 1
    assert problems[0].ports == (30003, 30004, 30005, 30006, 30007)
    assert "(30003-30007)" in problems[0].message


def test_check_plan_straddling_the_floor_and_above_the_ceiling():
    plan = _plan(HPCT_PORT_BASE=19996)          # gloo 19996-20003, nccl 20004-20011
    problems = check_plan(plan, (20000, 65535), ())
    assert problems[0].ports == (20000, 20001, 20002, 20003)
    # Ports above the high end are never handed out either.
    assert check_plan(_plan(HPCT_PORT_BASE=61000), (32768, 60999), ()) == []


def test_check_plan_reports_overlapping_blocks():
    plan = PortPlan(hosts=("127.0.0.1",), nproc_per_node=1, slots=8, world_size=1,
                    bases=(("gloo", 12000), ("nccl", 12004)))
    problems = check_plan(plan, (20000, 65535))
    assert [p.backend for p in problems] == ["gloo+nccl"]
    assert problems[0].message == "the gloo and nccl blocks share ports 12004-12007"


def test_compress_and_port_set():
    assert compress([5, 1, 2, 3, 7, 8]) == "1-3,5,7-8"
    assert compress([]) == ""
    assert port_set([range(1, 3), 9]) == {1, 2, 9}
