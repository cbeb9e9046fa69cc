"""hd.membership_changed()'s cadence (hpct/distributed/admission.py's _Cadence): which calls ask
the agent and all-reduce.  Members that call at the same step boundaries must ask on the same
calls, or one all-reduce would wait for a member that skipped it.  In process: the all-reduce is
the MAX the members' values meet in (a grow seen through real agents is
tests/test_launch_recovery.py's test_a_node_that_comes_back_joins_by_grow)."""

from __future__ import annotations

import random

import pytest

from hpct.distributed.membership.admission import CHECK_PERIOD_S, _Cadence

pytestmark = pytest.mark.unit


def run(step_s: list[float], calls: int, key=(0, 4), start: list | None = None) -> list[list[int]]:
    """The calls on which each member asked; member m's steps take ``step_s[m]`` seconds (jittered)."""
    rng = random.Random(7)
    members = start or [_Cadence() for _ in step_s]
    now = [100.0] * len(step_s)
    asked: list[list[int]] = [[] for _ in step_s]
    for call in range(calls):
        due = [m.due(key) for m in members]
        assert len(set(due)) == 1, f"call {call}: the members disagree whether to ask ({due})"
        if due[0]:
            longest = max(m.since(t) for m, t in zip(members, now))      # the all-reduce (MAX)
            for m, t, seen in zip(members, now, asked):
                m.asked_at(t, longest)
                seen.append(call)
        now = [t + s * rng.uniform(0.9, 1.1) for t, s in zip(now, step_s)]
    return asked


def test_members_with_different_step_times_ask_on_the_same_calls_about_once_a_period():
    asked = run([0.1, 0.13, 0.1, 0.12], 200)
    assert all(a == asked[0] for a in asked)
    gaps = [b - a for a, b in zip(asked[0][1:], asked[0][2:])]
    # the slowest member's steps set the pace: about CHECK_PERIOD_S / 0.13 calls apart
    assert gaps and all(6 <= g <= round(CHECK_PERIOD_S / 0.1) for g in gaps), gaps
    assert asked[0][:2] == [0, 1], "a new world asks at its first call, then times the calls"


def test_steps_longer_than_the_period_ask_every_call():
    asked = run([1.5, 2.0], 20)
    assert asked[0] == list(range(20))


def test_a_new_world_asks_at_its_first_call_whatever_the_old_one_skipped():
    members = [_Cadence(), _Cadence()]
    run([0.01, 0.01], 50, key=(0, 2), start=members)
    assert members[0].skip > 10, "short steps skip many calls"
    assert run([0.01, 0.01], 1, key=(1, 3), start=members) == [[0], [0]], "the grown world asks at once"
