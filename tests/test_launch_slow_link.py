"""A node whose link turns lossy and slow gives its ranks to a spare node, over a real slow port:
hpct/testing/lossy.py's userspace switch adds 5 % loss and 20 ms each way to node 0's port while the job
trains (the goodput soak's lossy fault).  The agents' asks through that port stand out.  Node 0 is
the view's lowest node, so the next one, node 1, gives node 0's slot to the spare (the 30-minute
soak ended when the slow lowest node moved the view itself and nobody heard it).  Node 0's worker
stops, the spare's worker takes rank 0 forked from its fork server, and the run ends bit-identical to a
fault-free one.  The judgement's rules are tests/test_launch_links.py's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hpct.testing.cluster import Agents, records
from hpct.testing.netns import unavailable_reason
from launch_jobs import EXAMPLE, FSDP2, LIMIT_S, stock_digest, wait_progress

pytestmark = [pytest.mark.serial, pytest.mark.multihost]

STEPS = ["--steps", "200", "--step-time", "0.03"]     # long enough to be found slow while it trains


def test_a_node_whose_link_turns_slow_gives_its_ranks_to_a_spare_and_the_run_is_bit_identical(tmp_path):
    if (why := unavailable_reason()) is not None:
        pytest.skip(why)
    from hpct.testing.lossy import lossy_network

    expect = stock_digest(tmp_path, 3, steps=STEPS)
    out = tmp_path / "out"
    out.mkdir()
    with lossy_network(4, name_prefix="hpct-slow", subnet="10.239.0") as net:
        args = ["--nnodes", "3", "--spare-nodes", "1", "--nproc-per-node", "1",
                "--hosts", ",".join(n.address for n in net.nodes), EXAMPLE, *STEPS, "--out", str(out)]
        with Agents(tmp_path, args, nodes=4, namespaces=net.nodes, env={"HPCT_CONNECT_TIMEOUT": "30"}) as agents:
            agents.start()
            agents.wait_event(3, "idle", 60)
            wait_progress(agents, out, 0, 10)
            first = {n: agents.worker_pid(n, n) for n in range(3)}
            net.impair(0, loss=0.05, delay_ms=20)
            t0 = time.monotonic()
            (moved,) = agents.wait_event(1, "slow-node", 60)
            print(f"node 0 found slow {time.monotonic() - t0:.2f} s after its port turned slow: {moved['message']}")
            net.impair(0)
            codes = agents.wait(LIMIT_S)
            assert codes == [0, 0, 0, 0], [agents.output(n)[-3000:] for n in range(4)]
    assert (moved["node"], moved["spare"]) == (0, 3) and moved["link_ms"] > max(10, 4 * moved["others_ms"]), moved
    final = {r["rank"]: r for r in records(out) if r["pid"] != first[0]}
    assert sorted(final) == [0, 1, 2], final
    assert [final[1]["pid"], final[2]["pid"]] == [first[1], first[2]], "a survivor restarted"
    assert final[0]["place"] == 3 and final[0]["generation"] >= 1 and final[0]["pid"] == agents.worker_pid(3, 0)
    assert {r["digest"] for r in final.values()} == {expect}, "not the fault-free run's parameters"
    assert agents.events(0, "dropped") and not agents.events(0, "slow-node"), agents.output(0)
    assert [e["why"].startswith("forked: from the fork server") for e in agents.events(3, "start")] == [True], \
        agents.output(3)
    for n in (1, 2, 3):
        assert agents.events(n, "view")[-1]["nodes"] == [3, 1, 2], agents.output(n)
    assert not [e for n in range(4) for e in agents.events(n, "node-lost")], "nothing was lost: a slot given away"


LATE = str(Path(__file__).with_name("late_start.py"))


@pytest.mark.slow
@pytest.mark.parametrize("script", [EXAMPLE, FSDP2], ids=["ddp", "fsdp2"])
def test_a_node_slow_from_the_start_gives_its_slot_before_the_first_world_and_every_rank_joins_it(tmp_path, script):
    """Node 0's port is slow from the start and its slot goes to the spare before any worker
    connects (they start 5 s late, as on a starved node importing torch).  The first world is then
    generation 1 and holds the spare's newcomers, which must receive the state: the ranks started
    at generation 0 join that world too (their seeded state is step 0) instead of building DDP or
    FSDP2 while the newcomers wait in their join.  Before, both sides waited out the op timeout
    and then recovered (the 30-minute soak lost its start so, and once the whole job)."""
    if (why := unavailable_reason()) is not None:
        pytest.skip(why)
    from hpct.testing.lossy import lossy_network

    nodes, steps = (3, STEPS[:1] + ["30"] + STEPS[2:]) if script == EXAMPLE else (2, ["--steps", "20"])
    expect = stock_digest(tmp_path, 2 * nodes, script=script, steps=steps)
    out = tmp_path / "out"
    out.mkdir()
    with lossy_network(nodes + 1, name_prefix="hpct-late", subnet="10.243.0") as net:
        net.impair(0, delay_ms=20)
        bound = ["--op-timeout", "10"] if script == EXAMPLE else []     # fsdp2.py keeps torch's
        args = ["--nnodes", str(nodes), "--spare-nodes", "1", "--nproc-per-node", "2",
                "--hosts", ",".join(n.address for n in net.nodes), LATE, script, *steps, *bound, "--out", str(out)]
        env = {"HPCT_CONNECT_TIMEOUT": "30", "HPCT_TEST_LATE_START_S": "5"}
        with Agents(tmp_path, args, nodes=nodes + 1, namespaces=net.nodes, env=env) as agents:
            agents.start()
            (moved,) = agents.wait_event(1, "slow-node", 60)
            net.impair(0)
            codes = agents.wait(LIMIT_S)
            assert codes == [0] * (nodes + 1), [agents.output(n)[-3000:] for n in range(nodes + 1)]
            starts = [e for n in range(1, nodes + 1) for e in agents.events(n, "start")]
    assert (moved["node"], moved["spare"]) == (0, nodes), moved
    final = {r["rank"]: r for r in records(out)}
    assert sorted(final) == list(range(2 * nodes)), final
    assert {r["digest"] for r in final.values()} == {expect}, "not the fault-free run's parameters"
    # Nothing failed after the first world formed: no rank recovered, none restarted.
    assert not [r for r in final.values() if r["recoveries"]], [r["recoveries"] for r in final.values()]
    assert len(starts) == 2 * nodes, starts
    assert sorted(r["generation"] for r in final.values()) == [0] * (2 * nodes - 2) + [1, 1], final
