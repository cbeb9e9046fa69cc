"""The hpct c10d backend: same results as ProcessGroupGloo, rootless start-up, no TCPStore.

Both backends run tests/dist_worker.py (the same collectives on the same inputs through
torch.distributed) in the same test run; every result must be equal, dtype included.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch

from backend_parity import MASTER_PORT, SLOTS, SUPERSET, WORKER, WORLD, run
from hpct.demo.agent import free_port_block
from util import forked_job, same

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    gloo, _ = run(tmp, "gloo", [0, 1, 2, 3])
    hpct, base = run(tmp, "hpct", [3, 2, 1, 0])
    return gloo, hpct, base


def test_every_case_matches_processgroupgloo(runs):
    gloo, hpct, _ = runs
    mismatches = []
    for r in range(WORLD):
        g, h = gloo[r]["results"], hpct[r]["results"]
        assert g.keys() == h.keys()
        for name in g:
            if isinstance(g[name], str) and g[name].startswith("ERR") and name in SUPERSET:
                continue        # Gloo refuses these; hpct supports them (checked below)
            if not same(g[name], h[name]):
                mismatches.append(f"rank {r} {name}: gloo={g[name]!r} hpct={h[name]!r}")
    assert not mismatches, "\n".join(mismatches[:40])


def test_cases_ran(runs):
    gloo, hpct, _ = runs
    res = hpct[0]["results"]
    errors = sorted(k for k, v in res.items() if isinstance(v, str) and v.startswith("ERR"))
    assert len(res) > 80
    assert errors == []
    refused_by_gloo = sorted(k for k, v in gloo[0]["results"].items() if isinstance(v, str) and v.startswith("ERR"))
    assert refused_by_gloo == sorted(SUPERSET), refused_by_gloo


def test_superset_results_are_right(runs):
    """What Gloo refuses (int16, all_to_all with lists) hpct computes; check against torch."""
    _, hpct, _ = runs
    from dist_worker import values
    ins = [values(r, 5, torch.int16) for r in range(WORLD)]
    for r in range(WORLD):
        res = hpct[r]["results"]
        stacked = torch.stack([x.to(torch.int64) for x in ins])
        assert torch.equal(res["all_reduce/torch.int16/RedOpType.SUM"], stacked.sum(0).to(torch.int16))
        assert torch.equal(res["all_reduce/torch.int16/RedOpType.PRODUCT"], stacked.prod(0).to(torch.int16))
        assert torch.equal(res["all_reduce/torch.int16/RedOpType.MIN"], stacked.min(0).values.to(torch.int16))
        assert torch.equal(res["all_reduce/torch.int16/RedOpType.MAX"], stacked.max(0).values.to(torch.int16))
        outs = res["all_to_all"]
        for src in range(WORLD):
            assert torch.equal(outs[src], values(src, r + 1, torch.float32, salt=10 * r))


def test_healthy_source_takes_the_lowest_of_the_furthest_healthy_ranks(runs):
    """After a peer lost at a collective's end some ranks may have taken the step and some not: the
    state to spread is the furthest one, so nobody takes a step twice (the goodput soak saw one)."""
    gloo, hpct, _ = runs
    want = [2, 0, 1,
            "RuntimeError: no rank of the group holds a healthy state to re-synchronise from",
            f"ValueError: healthy_source: progress -1 is outside [0, {1 << 40}): pass the step count of this rank's state"]
    for r in range(WORLD):
        assert hpct[r]["results"]["healthy_source"] == want, r
        assert gloo[r]["results"]["healthy_source"] == want, r


def test_no_store_socket_only_plan_ports(runs):
    """No TCPStore: nothing on MASTER_PORT; every socket is a listener or peer link of the plan."""
    _, hpct, base = runs
    plan = set(range(base, base + SLOTS * WORLD))
    for r in range(WORLD):
        for key in ("sockets_after_init", "sockets_end"):
            socks = hpct[r][key]
            assert socks, "no TCP socket found: the check itself is broken"
            for local, remote, state in socks:
                assert MASTER_PORT not in (local, remote), (r, key, socks)
                assert local in plan or remote in plan, (r, key, local, remote, state)
            listening = {lp for lp, _, st in socks if st == "LISTEN"}
            assert listening <= plan, (r, key, listening)
            # one listener per process, B + local rank, for the world and every subgroup
            assert listening == {base + r}, (r, key, listening)


def test_abort_is_bounded_with_op_in_flight_and_stopped_peer(tmp_path):
    import json
    import os
    import signal
    argv = [sys.executable, str(WORKER), "abort", str(tmp_path)]
    j = forked_job(argv, 3, free_port_block(SLOTS * 3), tmp_path, time.monotonic() + 90,
                   env={"HPCT_CONNECT_TIMEOUT": "60"})
    with j:
        j.start_all()
        for r in range(3):
            j.wait_file(tmp_path / f"ready-{r}", 60)
        os.kill(j.procs[2].pid, signal.SIGSTOP)
        try:
            (tmp_path / "go").write_text("")
            for r in (0, 1):
                assert j.procs[r].wait(timeout=30) == 0, j.output(r)
        finally:
            os.kill(j.procs[2].pid, signal.SIGKILL)
            os.kill(j.procs[2].pid, signal.SIGCONT)
    for r in (0, 1):
        res = json.loads((tmp_path / f"abort-{r}.json").read_text())
        # Its own abort, or the other survivor's abort resetting the connection first.
        assert ("AbortedError" in res["outcome"] and "test abort" in res["outcome"]) or \
            ("PeerError" in res["outcome"] and f"[peer rank {1 - r}]" in res["outcome"]), res
        assert res["wait_s"] < 2.0 and res["shutdown_s"] < 5.0, res
        assert res["initialized_after"] is False


def test_documented_torch_form_and_groups_beyond_port_slots(tmp_path):
    import json
    argv = [sys.executable, str(WORKER), "torchform", str(tmp_path)]
    base = free_port_block(2 * WORLD)
    j = forked_job(argv, WORLD, base, tmp_path, time.monotonic() + 90,
                   env={"HPCT_CONNECT_TIMEOUT": "60", "HPCT_PORT_SLOTS": "2", "TORCH_DIST_INIT_BARRIER": "1"})
    with j:
        j.start_all(order=[3, 2, 1, 0])
        assert j.wait_all() == {r: 0 for r in range(WORLD)}, [j.output(r) for r in range(WORLD)]
    for r in range(WORLD):
        res = json.loads((tmp_path / f"torchform-{r}.json").read_text())
        assert res["backend"] == "hpct" and res["sum"] == 6.0
        assert res["g1"] == [1, base + r]                          # every group on B + l
        assert res["g2"] == [2, base + r, float(WORLD)], res["g2"]   # beyond HPCT_PORT_SLOTS=2
        if r in (0, 1):
            assert res["g3"] == [3, base + r, 2.0]
            assert sorted(res["groups"]) == [0, 2, 3]
        else:
            assert sorted(res["groups"]) == [0, 2]
