"""What an agent does when a worker ends (hpct/launch/losses.py), in process: the loss moves the view
and starts the rank again, the worker's own failures count against --max-restarts, a worker that
never started ends the job, and only a move other than a grow breaks the members' world.  The
real processes and their replacement are tests/test_launch.py's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from hpct.launch.view import JobEnd

from agent_parts import Agent

pytestmark = pytest.mark.unit


def lost_worker(joined: bool = True, generation: int = 0) -> SimpleNamespace:
    return SimpleNamespace(rank=1, proc=SimpleNamespace(pid=4242), generation=generation, joined=joined,
                           log=Path("/nonexistent/rank1.log"))


def test_a_lost_worker_moves_the_view_one_generation_and_its_rank_starts_again():
    a = Agent(0)
    a.losses.replace([(1, lost_worker(), -9)])
    assert (a.view.generation, a.view.nodes) == (1, [0, 1, 2]) and a.started == [(1, 0)]
    assert a.losses.restarts == {}, "killed by a signal: a loss, not the worker's own failure"
    [(event, lost)] = [(e, f) for e, f in a.events.seen if e == "worker-lost"]
    assert lost["message"] == "rank 1 pid 4242 killed by signal 9" and lost["code"] == -9


def test_a_workers_own_failures_count_against_max_restarts():
    a = Agent(0)
    for n in range(1, a.opts.max_restarts + 1):
        a.losses.replace([(1, lost_worker(), 1)])
        assert a.started[-1] == (1, n), "it starts again with its restart count"
    with pytest.raises(JobEnd) as end:
        a.losses.replace([(1, lost_worker(), 1)])
    assert end.value.message.startswith("rank 1 failed 4 times (--max-restarts 3); last exit 1, its log "
                                        "/nonexistent/rank1.log")
    assert a.view.generation == 3, "the last failure moves no view: the job ends"


def test_a_worker_that_could_not_start_ends_the_job_at_once():
    a = Agent(0)
    with pytest.raises(JobEnd) as end:
        a.losses.replace([(1, lost_worker(joined=False), 2)])
    assert end.value.code == 2 and end.value.message.startswith("rank 1 could not start (exit 2)")
    assert a.started == [] and a.view.generation == 0
    a.losses.replace([(1, lost_worker(joined=False, generation=1), 2)])
    assert a.started == [(1, 1)], "a replacement that fails before it joined is retried"


def test_only_a_move_other_than_a_grow_breaks_the_members_world():
    a = Agent(0)
    a.losses.view_moved(1, grow=True)
    assert a.losses.broke_at is None
    a.losses.view_moved(2, grow=False)
    assert a.losses.broke_at is not None
