"""Small allreduces in log depth (src/gloo_ext/small.cpp): exact, the same bits on every rank.

Up to SMALL_ALLREDUCE_BYTES an allreduce takes recursive doubling (log2 N exchanges, two
more when N is not a power of two) instead of Gloo's ring (2(N-1) hops), where that gives the
ring's bits (integers, min, max, N = 2; float sums too with float_doubling=True).  Every rank
must end with the same bits, also for float sums whose value depends on the order of
the additions, and a dead peer must fail it as it fails the ring.
"""

from __future__ import annotations

import array
import math
import os
import random
import signal

import pytest

import hpct._gloo as gloo
from gloo_helpers import free_block, kill_all, loopback_peers, run_group, start_worker

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]


def _inputs(rank: int) -> list[float]:
    """The worker's float inputs (tests/gloo_worker.py small_allreduce), regenerated."""
    rnd = random.Random(1000 + rank)
    return [rnd.uniform(-1, 1) * 10 ** rnd.randint(-6, 6) for _ in range(64)]


@pytest.mark.parametrize("size", [2, 3, 4, 5, 7, 8])
def test_small_allreduce_is_exact_and_bitwise_identical_on_every_rank(size):
    """Sum, product, min and max of every dtype give the known values with each algorithm
    (the worker checks them); float sums hold the same bits on every rank and match the
    exact sum to rounding."""
    script = [{"op": "connect", "lazy": True}]
    script += [{"op": "small_allreduce", "algorithm": a} for a in ("doubling", "auto", "ring")]
    script += [{"op": "close"}]
    workers = run_group(size, script, timeout=60 + 4 * size)
    for w in workers:
        assert w.proc.returncode == 0, w.describe()
    exact = [math.fsum(col) for col in zip(*(_inputs(r) for r in range(size)))]
    for index, algorithm in enumerate(("doubling", "auto", "ring")):
        results = [[e for e in w.events if e["event"] == "small_allreduce"][index] for w in workers]
        for code, tol in (("f", 1e-5), ("d", 1e-12)):
            bits = {res[code] for res in results}
            assert len(bits) == 1, f"{algorithm} {code}: ranks disagree on the bits"
            got = array.array(code, bytes.fromhex(results[0][code]))
            scale = max(abs(x) for r in range(size) for x in _inputs(r))
            for g, want in zip(got, exact):
                assert abs(g - want) <= tol * scale * size, (algorithm, code, g, want)


@pytest.mark.parametrize("float_doubling", [False, True])
def test_auto_keeps_the_rings_bits_for_float_sums_unless_asked(float_doubling):
    """algorithm='auto' takes recursive doubling only where it gives the ring's bits (so DDP
    stays bit-identical to stock Gloo): a float sum of 3+ ranks associates differently, so
    it keeps the ring, unless the context was made with float_doubling=True."""
    size = 5
    script = [{"op": "connect", "lazy": True, "float_doubling": float_doubling}]
    script += [{"op": "small_allreduce", "algorithm": a} for a in ("doubling", "auto", "ring")]
    script += [{"op": "close"}]
    workers = run_group(size, script, timeout=90)
    for w in workers:
        assert w.proc.returncode == 0, w.describe()
    doubling, auto, ring = [e for e in workers[0].events if e["event"] == "small_allreduce"]
    assert doubling["f"] != ring["f"], "inputs chosen so that the association order shows"
    want = doubling if float_doubling else ring
    assert (auto["f"], auto["d"]) == (want["f"], want["d"])


def test_lazy_group_connects_only_the_doubling_partners():
    """With lazy pairs a small allreduce opens only its partners: rank ^ 2^k and the fold
    partner rank +- p.  At N = 12 (p = 8) that is at most log2(8) + 1 = 4 per rank; the
    formation tree's pairs are among them, except an extra rank's tree children (rank 8:
    0, 9 and 10), so no rank holds more than 4 (the ring would add its two neighbours)."""
    size = 12
    # The second allreduce uses the same pairs: no rank opens others before all counted.
    script = [{"op": "connect", "lazy": True}, {"op": "allreduce", "elements": 4},
              {"op": "connections"}, {"op": "allreduce", "elements": 4}, {"op": "close"}]
    workers = run_group(size, script, timeout=90)
    for w in workers:
        assert w.proc.returncode == 0, w.describe()
        count = [e for e in w.events if e["event"] == "connections"][0]["count"]
        assert count <= 4, w.describe()


def test_unknown_algorithm_is_refused():
    port = free_block(1)
    with gloo.Context(0, 1, 1, [("127.0.0.1", port)]) as ctx:
        buf = array.array("f", [1.0])
        ctx.allreduce(buf, algorithm="doubling")         # size 1: nothing to exchange
        assert list(buf) == [1.0]
        with pytest.raises(ValueError, match="unknown allreduce algorithm 'tree'"):
            ctx.allreduce(buf, algorithm="tree")


def test_a_dead_peer_fails_the_small_allreduce_on_every_survivor():
    """N = 5 (not a power of two): rank 3 is killed while the others loop on 4-byte
    allreduces; every survivor's allreduce fails with a PeerError naming a peer instead
    of waiting for the op timeout."""
    size = 5
    peers = loopback_peers(size)
    workers = []
    try:
        for r in range(size):
            script = [{"op": "connect", "lazy": True}, {"op": "barrier"}, {"op": "ready"}]
            script += ([{"op": "sleep", "seconds": 60}] if r == 3 else
                       [{"op": "expect_error", "elements": 1, "repeat": True}])
            spec = {"rank": r, "size": size, "generation": 1, "peers": peers, "timeout": 60.0,
                    "connect_timeout": 40, "script": script}
            workers.append(start_worker(spec, timeout=90))
        for w in workers:
            w.read_event("ready", timeout=45)
        os.kill(workers[3].proc.pid, signal.SIGKILL)
        errors = {r: workers[r].read_event("op_error", timeout=60) for r in (0, 1, 2, 4)}
    finally:
        kill_all(workers)
    for r, err in errors.items():
        assert "PeerError" in err["classes"], (r, err)
        assert "OpTimeoutError" not in err["classes"], (r, err)
        assert "peer rank" in err["message"], (r, err)


GROUP_SCRIPT = """
import json, os, random, struct, sys
import torch, torch.distributed as dist
import hpct.distributed as hd
rank = int(os.environ["RANK"])
rnd = random.Random(1000 + rank)
t = torch.tensor([rnd.uniform(-1, 1) * 10 ** rnd.randint(-6, 6) for _ in range(64)], dtype=torch.float32)
hd.init_process_group(timeout=60)
dist.all_reduce(t)
hd.shutdown_all()
with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as f:
    json.dump(struct.pack(f"{t.numel()}f", *t.tolist()).hex(), f)
"""


def _group_sum(tmp, size: int, env: dict) -> str:
    import json
    import sys
    import time
    from hpct.demo.agent import free_port_block
    from util import forked_job
    tmp.mkdir()
    job = forked_job([sys.executable, "-c", GROUP_SCRIPT, str(tmp)], size, free_port_block(2 * size), tmp,
                     time.monotonic() + 120, env=dict(env, HPCT_CONNECT_TIMEOUT="60", HPCT_PORT_SLOTS="1"))
    with job:
        job.start_all()
        codes = job.wait_all()
        assert codes == {r: 0 for r in range(size)}, [job.output(r) for r in range(size)]
    bits = {json.loads((tmp / f"{r}.json").read_text()) for r in range(size)}
    assert len(bits) == 1, "ranks disagree on the bits"
    return bits.pop()


def test_an_hpct_group_takes_log_depth_for_float_sums_from_HPCT_LOG_ALLREDUCE_ranks(tmp_path):
    """The world wires Config.log_allreduce_from into the context: a group of 5 keeps the
    ring's bits by default (from 16) and with 0 (never), and takes doubling's with 5 (float32
    inputs of test_auto_keeps_the_rings_bits_for_float_sums_unless_asked, where they differ)."""
    ring = _group_sum(tmp_path / "default", 5, {})
    assert _group_sum(tmp_path / "never", 5, {"HPCT_LOG_ALLREDUCE": "0"}) == ring
    assert _group_sum(tmp_path / "from5", 5, {"HPCT_LOG_ALLREDUCE": "5"}) != ring
