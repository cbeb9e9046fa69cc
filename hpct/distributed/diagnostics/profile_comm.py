"""``profile_comm(ddp_model)``: how much of a DDP step is gradient communication, and how much of it is exposed.

DDP hands each gradient bucket to one communication hook.  The profile registers a hook
that times the user's hook (or the default allreduce) per bucket: when the bucket was
ready (the hook call) and when its future completed.  The end of backward (DDP has waited
for every future) closes a step.  Only torch is needed.

The thread that completes a bucket's future (gloo's worker, NCCL's watchdog) runs the
profile's callable and later drops it, taking the GIL both times.  A thread that asks for
the GIL after the interpreter began finalizing is ended by pthread_exit, and unwinding
that through torch's noexcept PythonFunctionGuard destructor aborts the whole process
("terminate called without an active exception" after the script's last line; the
mechanism is pybind/pybind11#2215).  DDP does not wait for a done callback, so the last
step's were often still pending when a script ended.  So every callable is tracked until it
is dropped, and exit waits for those whose future has completed (:class:`_HeldCallables`).
Stock gloo's own work objects race the same way (pytorch/pytorch#190489); that is not ours
to drain.
"""

from __future__ import annotations

import atexit
import statistics
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from hpct.errors import HpctArgumentError

__all__ = ["CommProfile", "profile_comm"]

_MB = 1 << 20
# Thresholds of the suggestions; named so the doc and the message agree.
_MANY_BUCKETS = 8
_SMALL_BUCKET_BYTES = 5 * _MB
_EXPOSED_SHARE = 0.5
EXIT_WAIT_S = 5.0  # at exit, for completed futures' callables to be dropped: a thread switch, so a bound only


class _HeldCallables:
    """The profile's callables a future still holds, each with that future, until dropped."""

    def __init__(self) -> None:
        self._held: dict[weakref.ref, Any] = {}
        self._cv = threading.Condition()  # an RLock: a drop can run inside hold() when gc frees one
        self._registered = False

    def hold(self, fn: Callable, fut) -> Callable:
        with self._cv:
            self._held[weakref.ref(fn, self._dropped)] = fut
            if not self._registered:
                atexit.register(self.drain)
                self._registered = True
        return fn

    def _dropped(self, ref: weakref.ref) -> None:
        with self._cv:
            self._held.pop(ref, None)
            self._cv.notify_all()

    def count(self) -> int:
        with self._cv:
            return len(self._held)

    def drain(self, timeout: float = EXIT_WAIT_S) -> bool:
        """Wait (GIL released) until no completed future holds a callable of ours.

        A future that never completed (a hung or aborted group) never runs its callbacks,
        so it is not waited for.
        """
        with self._cv:
            return self._cv.wait_for(lambda: not any(f.done() for f in self._held.values()), timeout)


_HELD = _HeldCallables()


def _union(intervals: list[tuple[float, float]], lo: float = float("-inf"), hi: float = float("inf")) -> float:
    """Length of the union of ``intervals`` clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


class CommProfile:
    """Per-step bucket timings of one DDP model; see :func:`profile_comm`."""

    def __init__(self, ddp_model, hook: Callable | None, state: Any, enabled: bool) -> None:
        # Weak: DDP's reducer (C++) holds our hook, which gc cannot see through, so a strong
        # reference back would keep the model, its gradients and its process group alive forever.
        self._ddp = weakref.ref(ddp_model)
        self._hook = hook
        self._state = state
        self._on = enabled
        self._wrapped = enabled
        self.steps: list[dict] = []
        self._buckets: list[dict] = []
        self._t0: float | None = None
        self._fwd_start: float | None = None

    # -- hooks -----------------------------------------------------------------------
    def _forward_pre(self, module, args) -> None:
        if self._on:
            self._fwd_start = time.perf_counter()

    def comm_hook(self, state, bucket):
        if not self._on:
            return self._allreduce(state, bucket, {}) if self._hook is None else self._hook(state, bucket)
        called = time.perf_counter()
        if not self._buckets:
            self._t0 = self._fwd_start if self._fwd_start is not None else called
            # A final callback queued now runs before the one DDP queues when the last
            # bucket is ready; re-queueing from it lands after DDP's wait on all futures.
            torch.autograd.Variable._execution_engine.queue_callback(self._requeue)
        buf = bucket.buffer()
        rec = {"index": bucket.index(), "bytes": buf.numel() * buf.element_size(),
               "tensors": len(bucket.gradients()), "called": called, "launched": 0.0, "done": None}
        self._buckets.append(rec)
        if self._hook is None:
            return self._allreduce(state, bucket, rec)
        fut = self._hook(state, bucket)
        rec["launched"] = time.perf_counter()

        # A done callback, not a chained future: DDP keeps waiting on the hook's own future,
        # so the profile adds no hop to the critical path.  A bucket whose callback has not
        # run when the step closes is given the step's end (DDP had waited for it by then).
        fut.add_done_callback(_HELD.hold(lambda f: rec.__setitem__("done", time.perf_counter()), fut))
        return fut

    @staticmethod
    def _allreduce(group, bucket, rec: dict):
        """allreduce_hook's arithmetic (divide, then sum), stamping the time in its one continuation.

        The stamp runs before the future DDP waits on completes, so every bucket has its
        time, and it is the only Python callable of the bucket, so the exit wait covers them all.
        """
        group = group if group is not None else dist.group.WORLD
        buf = bucket.buffer()
        buf.div_(group.size())

        def finish(f):
            rec["done"] = time.perf_counter()
            return f.value()[0]

        root = dist.all_reduce(buf, group=group, async_op=True).get_future()
        rec["launched"] = time.perf_counter()  # before the continuation exists, so done >= launched
        return root.then(_HELD.hold(finish, root))

    def _requeue(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._close_step)

    def _close_step(self) -> None:
        end = time.perf_counter()
        recs, t0 = self._buckets, self._t0
        self._buckets, self._fwd_start = [], None
        if not recs or not self._on:
            return
        for r in recs:
            # DDP has waited for every future by now; a callback still pending (or racing
            # with this one) would only report the thread switch.
            r["done"] = end if r["done"] is None else min(r["done"], end)
        spans = [(r["called"], r["done"]) for r in recs]
        last_ready = max(r["called"] for r in recs)
        total = _union(spans)
        exposed = _union(spans, lo=last_ready, hi=end)
        rel = lambda t: t - t0  # noqa: E731
        self.steps.append({
            "step": len(self.steps),
            "buckets": [{"index": r["index"], "bytes": r["bytes"], "tensors": r["tensors"],
                         "called_s": rel(r["called"]), "launched_s": rel(r["launched"]),
                         "done_s": rel(r["done"])} for r in recs],
            "bucket_count": len(recs),
            "bucket_bytes": sum(r["bytes"] for r in recs),
            "last_ready_s": rel(last_ready),
            "backward_end_s": rel(end),
            "comm_s": total,
            "exposed_s": exposed,
            "hidden_s": total - exposed,
            "launch_s": sum(r["launched"] - r["called"] for r in recs),
        })

    # -- control ---------------------------------------------------------------------
    def enable(self) -> None:
        if not self._wrapped:
            raise HpctArgumentError("this profile was made with enabled=False, so no timing hook is installed",
                                    fix="call profile_comm(ddp_model) with enabled=True before training")
        self._on = True

    def disable(self) -> None:
        """Stop recording; the hook becomes a plain call-through."""
        self._on = False
        self._buckets, self._fwd_start = [], None

    def reset(self) -> None:
        self.steps = []

    # -- results ---------------------------------------------------------------------
    def report(self) -> dict:
        """``{"steps": [...], "summary": {...}, "suggestions": [...]}``; the summary skips step 0 (warm-up)."""
        steps = self.steps[1:] if len(self.steps) > 1 else self.steps
        summary: dict[str, Any] = {"steps": len(steps), "warmup_skipped": len(self.steps) > 1}
        if steps:
            for key in ("comm_s", "exposed_s", "hidden_s", "launch_s", "backward_end_s", "bucket_count"):
                summary[key] = statistics.fmean(s[key] for s in steps)
            sizes = [b["bytes"] for b in steps[-1]["buckets"]]
            summary["exposed_share"] = summary["exposed_s"] / summary["comm_s"] if summary["comm_s"] > 0 else 0.0
            summary["bucket_bytes_total"] = sum(sizes)
            summary["bucket_bytes_median"] = statistics.median(sizes)
            summary["bucket_bytes_min"], summary["bucket_bytes_max"] = min(sizes), max(sizes)
        return {"steps": self.steps, "summary": summary, "suggestions": self._suggest(summary)}

    def _suggest(self, s: dict) -> list[str]:
        out: list[str] = []
        if not s.get("steps"):
            return out
        ddp = self._ddp()
        cap = getattr(ddp, "bucket_bytes_cap", None)
        if s["bucket_count"] > _MANY_BUCKETS and s["bucket_bytes_median"] < _SMALL_BUCKET_BYTES:
            now = f" (now {cap / _MB:.3g} MB)" if cap else ""
            out.append(f"raise bucket_cap_mb{now}: {s['bucket_count']:.0f} buckets per step with a median of "
                       f"{s['bucket_bytes_median'] / _MB:.3g} MB each; every bucket pays a collective's fixed "
                       "latency, so fewer, larger buckets spend less time on it")
        if s["comm_s"] > 0 and s["exposed_share"] > _EXPOSED_SHARE:
            why = (f"{s['exposed_share']:.0%} of communication ({s['exposed_s'] * 1e3:.2f} of "
                   f"{s['comm_s'] * 1e3:.2f} ms) runs after the last gradient is ready, where nothing overlaps it")
            if not getattr(ddp, "gradient_as_bucket_view", True):
                out.append(f"set gradient_as_bucket_view=True: {why}; gradients written straight into the "
                           "buckets skip a copy per bucket, so buckets are ready and launched sooner")
            if not getattr(ddp, "static_graph", True):
                out.append(f"set static_graph=True (if the graph does not change between steps): {why}; DDP then "
                           "skips its per-step graph bookkeeping and can launch buckets in the learned order")
        return out

    def summary_text(self) -> str:
        """A short table of the summary and the suggestions."""
        rep = self.report()
        s = rep["summary"]
        if not s.get("steps"):
            return "profile_comm: no step recorded"
        lines = [f"profile_comm: {s['steps']} step(s) (mean{', warm-up skipped' if s['warmup_skipped'] else ''})",
                 f"  {'buckets per step':<24}{s['bucket_count']:>10.1f}",
                 f"  {'bucket MB min/med/max':<24}{s['bucket_bytes_min'] / _MB:>10.3f} "
                 f"{s['bucket_bytes_median'] / _MB:.3f} {s['bucket_bytes_max'] / _MB:.3f}",
                 f"  {'backward end [ms]':<24}{s['backward_end_s'] * 1e3:>10.2f}",
                 f"  {'communication [ms]':<24}{s['comm_s'] * 1e3:>10.2f}",
                 f"  {'  hidden [ms]':<24}{s['hidden_s'] * 1e3:>10.2f}",
                 f"  {'  exposed [ms]':<24}{s['exposed_s'] * 1e3:>10.2f}  ({s['exposed_share']:.0%})"]
        lines += [f"  suggestion: {t}" for t in rep["suggestions"]]
        return "\n".join(lines)


def profile_comm(ddp_model, *, hook: Callable | None = None, state: Any = None, enabled: bool = True) -> CommProfile:
    """Register a timing communication hook on ``ddp_model`` and return its :class:`CommProfile`.

    ``hook``/``state`` are what you would pass to ``ddp_model.register_comm_hook``; DDP takes
    one hook only, so pass yours here instead.  Without one, the default allreduce is used.
    With ``enabled=False`` your hook (if any) is registered unwrapped and nothing is recorded.
    """
    if not hasattr(ddp_model, "register_comm_hook") or not hasattr(ddp_model, "reducer"):
        raise HpctArgumentError(f"profile_comm needs a DistributedDataParallel model, got {type(ddp_model).__name__}",
                                fix="wrap the model in torch.nn.parallel.DistributedDataParallel first")
    if getattr(ddp_model, "_hpct_comm_profile", None) is not None:
        raise HpctArgumentError("profile_comm was already called on this DDP model (DDP takes one comm hook only)",
                                fix="keep the CommProfile the first call returned; use its disable()/enable()")
    if getattr(ddp_model, "_comm_hooks", None):
        names = ", ".join(getattr(h, "__qualname__", repr(h)) for h, _ in ddp_model._comm_hooks)
        raise HpctArgumentError(f"this DDP model already has a communication hook ({names}) and DDP takes one only",
                                fix="do not call register_comm_hook; pass it as profile_comm(model, hook=..., state=...)")
    plain = hook is None
    if plain:
        # The default allreduce treats a None state as the default group; DDP's own group is the right one.
        state = ddp_model.process_group if state is None else state
    elif not callable(hook):
        raise HpctArgumentError(f"hook must be callable, got {type(hook).__name__}",
                                fix="pass a function hook(state, bucket) -> torch.futures.Future")
    prof = CommProfile(ddp_model, hook, state, enabled)
    if enabled:
        ddp_model.register_forward_pre_hook(prof._forward_pre)
        ddp_model.register_comm_hook(state, prof.comm_hook)
    elif not plain:  # without a hook of its own, DDP's built-in allreduce is the plain path
        ddp_model.register_comm_hook(state, hook)
    ddp_model._hpct_comm_profile = prof
    return prof
