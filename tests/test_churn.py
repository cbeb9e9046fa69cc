"""Churn while ops are in flight (issue 18, item 3): a bounded, seeded, randomized stress.

8 ranks, 2 per network namespace on 4 namespaces, behind the userspace lossy switch
(hpct/testing/lossy.py: loss and delay on every link).  The test is the cluster agent: it keeps the
ranks training a tiny deterministic model (one all_reduce per step) and, while steps are in
flight, injects random events: SIGKILL a rank (then replace it at the next generation with
hd.recover, or shrink), SIGSTOP a rank (then SIGKILL it, or SIGCONT it), a graceful leave
(the others shrink), and at a step boundary a join (hd.grow back toward 8).  Up to two ranks
are hit in one round, each with its own action; during some shrinks one more rank is killed
(the survivors' attempt fails on every member and the agent re-forms them again).

Checked for every event: each member that was waiting ends with "done" or with a clear error
(an HpctError subclass, with a message), within a deadline; the world re-forms; every member
then holds bit-identical state (the digests agree, and hd.sync_state finds nothing to repair).
No timing is asserted: the deadlines only turn a hang into a failure.

    CHURN_EVENTS   events to inject (default 200)
    CHURN_SEED     the RNG seed (default: random, printed; rerun with it to reproduce)
    CHURN_LOSS, CHURN_DELAY_MS   the link's impairment (default 0.01 and 2 ms)
    CHURN_DURING   the share of shrinks during which one more rank is killed (default 0.15)
"""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import time

import pytest

from churn_cluster import ANSWER_S, Cluster
from gloo_helpers import free_block
from hpct.testing.lossy import lossy_network
from hpct.testing.netns import unavailable_reason

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = [pytest.mark.multihost, pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.serial]

NODES, NPROC, FULL, SMALLEST = 4, 2, 8, 4
LOSS = float(os.environ.get("CHURN_LOSS", "0.01"))          # fraction of frames dropped
DELAY_MS = float(os.environ.get("CHURN_DELAY_MS", "2"))     # each way, every link
STEPS = 6                  # steps per round: long enough that events land mid-step
HARD_DEADLINE_S = 900.0    # the whole stress, however slow the machine: a hang fails, never waits


def _outcomes(cluster, waiting, deadline):
    """Each waiting member's answer: "done" or "failed" with a clear hpct error."""
    got = {}
    for m in waiting:
        ev = m.expect("done", "failed", timeout=min(ANSWER_S, max(deadline - time.monotonic(), 1)))
        if ev["ev"] == "failed":
            assert not ev.get("unclear"), f"place {m.place}: not an hpct error: {ev}"
            assert ev["message"].strip(), ev
            MESSAGES[f"{ev['type']}: {re.sub(r'[0-9]+', 'N', ev['message'])[:110]}"] += 1
        got[m.place] = ev
    return got


def _check_parity(events, cluster):
    sizes = {e["size"] for e in events}
    assert sizes == {len(cluster.members)}, events
    assert [e["rank"] for e in events] == list(range(len(cluster.members))), events
    assert len({e["gen"] for e in events}) == 1, events
    assert len({e["digest"] for e in events}) == 1, f"state diverged after the change: {events}"
    assert len({e["pre"] for e in events if e["pre"] is not None}) == 1, events
    assert all(e["moves"] == 0 for e in events), f"sync_state had to repair: {events}"
    STATS["changes"] += 1
    STATS["rolled_back"] += any(e.get("back", 0) for e in events)   # a member had finished a failed step


STATS = {"changes": 0, "rolled_back": 0}
MESSAGES: collections.Counter = collections.Counter()   # the waiting members' errors, digits masked
DURING_REFORM = float(os.environ.get("CHURN_DURING", "0.15"))   # share of shrinks during which another rank is killed
ACTIONS = ["kill", "stop_kill", "stop_cont", "leave"]


def _round(cluster, rng, log):
    """One round: train, hit 1-2 ranks mid-step (each its own action: two ranks may be hit by
    different ones) or grow at the boundary, re-form, check parity.  Returns the events injected."""
    members = list(cluster.members)
    size = len(members)
    for m in members:
        m.send(cmd="train", steps=STEPS)
    if size < FULL and rng.random() < 0.25:
        _outcomes(cluster, members, time.monotonic() + ANSWER_S)
        free = cluster.free_places()
        places = rng.sample(free, rng.randint(1, min(3, len(free))))
        while len(places) > 1 and not cluster.can_place(places):
            places.pop()                # joiners only where a spare is ready, but at least one
        log(f"join places {places}")
        _check_parity(cluster.reform("grow", joiners=len(places), places=places), cluster)
        return len(places)
    victims = rng.sample(members, 2 if rng.random() < 0.35 else 1)
    # a leave can only be followed by a shrink: not below SMALLEST ranks
    actions = [rng.choice(ACTIONS if size - len(victims) >= SMALLEST else ACTIONS[:3]) for _ in victims]
    time.sleep(rng.uniform(0.0, 0.4))           # somewhere inside the round's steps
    for v, action in zip(victims, actions):
        if action == "leave":
            v.send(cmd="leave")
        else:
            v.signal(signal.SIGKILL if action == "kill" else signal.SIGSTOP)
    events = len(victims)
    if any(a.startswith("stop") for a in actions):
        time.sleep(rng.uniform(0.05, 0.6))       # the others wait on a stopped peer meanwhile
        for v, action in zip(victims, actions):
            if action.startswith("stop"):
                v.signal(signal.SIGKILL if action == "stop_kill" else signal.SIGCONT)
                events += 1
    log(f"{list(zip(actions, [v.place for v in victims]))} of world {size}")
    lost = [v for v, a in zip(victims, actions) if a != "stop_cont"]
    got = _outcomes(cluster, [m for m in members if m not in lost], time.monotonic() + ANSWER_S)
    for v, action in zip(victims, actions):
        if action == "leave":                # it may have finished or failed first
            while v.expect("left", "done", "failed")["ev"] != "left":
                pass
    log(f"  outcomes: {sorted((e['ev'], e.get('type', '')) for e in got.values())}")
    if not lost and all(e["ev"] == "done" for e in got.values()):
        _check_parity(cluster.reform("check"), cluster)     # resumed in time: nothing changed
        return events
    return events + _reform_after_loss(cluster, rng, lost, log, leave="leave" in actions)


def _reform_after_loss(cluster, rng, lost, log, leave=False):
    size = len(cluster.members)
    # replace where spares are ready (importing torch on a busy machine takes seconds); else shrink
    can_replace = not leave and cluster.can_place([v.place for v in lost])
    if not lost:
        how = "replace"                 # a stopped rank outlived the op timeout: same membership
    elif (can_replace and rng.random() < 0.5) or (not leave and size - len(lost) < SMALLEST):
        how = "replace"                 # (below SMALLEST it waits for a spare)
    else:
        how = "shrink"
    during, hit = None, []
    if how == "shrink" and size - len(lost) - 1 >= SMALLEST and rng.random() < DURING_REFORM:
        def during(members):
            # a rank lost while the survivors re-form: their attempt fails (RendezvousError at the
            # connect deadline, or a CollectiveError in the parity check), the agent re-forms again
            time.sleep(rng.uniform(0.0, 0.3))
            hit.append(rng.choice(members))
            hit[0].signal(signal.SIGKILL)
            return hit
    log(f"  {how} (generation {cluster.gen + 1})")
    events = cluster.reform(how, lost=lost, during=during)
    if hit:
        log(f"  killed place {hit[0].place} during the {how}; re-formed at generation {events[0]['gen']}")
    _check_parity(events, cluster)
    return len(hit)


def test_churn_with_ops_in_flight_ends_in_clear_errors_and_bit_identical_reformed_worlds(tmp_path):
    why = unavailable_reason()
    if why:
        pytest.skip(why)
    target = int(os.environ.get("CHURN_EVENTS", "200"))
    seed = int(os.environ.get("CHURN_SEED", str(random.SystemRandom().randrange(1 << 32))))
    print(f"CHURN_SEED={seed} CHURN_EVENTS={target}", flush=True)
    rng = random.Random(seed)
    STATS.update(changes=0, rolled_back=0)
    MESSAGES.clear()
    lines: list[str] = []
    t0 = time.monotonic()

    def log(text):
        lines.append(f"[{time.monotonic() - t0:7.2f}] {text}")
        print(lines[-1], flush=True)

    with lossy_network(NODES, loss=LOSS, delay_ms=DELAY_MS, seed=seed,
                       max_seconds=HARD_DEADLINE_S + 60) as net:
        cluster = Cluster(net.nodes, NPROC, free_block(NPROC), tmp_path)
        try:
            _check_parity(cluster.start(FULL), cluster)
            log(f"world of {FULL} formed")
            events = rounds = 0
            while events < target:
                assert time.monotonic() - t0 < HARD_DEADLINE_S, f"stress past its hard deadline: {lines[-5:]}"
                events += _round(cluster, rng, log)
                rounds += 1
            for m in cluster.members:
                m.send(cmd="exit")
            for m in cluster.members:
                m.expect("exited")
            log(f"{events} events in {rounds} rounds, {time.monotonic() - t0:.1f} s; "
                f"world {len(cluster.members)} at generation {cluster.gen}; {STATS}; broken re-formations "
                f"{collections.Counter(cluster.reform_errors)}; link {net.stats()}")
            for text, n in MESSAGES.most_common(8):
                log(f"  {n:4d} x {text}")
        finally:
            cluster.stop_all()
