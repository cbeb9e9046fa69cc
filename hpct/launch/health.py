"""The health rules an agent applies to its workers: which one is silent after a view move broke
its world, which is stopped by a signal and for how long, which is a no-show to be taken for hung,
and which can no longer re-form once a rank of the job finished.  Pure functions of the workers'
facts (pool.py's ``Worker``) and the time; the agent acts on their answers (losses.py).
"""

from __future__ import annotations

from .pool import Worker
from .procs import is_stopped

# A worker its peers wait for, seen stopped by a signal this long, is taken for hung without
# waiting out its op timeout: it runs no code until someone continues it (no_show_bound).
STOPPED_NO_SHOW_S = 1.0
STOPPED_CHECK_S = 0.25     # how often an agent reads its workers' states (note_stopped)


def re_form_bound(w: Worker, default_s: float) -> float:
    """How long after a view move that broke its world a worker may stay silent: its op timeout,
    if it told one, else ``default_s``."""
    return w.op_timeout or default_s


def silent(w: Worker, generation: int, broke_at: float | None) -> bool:
    """Whether ``w`` has not come to re-form after the view's last move that broke its world (at
    ``broke_at``, monotonic): its world formed before ``generation`` and it has not asked the
    agent anything since."""
    return (broke_at is not None and w.joined and not w.reaped and w.formed < generation
            and w.watched < broke_at and w.proc.poll() is None)


def note_stopped(workers, now: float, probe=is_stopped) -> None:
    """Track since when each running worker is seen stopped by a signal (None: running)."""
    for w in workers:
        stopped = not w.reaped and w.proc.poll() is None and probe(w.proc.pid)
        w.stopped_since = (now if w.stopped_since is None else w.stopped_since) if stopped else None


def stopped_past(workers, now: float, grace: float) -> list[Worker]:
    """The workers seen stopped for ``grace`` seconds (0: none ever is).  Each collective of the
    job waits on such a worker, and it runs nothing until someone continues it: waiting for its
    peers' op timeout (then for their re-form) only lengthens the stall a replacement ends."""
    return [w for w in workers if grace > 0 and not w.reaped and w.stopped_since is not None
            and now - w.stopped_since >= grace]


def stopped_long(w: Worker, now: float) -> bool:
    """Whether ``w`` has been seen stopped (``note_stopped``) for STOPPED_NO_SHOW_S."""
    return w.stopped_since is not None and now - w.stopped_since >= STOPPED_NO_SHOW_S


def no_show_bound(w: Worker, now: float, default_s: float) -> float:
    """How long after the breaking move a silent worker is waited for: STOPPED_NO_SHOW_S once it
    is ``stopped_long`` (its peers' collectives already timed out on it, and it cannot come before
    someone continues it), else its op timeout (``re_form_bound``)."""
    return STOPPED_NO_SHOW_S if stopped_long(w, now) else re_form_bound(w, default_s)


def no_shows(workers, generation: int, broke_at: float | None, now: float, default_s: float) -> list[Worker]:
    """The silent workers (``silent``) past their bound (``no_show_bound``).  Such a worker is hung
    (stopped, deadlocked): its peers would wait for it until their connect deadline and then fail,
    over and over, while it never exits.  A worker busy past its op timeout would have failed its
    peers' collectives already, so that bound is the user's own."""
    return [w for w in workers if silent(w, generation, broke_at)
            and now - broke_at > no_show_bound(w, now, default_s)]


def stranded(w: Worker) -> str | None:
    """Why ``w``'s next world can no longer form once a rank of the job finished (a finished rank
    never comes to re-form; it left only after every rank had taken the last step), or None: a
    newcomer (grow, spare, replacement) that has not joined, or a worker that re-forms after its
    world failed."""
    if not w.joined:
        return "before it joined" if w.generation > 0 else None
    return "while it re-formed" if w.re_forming else None
