"""Storeless Gloo across hosts: 4 network namespaces on one bridge, 2 processes each.

Every process derives its peers from the port plan with real addresses taken
from HPCT_HOSTS (hosts[r // P], port B + (g mod S)*P + l), exactly as a cluster
job would.  Needs root for the namespaces; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gloo_helpers import WORKER, Worker, free_block, kill_all, wait_all_succeeded
from hpct.testing.netns import netns_network, unavailable_reason

pytestmark = [pytest.mark.multihost, pytest.mark.multiprocess]

NODES, NPROC = 4, 2

# The worker computes its own peer table from the plan and HPCT_HOSTS.
PLAN_WORKER = r"""
import json, os, runpy, sys
from hpct.ports import peer_table
hosts = os.environ["HPCT_HOSTS"].split(",")
spec = json.loads(sys.argv[1])
spec["peers"] = peer_table(hosts, spec.pop("base"), spec.pop("group"), spec["size"],
                           spec.pop("nproc_per_node"), spec.pop("slots"))
sys.argv = [sys.argv[2], json.dumps(spec)]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def nodes():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with netns_network(NODES, name_prefix="hpct-gloo") as ns:
        yield ns


def _launch(nodes, script_for, *, generation=1, group=0, slots=2, base=None, timeout=90.0,
            connect_timeout=40.0, skip=()):
    hosts = ",".join(n.address for n in nodes)
    size = NODES * NPROC
    base = base or free_block(slots * NPROC)
    workers = []
    for r in range(size):
        if r in skip:
            continue
        node = nodes[r // NPROC]
        spec = {"rank": r, "size": size, "generation": generation, "base": base, "group": group,
                "nproc_per_node": NPROC, "slots": slots, "timeout": 60.0,
                "connect_timeout": connect_timeout, "script": script_for(r)}
        proc = node.popen([sys.executable, "-c", PLAN_WORKER, json.dumps(spec), WORKER],
                          env={**os.environ, "HPCT_HOSTS": hosts}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        workers.append(Worker(r, proc, time.monotonic(), timeout))
    return base, workers


def test_collectives_across_four_hosts(nodes):
    """8 ranks on 4 namespaces: storeless init from the plan, exact collectives."""
    _, workers = _launch(nodes, lambda r: [{"op": "connect"}, {"op": "collectives"},
                                           {"op": "close"}])
    for w in wait_all_succeeded(workers):
        w.event("collectives_ok")


def test_second_group_slot_and_late_node(nodes):
    """Group 1 of the plan (its own port slot) with the last node's processes
    starting 3 s late: everyone waits for them, then the collectives are exact."""
    def script(r):
        late = [{"op": "sleep", "seconds": 3.0}] if r // NPROC == NODES - 1 else []
        return late + [{"op": "connect"}, {"op": "collectives", "elements": 100}, {"op": "close"}]
    _, workers = _launch(nodes, script, group=1, generation=4)
    for w in wait_all_succeeded(workers):
        assert w.event("connected")["generation"] == 4
        w.event("collectives_ok")


def test_killed_host_process_fails_everyone_promptly(nodes):
    """SIGKILL of one process on one host during allreduces: every other rank on
    every host gets a PeerError within seconds."""
    _, workers = _launch(nodes, lambda r: [{"op": "connect"}, {"op": "ready"},
                                           {"op": "expect_error", "elements": 1 << 16,
                                            "repeat": True}])
    victim = workers[5]
    try:
        for w in workers:
            w.read_event("ready", timeout=60)
        time.sleep(0.5)
        # The worker runs under `ip netns exec`, which execs: the pid is the python process.
        os.kill(victim.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        for w in workers:
            w.wait()
        elapsed = time.monotonic() - killed
    finally:
        kill_all(workers)
    assert elapsed < 15, elapsed
    for w in workers:
        if w is victim:
            continue
        assert w.proc.returncode == 0, w.describe()
        assert w.event("op_error")["type"] == "PeerError", w.describe()
