"""Launching an engine's ops: one NCCL group per launch, in issue order, every wait bounded.

Mixed into NcclEngine.  ``_submit`` builds the Work, makes the engine stream follow the caller's,
and launches now or defers (sends and receives, coalescing); ``_launch_locked`` makes one NCCL
group of the works' calls under the launch lock and decides what NCCL's answer means:
ncclSuccess (or ncclInProgress that settles) launched the ops; ncclInvalidArgument at an op's own
call refused them and the group goes on; anything else fails the group.  Every launched op gets
its end event at once, whatever the answer, and keeps its tensors until that event completes.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from . import library as nccl_lib
from .comm import ABORT_HELD_S, ENDED, CommEnded
from .work import NcclAbortedError, NcclGroupError, NcclOpTimeoutError, NcclRefusedError, NcclWork

_SUCCESS, _IN_PROGRESS = nccl_lib.SUCCESS, nccl_lib.IN_PROGRESS
# Launched ops kept for the watchdog before the launching thread drops those that ended: a few
# dozen Work objects, not the thousands a 50 ms tick would find after a burst of small ops (they
# cost the garbage collector and the watchdog's GIL time per op).
PRUNE_AT = 32


class Launching:
    """Mixed into NcclEngine (its state, _err, _fail, _check_device, _ensure_comm, _watchers)."""

    @staticmethod
    def _prune(inflight) -> None:
        """Drop the ops that have ended from the head (ops end in launch order on the one stream)."""
        while len(inflight) > 1 and inflight[0]._poll():
            try:
                inflight.popleft()
            except IndexError:           # a failure cleared it meanwhile
                return

    def _submit(self, what: str, tensors: Sequence[torch.Tensor], calls, result, *, keep=(), post=None,
                pre=None, defer: bool = False, host_wait: bool = False, peer: int | None = None) -> NcclWork:
        """Launch one op built whole (its calls, kept tensors, copies out) now, or with the batch."""
        dev = self._check_device(tensors, what)
        work = NcclWork(self, what, dev, result, calls=calls, keep=[*tensors, *keep], post=post,
                        host_wait=host_wait, peer=peer)
        if self._failure is not None or self._closed:
            why = f"the group already failed: {self._failure}" if self._failure else "the group is shut down"
            work._fail(self._err(NcclAbortedError, what, why))
            return work
        if self._stream is None:
            self._ensure_stream(dev)
        rt = self.runtime
        work.captured = rt.capturing(dev)
        rt.follow(self._stream_h, dev)          # the op follows the caller's work so far
        if pre is not None:
            rt.enqueue(dev, self._stream, pre)
        if defer or self._coalescing:
            with self._lock:
                if defer or self._coalescing:
                    self._batch.append(work)
                    return work
        lock = self._launch_lock
        if not lock.acquire(False) and not lock.acquire(timeout=self.op_timeout + ABORT_HELD_S):
            work._fail(self._failure or self._err(NcclOpTimeoutError, what, "another launch held the engine "
                                                  f"for more than {self.op_timeout + ABORT_HELD_S:g} s"))
            return work
        try:
            refused = self._launch_locked(self._take_batch() + [work] if self._batch else [work], what)
        finally:
            lock.release()
        if refused is not None:
            raise refused
        return work

    def _take_batch(self) -> list[NcclWork]:
        with self._lock:
            if self._coalescing:
                return []
            batch, self._batch = self._batch, []
            return batch

    def _flush(self, end: float | None) -> None:
        """Launch the deferred batch; waits for the launch lock until ``end`` (None: not at all)."""
        if not self._batch:
            return
        got = (self._launch_lock.acquire(blocking=False) if end is None else
               self._launch_lock.acquire(timeout=max(0.0, end - time.monotonic())))
        if not got:
            return
        try:
            batch = self._take_batch()
            if batch:
                self._launch_locked(batch, "batched send/recv")
        finally:
            self._launch_lock.release()

    def _launch_locked(self, works: list[NcclWork], what: str):
        """One NCCL group of every call of ``works`` (the launch lock is held).  Returns an
        ``NcclRefusedError`` when NCCL refused the op at its call (the group goes on)."""
        if self._failure is not None:
            err = self._err(NcclAbortedError, what, f"the group already failed: {self._failure}")
            for w in works:
                w._fail(err)
            return None
        try:
            comm = self._comm if self._formed else self._ensure_comm()
            calls = works[0].calls if len(works) == 1 else [c for w in works for c in w.calls]
            self._launch_since = time.monotonic()    # the watchdog ends a launch NCCL holds too long
            try:
                rc, refused = comm.launch(calls, self._stream_h)
            finally:
                self._launch_since = None
        except Exception as err:   # noqa: BLE001 -- nothing reached NCCL's group: nothing to hold
            failure = self._launch_failure(err, what)
            self._fail(failure)
            for w in works:
                w._fail(failure)
            return None
        if rc == _IN_PROGRESS:
            rc = comm.settle(self.op_timeout, stop=lambda: self._failure is not None)
        ok = rc == _SUCCESS
        rt, stream = self.runtime, self._stream_h
        if ok:
            for w in works:                      # copies out of staging buffers, after the calls
                if w.post is not None:
                    rt.enqueue(self._device, self._stream, w.post)
        # An end event for every op as soon as NCCL answered: whatever it launched ends before
        # it completes, and the op keeps its tensors until then (a refusal launched nothing).
        deadline = time.monotonic() + self.op_timeout
        settle = [w for w in works if w._mark_launched(rt.record(stream), deadline)]
        if refused:
            err = NcclRefusedError(f"hpct NCCL {what}: {self._lib.error(rc, 'NCCL refused the op at its call')} "
                                   f"(group {self.group_name}, rank {self.rank}); nothing was launched and the "
                                   "group goes on", fix="check the op's arguments (dtype, count, device)")
            for w in works:
                w._fail(err)
            self._watchers.settle([w for w in works if not w.captured])
            return err
        if not ok:
            failure = self._failure or self._err(*self._launch_error(rc, what))
            self._fail(failure)
            for w in works:
                w._fail(failure)
            self._watchers.settle([w for w in works if not w.captured])
            return None
        inflight = self._inflight
        if works[0].captured:
            self._captured += len(works)
        else:
            inflight.extend(works)
            if len(inflight) > PRUNE_AT:           # ended ops leave here, not all at the watchdog's tick
                self._prune(inflight)
        if self._failure is not None:            # a failure raced the launch: it may have missed these
            err = self._err(NcclAbortedError, what, f"the group failed during the launch: {self._failure}")
            for w in works:
                w._fail(err)
            self._watchers.settle([w for w in works if not w.captured])
        elif settle:
            self._watchers.settle(settle)
        return None

    def _launch_error(self, rc: int, what: str) -> tuple:
        if rc == ENDED or self._failure is not None:
            return NcclAbortedError, what, "the communicator was aborted during the launch"
        if rc == _IN_PROGRESS:
            return NcclOpTimeoutError, what, f"NCCL did not take the launch within {self.op_timeout:g} s"
        return NcclGroupError, what, str(self._lib.error(rc, what, self._comm.handle if self._comm else None))

    def _launch_failure(self, err: Exception, what: str) -> BaseException:
        if isinstance(err, NcclGroupError):
            return err
        if self._failure is not None:
            return self._err(NcclAbortedError, what, f"the group already failed: {self._failure}")
        if isinstance(err, CommEnded):
            return self._err(NcclAbortedError, what, f"the communicator was {err}")
        return self._err(NcclGroupError, what, f"{type(err).__name__}: {err}")

    # ---- coalescing (torch's _coalescing_manager, batch_isend_irecv) ---------------------------
    def start_coalescing(self) -> None:
        self._flush(time.monotonic() + self.op_timeout)
        with self._lock:
            self._coalescing = True

    def end_coalescing(self) -> NcclWork | None:
        """Launch every op issued since start_coalescing as one NCCL group; its one Work."""
        with self._lock:
            self._coalescing = False
            batch, self._batch = self._batch, []
        if not batch:
            return None
        group = NcclWork(self, "coalesced ops", batch[0].device, [w._result for w in batch],
                         keep=[t for w in batch for t in w._keep])
        group.captured = batch[0].captured
        if not self._launch_lock.acquire(timeout=self.op_timeout + ABORT_HELD_S):
            err = self._failure or self._err(NcclOpTimeoutError, "coalesced ops", "another launch held the engine")
            for w in [*batch, group]:
                w._fail(err)
            return group
        try:
            refused = self._launch_locked(batch + [group], "coalesced ops")
        finally:
            self._launch_lock.release()
        if refused is not None:
            raise refused
        return group
