"""Launching an engine's ops: one native launch per NCCL group, in issue order, every wait bounded.

Mixed into NcclEngine.  ``_submit`` builds the Work and launches it now, or follows the caller's
stream now and defers the launch (sends and receives, coalescing, a host step before the calls);
``_launch_locked`` makes one NCCL group of the works' calls under the launch lock -- one call into
the extension (native.py), which follows the caller's stream, runs the group and records the end
events with the GIL released -- and decides what the answer means: ncclSuccess (or ncclInProgress
that settles) launched the ops; ncclInvalidArgument at an op's own call refused them and the group
goes on; the comm's abort flag up before the group: nothing was called, the group has failed;
anything else fails the group.  Every launched op gets its end event, whatever NCCL answered, and
keeps its tensors until that event completes; a CUDA error before the group launched nothing and
is the op's error.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from . import library as nccl_lib, native
from .comm import ABORT_HELD_S, ENDED, CommEnded
from .work import NcclAbortedError, NcclGroupError, NcclOpTimeoutError, NcclRefusedError, NcclWork

_SUCCESS, _IN_PROGRESS = nccl_lib.SUCCESS, nccl_lib.IN_PROGRESS
_OK, _CAPTURED, _RECORDED = native.OK, native.CAPTURED, native.RECORDED
# Launched ops kept for the watchdog before the launching thread drops those that ended: a few
# dozen Work objects, not the thousands a 50 ms tick would find after a burst of small ops (they
# cost the garbage collector and the watchdog's GIL time per op).
PRUNE_AT = 32


class Launching:
    """Mixed into NcclEngine (its state, _err, _fail, _check_device, _ensure_comm, _watchers)."""

    @staticmethod
    def _prune(inflight) -> None:
        """Drop the ops that have ended (ops end in launch order on the one stream): all of them
        when the newest has ended, else those at the head."""
        try:
            if inflight[-1]._poll():
                inflight.clear()
                return
        except IndexError:               # a failure cleared it meanwhile
            return
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
        caller = self.runtime.current(dev)
        if pre is not None or defer or self._coalescing:
            self._follow(work, caller)          # the op follows the caller's work so far, now
            caller = None
            if pre is not None:
                self.runtime.enqueue(dev, self._stream, pre)
            if defer or self._coalescing:
                with self._lock:
                    # Looked at again under the lock shutdown sets _closed with: a work batched after
                    # shutdown looked at the batch would be launched by nobody's flush but a late
                    # get_future's, after the completer that settles its future has left.
                    if self._failure is not None or self._closed:
                        work._fail(self._err(NcclAbortedError, what, "the group is shut down"))
                        return work
                    if defer or self._coalescing:
                        self._batch.append(work)
                        return work
        lock = self._launch_lock
        if not lock.acquire(False) and not lock.acquire(timeout=self.op_timeout + ABORT_HELD_S):
            work._fail(self._failure or self._err(NcclOpTimeoutError, what, "another launch held the engine "
                                                  f"for more than {self.op_timeout + ABORT_HELD_S:g} s"))
            return work
        try:
            if self._closed:            # shut down while this waited for the lock: nothing may launch now
                work._fail(self._err(NcclAbortedError, what, "the group is shut down"))
                return work
            refused = self._launch_locked(self._take_batch() + [work] if self._batch else [work], what, caller)
        finally:
            lock.release()
        if refused is not None:
            raise refused
        return work

    def _submit_one(self, what: str, tensors, calls) -> NcclWork:
        """``_submit`` of an op on one tensor whose result is that tensor (DDP's buckets), launched
        now on a formed comm: the common case and the launch's common answer inline, anything
        else through ``_submit`` and ``_answer``."""
        t = tensors[0]
        lock = self._launch_lock
        if (self._batch or self._coalescing or not self._formed or self._failure is not None or self._closed
                or t.get_device() != self._device_index or t.is_sparse or not lock.acquire(False)):
            return self._submit(what, tensors, calls, tensors)
        if self._closed:                # shut down between the look above and the lock: _submit refuses it
            lock.release()
            return self._submit(what, tensors, calls, tensors)
        rt = self.runtime
        try:
            work = NcclWork(self, what, self._device, tensors, calls, (t,))
            ev = rt.take()
            caller = rt.current(self._device)
            comm = self._comm
            self._launch_since = now = time.monotonic()
            try:
                r = comm.launch(calls, caller, self._stream_h, self._follow_ev, ev)
            except CommEnded as err:
                rt.release(ev)
                r, refused = None, self._not_launched([work], what, err)
            finally:
                self._launch_since = None
            if r is None:
                pass
            elif r != _OK:
                refused = self._answer([work], [ev], what, caller, r, comm)
            else:
                self._launches = seq = self._launches + 1
                work._event, work.deadline, work.seq, work._launched = ev, now + self.op_timeout, seq, True
                inflight = self._inflight
                inflight.append(work)
                if len(inflight) > PRUNE_AT:       # ended ops leave here, not all at the watchdog's tick
                    self._prune(inflight)
                if self._failure is not None:      # a failure raced the launch: it may have missed it
                    work._fail(self._err(NcclAbortedError, what, f"the group failed during the launch: "
                                                                 f"{self._failure}"))
                    self._watchers.settle([work])
                return work
        finally:
            lock.release()
        if refused is not None:
            raise refused
        return work

    def _follow(self, work: NcclWork, caller: int) -> None:
        """The engine stream follows the caller's now (the op is launched later)."""
        r = self._native.follow(caller, self._stream_h, self._follow_ev)
        if r >> native.CUDA_SHIFT:
            raise native.cuda_error(self.runtime, r)
        work.captured = bool(r & _CAPTURED)

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
                self._launch_locked(batch, "batched send/recv", None)
        finally:
            self._launch_lock.release()

    def _launch_locked(self, works: list[NcclWork], what: str, caller: int | None):
        """One NCCL group of every call of ``works`` (the launch lock is held); ``caller``: the
        caller's stream the launch follows first (None: the works followed it when issued).
        Returns the error to raise at the call: ``NcclRefusedError`` when NCCL refused the op at
        its call (the group goes on), a CUDA error when nothing reached NCCL."""
        if self._failure is not None:
            err = self._err(NcclAbortedError, what, f"the group already failed: {self._failure}")
            for w in works:
                w._fail(err)
            return None
        rt = self.runtime
        events = [rt.take() for _ in works]
        try:
            comm = self._comm if self._formed else self._ensure_comm()
            calls = works[0].calls if len(works) == 1 else [c for w in works for c in w.calls]
            self._launch_since = time.monotonic()    # the watchdog ends a launch NCCL holds too long
            try:
                r = comm.launch(calls, caller or 0, self._stream_h, 0 if caller is None else self._follow_ev,
                                events[0] if len(works) == 1 else tuple(events))
            finally:
                self._launch_since = None
        except Exception as err:   # noqa: BLE001 -- nothing reached NCCL's group: nothing to hold
            for ev in events:
                rt.release(ev)
            return self._not_launched(works, what, err)
        return self._answer(works, events, what, caller, r, comm)

    def _not_launched(self, works, what, err):
        """Nothing reached NCCL's group (the comm ended, its forming failed): the group fails."""
        failure = self._launch_failure(err, what)
        self._fail(failure)
        for w in works:
            w._fail(failure)
        return None

    def _answer(self, works, events, what, caller, r, comm):
        """What the native launch's answer ``r`` means for ``works`` (see the module doc)."""
        if r & native.FLAG_BEFORE:               # raised before the group: nothing was called
            for ev in events:
                self.runtime.release(ev)
            return self._not_launched(works, what, CommEnded(comm.end_how or "aborted"))
        if r == _OK:                             # taken, recorded, not captured
            return self._launched(works, events, what, _SUCCESS)
        if caller is not None:
            works[-1].captured = bool(r & _CAPTURED)
        if not r & _RECORDED:
            return self._cuda_failed(works, events, what, native.cuda_error(self.runtime, r),
                                     launched=native.cuda_step(r) == native.STEP_END_RECORD)
        rc = r & native.RESULT_MASK
        settled = rc == _IN_PROGRESS
        if settled:
            rc = comm.settle(self.op_timeout, stop=lambda: self._failure is not None)
        if r & native.REFUSED:
            return self._refused(works, events, what, rc)
        return self._launched(works, events, what, rc, settled)

    def _launched(self, works, events, what, rc, again: bool = False):
        """NCCL answered ``rc`` and every work's end event is recorded.  ``again``: the events
        are recorded once more, after what is enqueued now (a non-blocking comm's group is on
        the stream only once it settled; copies out of staging buffers follow the calls)."""
        ok = rc == _SUCCESS
        if ok:
            rt = self.runtime
            for w in works:                      # copies out of staging buffers, after the calls
                if w.post is not None:
                    rt.enqueue(self._device, self._stream, w.post)
                    again = True
        if again:
            for ev in events:
                bad = self._native.record(ev, self._stream_h)
                if bad:
                    err = self.runtime.driver_error(bad, "recording the op's end event after the group (cuEventRecord)")
                    return self._cuda_failed(works, events, what, err, launched=True)
        deadline = time.monotonic() + self.op_timeout
        self._launches += 1
        seq = self._launches
        settle = [w for w, ev in zip(works, events) if w._mark_launched(ev, deadline, seq, ok)]
        if not ok:
            failure = self._failure or self._err(*self._launch_error(rc, what))
            self._fail(failure, capturing=works[0].captured)
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

    def _refused(self, works, events, what, rc):
        """An op's own call answered ncclInvalidArgument: NCCL launched none of the group."""
        deadline = time.monotonic() + self.op_timeout
        self._launches += 1
        for w, ev in zip(works, events):
            w._mark_launched(ev, deadline, self._launches, False)
        err = NcclRefusedError(f"hpct NCCL {what}: {self._lib.error(rc, 'NCCL refused the op at its call')} "
                               f"(group {self.group_name}, rank {self.rank}); nothing was launched and the "
                               "group goes on", fix="check the op's arguments (dtype, count, device)")
        for w in works:
            w._fail(err)
        self._watchers.settle([w for w in works if not w.captured])
        return err

    def _cuda_failed(self, works, events, what, err, *, launched: bool):
        """A CUDA error.  Before the group (the capture check, the follow) nothing was launched:
        it is the op's error.  After it (an end event), whatever NCCL launched has no event to say
        when it ends: the group fails and the tensors are kept for the engine's life."""
        if not launched:
            for ev in events:
                self.runtime.release(ev)
            for w in works:
                w._fail(err)
            return err
        self._orphans.extend(works)
        failure = self._err(NcclGroupError, what, f"{err}; the op's tensors are kept until the engine ends")
        self._fail(failure)
        for w in works:
            w._fail(failure)
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
            refused = self._launch_locked(batch + [group], "coalesced ops", None)
        finally:
            self._launch_lock.release()
        if refused is not None:
            raise refused
        return group
