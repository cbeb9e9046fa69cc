"""What a node's agent does when one of its workers ends or stops answering: a lost worker is
replaced in place at the next generation (its own failure counts against ``--max-restarts``),
one started for a view that moved on starts again in the newer one, and one that never comes to
re-form is killed as hung, so that the loss path replaces it.  ``NodeAgent`` (agent.py) hands
``Losses`` what it acts on: the view, the node's workers and how to start one.
"""

from __future__ import annotations

import os
import signal
import time

from typing import Callable

from .health import STOPPED_CHECK_S, no_shows, note_stopped, re_form_bound, stopped_long, stopped_past
from .pool import Worker
from .procs import stop, tail
from .view import JobEnd, View

FOLLOWS_S = 1.0               # a worker that asked about the view this recently follows a newer one itself


class Losses:
    """Handed what it uses: the ``view`` (a loss moves it), this node's ``workers`` (the agent's own
    dict, local rank -> Worker), ``start(local_rank, restarts)`` (a worker anew in the view's
    world), the event log, ``max_restarts`` and ``stopped_grace`` (hpct run's options) and the
    bound a silent worker is waited for when it told no op timeout (``default_bound_s``)."""

    def __init__(self, view: View, *, workers: dict, start: Callable[[int, int], None], events,
                 max_restarts: int, stopped_grace: float, default_bound_s: float) -> None:
        self.view, self.workers, self.start, self.events = view, workers, start, events
        self.max_restarts, self.stopped_grace, self.default_bound_s = max_restarts, stopped_grace, default_bound_s
        self.restarts: dict[int, int] = {}
        self.broke_at: float | None = None       # the last view move that broke the members' world
        self.stopped_checked = 0.0               # when the workers' states were last read

    def view_moved(self, generation: int, grow: bool) -> None:
        """The view moved to ``generation`` (the view's lock is held).  A move other than a grow
        breaks the members' world; a replacement that has not joined yet is stale."""
        now = time.monotonic()
        if not grow:
            self.broke_at = now
        for w in self.workers.values():
            if (0 < w.generation < generation and not w.joined and w.proc.poll() is None
                    and now - w.watched > FOLLOWS_S):
                stop([w.proc], 0.0)

    def replace(self, lost: list) -> None:
        for local, w, code in lost:
            how = _how(code)
            self.events.emit("worker-lost", f"rank {w.rank} pid {w.proc.pid} {how}", rank=w.rank,
                             pid=w.proc.pid, code=code, generation=w.generation, joined=w.joined)
            if code > 0:
                if not w.joined and w.generation == 0:
                    raise JobEnd(code, f"rank {w.rank} could not start (exit {code}); its log {w.log}:\n"
                                       f"{tail(w.log)}")
                self.restarts[local] = self.restarts.get(local, 0) + 1
                if self.restarts[local] > self.max_restarts:
                    raise JobEnd(code, f"rank {w.rank} failed {self.restarts[local]} times (--max-restarts "
                                       f"{self.max_restarts}); last exit {code}, its log {w.log}:\n"
                                       f"{tail(w.log)}")
        view = self.view
        with view.cond:
            view.move(view.generation + 1, view.nodes, f"{len(lost)} worker(s) lost on node {view.node}")
        for local, w, code in lost:
            self.start(local, self.restarts.get(local, 0))

    def reap_no_shows(self) -> None:
        """Kill the workers stopped by a signal past ``--stopped-grace`` (health.stopped_past) and
        those that did not come to re-form (health.no_shows): their exit is a loss, and the loss
        path replaces them."""
        now = time.monotonic()
        if now - self.stopped_checked < STOPPED_CHECK_S:
            return
        self.stopped_checked = now
        with self.view.cond:
            gen, broke_at = self.view.generation, self.broke_at
        note_stopped(self.workers.values(), now)
        grace = self.stopped_grace
        for w in stopped_past(self.workers.values(), now, grace):
            self.events.emit("stopped", f"rank {w.rank} pid {w.proc.pid} stopped by a signal for "
                             f"{now - w.stopped_since:.1f} s (--stopped-grace {grace:g}): the job's collectives "
                             "wait on it and it runs nothing until continued; it is killed and a replacement "
                             "takes its rank", rank=w.rank, pid=w.proc.pid, generation=gen,
                             seconds=round(now - w.stopped_since, 3))
            _kill(w)
        for w in no_shows(self.workers.values(), gen, broke_at, now, self.default_bound_s):
            stopped = stopped_long(w, now)
            why = (f"stopped by a signal for {now - w.stopped_since:.1f} s (it runs nothing until continued)"
                   if stopped else f"past its op timeout ({re_form_bound(w, self.default_bound_s):g} s)")
            self.events.emit("no-show", f"rank {w.rank} pid {w.proc.pid} did not come to re-form in generation "
                             f"{gen}: its world formed in {w.formed} and it has not asked this agent since the "
                             f"view moved {now - broke_at:.1f} s ago, {why}; taken for hung (stopped or "
                             "deadlocked), it is killed and a replacement takes its rank",
                             rank=w.rank, pid=w.proc.pid, generation=gen, formed=w.formed,
                             stopped=stopped)
            _kill(w)

    def restart_stale(self, local: int, w: Worker, code: int) -> None:
        """A worker that ended before it joined, started for a view that has moved on since (this
        agent stopped it, or a newer peer refused its connect): not a fault of its own, and the
        newer view already holds its place, so it starts again in that view.  Moving the view for
        it would make the other nodes' unjoined replacements stale in turn, and so on."""
        how = _how(code)
        self.events.emit("stale", f"rank {w.rank} pid {w.proc.pid} of generation {w.generation} {how} before it "
                         f"joined; the view is at generation {self.view.generation}: it starts again there",
                         rank=w.rank, pid=w.proc.pid, code=code, generation=w.generation)
        self.start(local, self.restarts.get(local, 0))


def _kill(w: Worker) -> None:
    """Kill a worker taken for hung: its exit is then the loss that replaces it."""
    w.reaped = True
    try:
        os.killpg(w.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _how(code: int) -> str:
    """How a worker process ended, from its non-zero return code."""
    return f"killed by signal {-code}" if code < 0 else f"exited with {code}"
