"""A node whose link turns lossy and slow gives its ranks to a spare node, over a real slow port:
tests/lossy.py's userspace switch adds 5 % loss and 20 ms each way to node 0's port while the job
trains (the goodput soak's lossy fault).  The agents' asks through that port stand out.  Node 0 is
the view's lowest node, so the next one, node 1, gives node 0's slot to the spare (the 30-minute
soak ended when the slow lowest node moved the view itself and nobody heard it).  Node 0's worker
stops, the spare's worker takes rank 0 from a warm standby, and the run ends bit-identical to a
fault-free one.  The judgement's rules are tests/test_launch_links.py's."""

from __future__ import annotations

import time

import pytest

from launch_cluster import Agents, records
from netns import unavailable_reason
from test_launch_recovery import EXAMPLE, LIMIT_S, stock_digest, wait_progress

pytestmark = [pytest.mark.serial, pytest.mark.multihost]

STEPS = ["--steps", "200", "--step-time", "0.03"]     # long enough to be found slow while it trains


def test_a_node_whose_link_turns_slow_gives_its_ranks_to_a_spare_and_the_run_is_bit_identical(tmp_path):
    if (why := unavailable_reason()) is not None:
        pytest.skip(why)
    from lossy import lossy_network

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
    assert [e["warm"] for e in agents.events(3, "start")] == [True], agents.output(3)
    for n in (1, 2, 3):
        assert agents.events(n, "view")[-1]["nodes"] == [3, 1, 2], agents.output(n)
    assert not [e for n in range(4) for e in agents.events(n, "node-lost")], "nothing was lost: a slot given away"
