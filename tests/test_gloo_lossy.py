"""Storeless Gloo over a lossy, slow link (issue 13, item 2).

The link is hpct/testing/lossy.py: host namespaces joined by a userspace switch that drops
and delays frames (this kernel has no ``netem``).

A connection whose initiator has sent its handshake can lose its listener (the
process was killed or stopped listening, or an old generation's listener closed it)
while the reset that says so is lost.  Nothing else travels on that connection, so
before Gloo patch 0012 the initiator waited for the acknowledgement until the
connect deadline: with 5 % loss and 20 ms delay, 3 of 20 recoveries of 8 ranks on
4 hosts failed that way.  Now every attempt has its own acknowledgement deadline
(and a listener takes a connection only once its initiator confirms, so an attempt
given up never becomes a pair's connection).  Patch 0013 adds keepalive on
established pairs: a peer that vanishes silently fails the waiting rank in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gloo_helpers import WORKER, Worker, free_block, kill_all
from hpct.testing.lossy import lossy_network
from hpct.testing.netns import unavailable_reason

pytestmark = [pytest.mark.multihost, pytest.mark.multiprocess]

NODES, NPROC = 4, 2
LOSS, DELAY_MS = 0.05, 20.0
CONNECT_TIMEOUT_S = 20.0       # a stalled recovery waits this long, then fails
TRY_TIMEOUT_S = 60.0           # bound on every process of one recovery try
STAGGER_S = 0.4                # survivors start their reconnect spread over this long

# The worker computes its own peer table from the plan and HPCT_HOSTS.
PLAN_WORKER = r"""
import json, os, runpy, sys
from hpct.ports import peer_table
hosts = os.environ["HPCT_HOSTS"].split(",")
spec = json.loads(sys.argv[1])
spec["peers"] = peer_table(hosts, spec.pop("base"), 0, spec["size"], spec.pop("nproc_per_node"), 1)
sys.argv = [sys.argv[2], json.dumps(spec)]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _skip_without_namespaces():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


def start_rank(nodes, rank, size, base, script, *, generation, connect_timeout=CONNECT_TIMEOUT_S,
               timeout=TRY_TIMEOUT_S, op_timeout=30.0, nproc=NPROC):
    hosts = ",".join(n.address for n in nodes)
    spec = {"rank": rank, "size": size, "generation": generation, "base": base,
            "nproc_per_node": nproc, "timeout": op_timeout, "connect_timeout": connect_timeout,
            "script": script}
    proc = nodes[rank // nproc].popen([sys.executable, "-c", PLAN_WORKER, json.dumps(spec), WORKER],
                                      env={**os.environ, "HPCT_HOSTS": hosts},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      stdin=subprocess.DEVNULL, text=True)
    return Worker(rank, proc, time.monotonic(), timeout)


def recovery_try(nodes, victim: int, *, size: int = NODES * NPROC) -> dict:
    """One in-process recovery: ``size`` ranks connect (generation 1) and run
    allreduces; ``victim`` is killed; the survivors see the failure, abort, close and
    connect generation 2 with a replacement started at once on the victim's host;
    everyone checks exact collectives.  Returns the outcome and the timings."""
    base = free_block(NPROC)

    def survivor(r):
        # Survivors notice the failure and tear down at different moments (as real ones
        # do): the fast ones dial the slow ones' old listeners, which refuse them.
        return [{"op": "connect"}, {"op": "allreduce"}, {"op": "ready"},
                {"op": "expect_error", "elements": 64, "repeat": True},
                {"op": "sleep", "seconds": STAGGER_S * ((r * 5) % size) / size},
                {"op": "abort", "reason": "peer failed"}, {"op": "close"},
                {"op": "connect", "generation": 2}, {"op": "allreduce"}, {"op": "close"}]

    doomed = [{"op": "connect"}, {"op": "allreduce"}, {"op": "ready"},
              {"op": "sleep", "seconds": TRY_TIMEOUT_S}]
    workers = [start_rank(nodes, r, size, base, doomed if r == victim else survivor(r), generation=1)
               for r in range(size)]
    replacement = None
    result = {"victim": victim, "ok": False}
    try:
        try:
            for w in workers:
                w.read_event("ready", timeout=TRY_TIMEOUT_S)
        except AssertionError as err:
            # The first world itself failed under the loss (seen once in 20 x 8 ranks, 2026-11-27:
            # a peer closed its pair mid-allreduce): a failed try, counted against the 19 of 20 and
            # shown with its output, not the end of the run.
            result["setup_error"] = str(err)[-800:]
            return result
        time.sleep(0.2)
        killed = time.monotonic()
        workers[victim].proc.kill()
        replacement = start_rank(nodes, victim, size, base,
                                 [{"op": "connect"}, {"op": "allreduce"},
                                  {"op": "close"}], generation=2)
        finished = [w for i, w in enumerate(workers) if i != victim] + [replacement]
        for w in finished:
            w.wait()
        result["seconds"] = round(time.monotonic() - killed, 3)
    finally:
        kill_all(workers + ([replacement] if replacement else []))
    codes = [w.proc.returncode for w in finished]
    result["ok"] = all(c == 0 for c in codes)
    result["connect_seconds"] = [
        [e["seconds"] for e in w.events if e["event"] == "connected"][-1:] for w in finished]
    if not result["ok"]:
        result["failures"] = [
            {"rank": w.rank, "code": w.proc.returncode,
             "error": next((e["message"][:600] for e in w.events if e["event"] == "error"), w.err[-600:])}
            for w in finished if w.proc.returncode != 0]
    return result


def run_recoveries(tries: int, *, loss: float = LOSS, delay_ms: float = DELAY_MS, seed: int = 13) -> list[dict]:
    results = []
    with lossy_network(NODES, loss=loss, delay_ms=delay_ms, seed=seed) as net:
        for i in range(tries):
            res = recovery_try(net.nodes, victim=(3 + 5 * i) % (NODES * NPROC))
            res["try"] = i
            results.append(res)
        results.append({"link": net.stats()})
    return results



# ---- a listener whose reset never arrives ------------------------------------------------

def _listening(node, port: int) -> bool:
    """True when something in ``node`` listens on TCP ``port`` (its own /proc/net/tcp)."""
    table = node.run(["cat", "/proc/net/tcp", "/proc/net/tcp6"]).stdout
    return any(f":{port:04X} " in line and line.split()[3] == "0A" for line in table.splitlines()[1:])


def _established_to(node, port: int) -> bool:
    table = node.run(["cat", "/proc/net/tcp"]).stdout
    return any(line.split()[2].endswith(f":{port:04X}") and line.split()[3] == "01"
               for line in table.splitlines()[1:])


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout} s")


def test_listener_whose_reset_never_arrives():
    """Rank 1 dials rank 0, whose process is stopped: the kernel queues the
    connection and acknowledges rank 1's handshake.  Rank 0 is then killed; its
    kernel resets the queued connection, and the link drops that reset (every reset
    from rank 0's host is dropped).  A replacement rank 0 starts on the same port.
    Before Gloo patch 0012 rank 1 waited on the dead connection for its whole
    connect deadline (ConnectTimeoutError, "1 attempts, last: not attempted");
    now the unacknowledged attempt expires after ack_timeout, the next one reaches
    the replacement and both ranks run an exact allreduce."""
    _skip_without_namespaces()
    deadline_s = 30.0
    with lossy_network(2, drop_rst_from=[0]) as net:
        nodes = net.nodes
        base = free_block(1)
        script = [{"op": "connect"}, {"op": "allreduce"}, {"op": "close"}]
        first = start_rank(nodes, 0, 2, base, script, generation=1, nproc=1,
                           connect_timeout=deadline_s)
        replacement = rank1 = None
        try:
            _wait_for(lambda: _listening(nodes[0], base), 20, "rank 0 listening")
            os.kill(first.proc.pid, signal.SIGSTOP)
            rank1 = start_rank(nodes, 1, 2, base, script, generation=1, nproc=1,
                               connect_timeout=deadline_s)
            _wait_for(lambda: _established_to(nodes[1], base), 20, "rank 1's connection queued")
            time.sleep(0.3)                      # its handshake is sent and acknowledged by TCP
            first.proc.kill()
            first.wait()
            replacement = start_rank(nodes, 0, 2, base, script, generation=1, nproc=1,
                                     connect_timeout=deadline_s)
            for w in (replacement, rank1):
                w.wait()
        finally:
            kill_all([w for w in (first, rank1, replacement) if w is not None])
        stats = net.stats()
    assert stats.get("rst_dropped", 0) >= 1, stats       # the reset really was lost
    for w in (replacement, rank1):
        assert w.proc.returncode == 0, w.describe()
        w.event("allreduce_ok")
    # Rank 1 got through well before its connect deadline.
    assert rank1.event("connected")["seconds"] < deadline_s / 2, rank1.describe()


# ---- a peer that vanishes silently -------------------------------------------------------

def test_peer_that_vanishes_silently_fails_the_waiting_rank():
    """Two ranks on two hosts; rank 0 waits to receive from rank 1, then rank 1's
    host drops off the link (its interface goes down: no reset, no end-of-file,
    nothing).  With keepalive (Gloo patch 0013; here 1 s idle, 1 s interval, 3
    probes) rank 0 fails with PeerError within seconds; before it waited for the
    whole op timeout (OpTimeoutError)."""
    _skip_without_namespaces()
    op_timeout = 40.0
    with lossy_network(2) as net:
        nodes = net.nodes
        base = free_block(1)
        liveness = {"keepalive_idle": 1.0, "keepalive_interval": 1.0, "keepalive_count": 3}
        waiter = start_rank(nodes, 0, 2, base,
                            [{"op": "connect", **liveness}, {"op": "allreduce"}, {"op": "ready"},
                             {"op": "recv", "src": 1}], generation=1, nproc=1,
                            op_timeout=op_timeout)
        silent = start_rank(nodes, 1, 2, base,
                            [{"op": "connect", **liveness}, {"op": "allreduce"}, {"op": "ready"},
                             {"op": "sleep", "seconds": 60}], generation=1, nproc=1,
                            op_timeout=op_timeout)
        try:
            for w in (waiter, silent):
                w.read_event("ready", timeout=30)
            time.sleep(0.5)
            nodes[1].run(["ip", "link", "set", "eth0", "down"], check=True)
            gone = time.monotonic()
            err = waiter.read_event("op_error", timeout=op_timeout + 10)
            noticed = time.monotonic() - gone
        finally:
            kill_all([waiter, silent])
    assert "PeerError" in err["classes"] and err["type"] != "OpTimeoutError", err
    assert "peer rank 1" in err["message"] or "rank 1" in err["message"], err
    assert noticed < 12, (noticed, err)


# ---- in-process recovery over a lossy link (issue 13, item 2's figure) --------------------

def test_recovery_of_8_ranks_on_4_hosts_with_loss_and_delay_20_tries():
    """8 ranks on 4 hosts, 5 % loss and 20 ms delay each way: 20 recoveries (one
    rank killed, survivors rebuild the next generation with a replacement).  Issue
    13 asks for at least 19 of 20; before Gloo patch 0012, 3 of 20 stalled until
    the connect deadline (a handshake whose listener went away, the reset lost)."""
    _skip_without_namespaces()
    results = run_recoveries(20)
    tries = [r for r in results if "ok" in r]
    ok = sum(r["ok"] for r in tries)
    print(json.dumps({"recovered": ok, "tries": len(tries), "link": results[-1].get("link"),
                      "seconds": [r.get("seconds") for r in tries],
                      "failed": [r for r in tries if not r["ok"]]}))
    assert results[-1]["link"].get("dropped", 0) > 0, results[-1]      # loss did happen
    assert ok >= 19, [r for r in tries if not r["ok"]]


# ---- one host's link impaired while traffic flows (the goodput soak's lossy-link fault) --

_PROBE = r"""
import socket, sys, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rtts = []
for _ in range(count):
    t = time.monotonic()
    with socket.create_connection((host, port), timeout=60) as s:
        s.sendall(b"x")
        s.recv(1)
    rtts.append(time.monotonic() - t)
print(sorted(rtts)[len(rtts) // 2])
"""

_ECHO = r"""
import socket, sys
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
srv.settimeout(60)
while True:
    conn, _ = srv.accept()
    with conn:
        conn.sendall(conn.recv(1))
"""


def test_impairing_one_hosts_link_slows_and_drops_its_frames_alone_until_healed():
    """Host 1's link gets 10 % loss and 40 ms delay while hosts 0 and 2 talk on: connections
    to host 1 take two delayed round trips and frames are dropped; host 2 is untouched; healed,
    host 1 is fast again.  (At 20 % a handshake attempt fails 36 % of the time; four in a row
    outlast SYN's 1-3-7 s retries, and a 10 s probe timed out in a CI run: 10 % and 60 s make
    that about 1 in 2,000 runs.)"""
    _skip_without_namespaces()
    port = free_block(1)
    with lossy_network(3, seed=5) as net:
        echoes = [net.nodes[i].popen([sys.executable, "-c", _ECHO, str(port)]) for i in (1, 2)]
        try:
            time.sleep(1.0)

            def median_rtt(i: int, count: int = 9) -> float:
                res = net.nodes[0].run([sys.executable, "-c", _PROBE, net.nodes[i].address, str(port),
                                        str(count)], timeout=120)
                assert res.returncode == 0, res.stderr
                return float(res.stdout)

            before = median_rtt(1)
            net.impair(1, loss=0.1, delay_ms=40)
            time.sleep(0.5)                   # the forwarder reads the change within 0.2 s
            dropped = net.stats().get("dropped", 0)
            slow, other = median_rtt(1), median_rtt(2)
            dropped = net.stats().get("dropped", 0) - dropped
            net.impair(1)
            time.sleep(0.5)
            healed = median_rtt(1)
        finally:
            for p in echoes:
                p.kill()
                p.wait(timeout=10)
    assert slow >= 0.16, (before, slow)           # connect and echo: two round trips of 2 x 40 ms
    assert other < 0.05 and before < 0.05 and healed < 0.05, (before, other, healed)
    assert dropped > 0
