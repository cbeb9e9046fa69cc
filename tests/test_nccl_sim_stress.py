"""The NCCL engine under races: asynchronous errors, aborts, shutdowns and watchdog ticks at once.

Each round forms a fresh group of ranks (threads) over the simulated NCCL, whose library holds
every call open a little (so that two calls on one comm overlap if the engine lets them) and
fails the round on any breach of NCCL's rules (hpct/testing/nccl_sim).  While the ranks run a mix of
ops, a chaos thread does one of: an asynchronous error on one comm (a peer's reset), an
abort from a foreign thread, a shutdown while ops run, a watchdog failure racing the
shutdown, or nothing.  Every round must end without a hang (every rank's thread returns,
every future completes), without a breach, and with a group that either finished its ops
or failed with the engine's error.  The simulated kernels write through the raw pointers
the engine gave them, so an op whose tensors the engine released too early corrupts memory
here as it would on a GPU.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from hpct.distributed.nccl import watchdog as nccl_watchdog
from hpct.errors import CollectiveError
from hpct.testing.nccl_sim.library import REMOTE_ERROR, SimNccl
from sim_ranks import Ranks, no_breach  # noqa: F401 -- a fixture

pytestmark = [pytest.mark.nccl_sim, pytest.mark.slow]
ROUNDS = 200
ACTIONS = ("async_error", "foreign_abort", "shutdown_during_ops", "fail_racing_shutdown", "none")


def ops(r: int, e, seed: int, stop: threading.Event, futures: list) -> str:
    """Ops until the group fails or ``stop``; what ended it.  Every rank issues the same ops
    (one seed) and waits for some of them (its own choice)."""
    n = e.size
    same, mine = random.Random(seed), random.Random(seed * 31 + r)
    for _ in range(40):
        if stop.is_set():
            return "stopped"
        kind = same.randrange(4)
        try:
            if kind == 0:
                w = e.allreduce([torch.ones(16)])
            elif kind == 1:
                w = e.allreduce_coalesced([torch.ones(3), torch.ones(2, 2).t()])
            elif kind == 2:
                s, got = torch.full((8,), float(r)), torch.empty(8)
                w = e.send([s], (r + 1) % n)
                futures.append(w.get_future())
                w = e.recv([got], (r - 1) % n)
            else:
                w = e.all_gather_single(torch.empty(4 * n), torch.full((4,), float(r)))
            futures.append(w.get_future())
            if mine.random() < 0.7:
                w.wait()
        except CollectiveError:
            return "failed"
    return "done"


def chaos(action: str, ranks: Ranks, rng: random.Random) -> None:
    time.sleep(rng.uniform(0.0, 0.03))
    e = ranks.engines[rng.randrange(ranks.n)]
    if action == "async_error":
        comms = list(ranks.lib.comms.values())
        if comms:
            rng.choice(comms).fail(REMOTE_ERROR, "the test resets a peer")
    elif action == "foreign_abort":
        e.abort("a foreign thread aborts")
    elif action == "shutdown_during_ops":
        e.shutdown(2.0)
    elif action == "fail_racing_shutdown":
        t = threading.Thread(target=e.shutdown, args=(2.0,), daemon=True)
        t.start()
        e._fail(e._err(CollectiveError, "op", "the watchdog's failure (the test's)"))
        t.join(10)


def test_hundreds_of_rounds_of_racing_failures(monkeypatch, no_breach):
    monkeypatch.setattr(nccl_watchdog, "WATCHDOG_PERIOD_S", 0.001)     # watchdog ticks race the ops
    seen = {a: 0 for a in ACTIONS}
    t_start = time.monotonic()
    for i in range(ROUNDS):
        rng = random.Random(1000 + i)
        action = ACTIONS[i % len(ACTIONS)]
        n = 2 + i % 2
        ranks = Ranks(n, lib=SimNccl(jitter=0.0002, launch_polls=rng.randrange(0, 4)), connect_timeout=5.0,
                      op_timeout=10.0, blocking=(i // 2) % 2 == 1)      # both kinds of comm, at N = 2 and 3
        stop = threading.Event()
        futures: list = []
        outcome = {}
        agent = threading.Thread(target=chaos, args=(action, ranks, rng), daemon=True)
        try:
            ranks.run(lambda r, e: e.allreduce([torch.ones(1)]).wait())     # formed: the races start now
            agent.start()
            seed = rng.randrange(10 ** 6)
            ends = ranks.run(lambda r, e: ops(r, e, seed, stop, futures), timeout=60)
            agent.join(20)
            assert not agent.is_alive(), f"round {i} ({action}): the chaos thread hung"
            outcome = dict(enumerate(ends))
        finally:
            stop.set()
            for e in ranks.engines:
                e.shutdown(5.0)
        deadline = time.monotonic() + 20
        while not all(f.done() for f in futures):
            assert time.monotonic() < deadline, f"round {i} ({action}): a future never completed"
            time.sleep(0.005)
        if action == "none":
            assert set(outcome.values()) == {"done"}, (i, outcome)
        seen[action] += 1
    assert all(seen.values()), seen
    print(f"{ROUNDS} rounds in {time.monotonic() - t_start:.1f} s: {seen}")
