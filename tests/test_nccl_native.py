"""The native launch's fault cases (issue 61 item 4): hpct._gloo.Launcher under the engine, driven by
the simulated NCCL and runtime (ctypes callbacks) and by the null C double (hpct/testing/nccl_sim/null.c).

Each test names the broken variant it fails on (checked by building the extension with it):
- a held launch is ended by the flag, then aborted under the lock; the launch runs without the GIL;
  a launch that finds the flag raised before its group calls nothing;
- an invalid argument refuses the op and keeps the group (the group is ended, the end event recorded);
- a failure during capture: a captured launch that NCCL fails is never polled; a CUDA error of the
  capture check launches nothing and is the op's error;
- buffers are kept until the kernel ends: every op of a failed batch has its own end event.
What only a GPU proves: the same code against libcuda and libnccl (docs/gpu.md, the GPU pack).
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from hpct import _gloo
from hpct.distributed.nccl import native, watchdog as nccl_watchdog
from hpct.distributed.nccl.comm import Communicator
from hpct.distributed.nccl.engine import NcclEngine
from hpct.distributed.nccl.work import NcclGroupError, NcclOpTimeoutError, NcclRefusedError
from hpct.testing.nccl_sim import null
from hpct.testing.nccl_sim.library import REMOTE_ERROR, SimNccl
from hpct.testing.nccl_sim.runtime import capture
from sim_ranks import Ranks, no_breach, until  # noqa: F401 -- a fixture

pytestmark = [pytest.mark.nccl_sim]
SYSTEM_ERROR = 2
CAPTURE_INVALIDATED = 901          # CUDA_ERROR_STREAM_CAPTURE_INVALIDATED


@pytest.fixture
def answers(monkeypatch):
    """Every native launch's answer, as the engine's communicators got it."""
    seen: list[int] = []
    real = Communicator.launch

    def spy(self, *args):
        r = real(self, *args)
        seen.append(r)
        return r
    monkeypatch.setattr(Communicator, "launch", spy)
    return seen


def warm(ranks: Ranks) -> None:
    ranks.run(lambda r, e: e.allreduce([torch.ones(1)]).wait())


# ---------------------------------------------------------------- the abort flag and the GIL
def test_a_held_launch_is_ended_by_the_flag_and_the_comm_is_aborted_after_it_returned(answers, no_breach):
    """A blocking launch NCCL holds (a lazy connect to a silent peer): the watchdog fails the group
    at the op timeout and raises the comm's flags; the held ncclGroupEnd returns, the launch says
    the flag went up while NCCL had the group and records the end event; only then ncclCommAbort
    runs, under the lock.  Fails when the launch does not report the flag (LAUNCH_FLAG_DURING)."""
    lib = SimNccl(stuck_launch=True, stuck_from=1)
    ranks = Ranks(2, lib=lib, op_timeout=1.0, blocking=True)
    warm(ranks)

    def body(r, e):
        with pytest.raises(NcclOpTimeoutError, match="NCCL did not take the launch within the op timeout"):
            e.allreduce([torch.ones(1)]).wait()
        return e._comm
    comms = ranks.run(body, timeout=30)
    held = [r for r in answers if r & native.FLAG_DURING]
    assert len(held) == 2, [hex(r) for r in answers]
    assert all(r & native.RESULT_MASK == SYSTEM_ERROR and r & native.RECORDED for r in held)
    for comm in comms:
        until(lambda c=comm: c.freed, 10, "the comm was not aborted after the held call returned")
        steps = [what for _, what in comm.trace]
        assert steps[:3] == ["abort flag raised", "the held call returned", "ncclCommAbort called"], steps
        assert comm.flag.raised
    ranks.close()


def test_the_launch_runs_without_the_gil_while_nccl_holds_it():
    """null.c's ncclGroupEnd waits, in C, until a Python thread sets null_release (at most 10 s).
    Fails when the launch keeps the GIL: no Python thread runs until the hold gives up."""
    lib, rt = null.NullNccl(), null.NullRuntime()
    eng = NcclEngine(rank=0, size=1, global_ranks=[0], generation=0, group_index=0, group_name="gil",
                     listen_addr="127.0.0.1:1", addresses=["127.0.0.1:1"], job_key=1, connect_timeout=5,
                     op_timeout=60, library=lib, load=lambda: lib, runtime=rt, blocking_comm=True)
    t = torch.ones(1)
    eng.allreduce([t]).wait()
    hold, release, held_out = null.flag("hold_group_end"), null.flag("null_release"), null.flag("null_held_out")
    hold.value, release.value, held_out.value = 1, 0, 0
    try:
        before = null.calls()
        launcher = threading.Thread(target=lambda: eng.allreduce([t]).wait(), daemon=True)
        launcher.start()
        # capture check, record, wait, group start, the op, group end: the launch is inside ncclGroupEnd
        until(lambda: null.calls() >= before + 6, 5, "the launch did not reach ncclGroupEnd")
        release.value = 1
        launcher.join(15)
        assert not launcher.is_alive()
        assert held_out.value == 0, "ncclGroupEnd gave up waiting: the launch held the GIL"
    finally:
        hold.value, release.value = 0, 0
        eng.shutdown(5.0)


def test_a_launch_that_finds_the_flag_raised_before_its_group_calls_nothing(no_breach):
    """The race the flag closes: the comm's abort begins while a launch holds the comm's lock but
    has not reached NCCL yet (here: inside its capture check).  Abort cannot take the lock, so it
    raises the flags; the launch sees its flag before ncclGroupStart and calls nothing; the op fails
    with the group's error and abort then runs.  Fails without the flag check before the group."""
    ranks = Ranks(2, blocking=True)
    warm(ranks)
    e, lib, sim = ranks.engines[0], ranks.lib, ranks.comm(0)
    starts, launches = lib.group_starts, sim.launches
    aborter: list[threading.Thread] = []

    def abort_now():
        ranks.runtime.on_capture_check.clear()
        aborter.append(threading.Thread(target=e.abort, args=("the test's abort",), daemon=True))
        aborter[0].start()
        until(sim.flag.is_set, 5, "abort did not raise the flag")
    ranks.runtime.on_capture_check.append(abort_now)
    work = e.allreduce([torch.ones(1)])
    with pytest.raises(NcclGroupError, match="aborted: the test's abort"):
        work.wait()
    assert (lib.group_starts, sim.launches) == (starts, launches), "the launch called NCCL after the flag"
    aborter[0].join(10)
    assert sim.ended == "aborted" and e._comm.flag.raised
    ranks.close()


# ---------------------------------------------------------------- an invalid argument
def test_an_invalid_argument_refuses_the_op_ends_the_group_and_the_comm_goes_on(answers, no_breach):
    """An op's own call answers ncclInvalidArgument: the launch still ends the group (the next
    ncclGroupStart would be nested otherwise: a breach), records the end event and says REFUSED;
    the op raises NcclRefusedError and the next op runs.  Fails when the group is left open or the
    refusal is not reported (the group would fail)."""
    ranks = Ranks(2, lib=SimNccl(refuse_calls=1), blocking=True)

    def body(r, e):
        with pytest.raises(NcclRefusedError, match="nothing was launched and the group goes on"):
            e.allreduce([torch.ones(2)])
        t = torch.full((2,), r + 1.0)
        e.allreduce([t]).wait()
        return e.failure, t.tolist()
    assert ranks.run(body) == [(None, [3.0, 3.0])] * 2
    refused = [r for r in answers if r & native.REFUSED]
    assert len(refused) == 2 and all(r & native.RECORDED and r & native.RESULT_MASK == 4 for r in refused)
    ranks.close()


# ---------------------------------------------------------------- a failure during capture
def test_a_captured_launch_that_nccl_fails_fails_the_op_and_is_never_polled(monkeypatch, no_breach):
    """The comm has failed (a peer reset) and the caller's stream is being captured: ncclGroupEnd
    answers the error, the launch says CAPTURED, the op fails with the group's error, and neither
    the completer nor the watchdog ever queries its event (it belongs to the graph: a query is a
    breach).  Fails when the launch does not report the capture."""
    monkeypatch.setattr(nccl_watchdog, "WATCHDOG_PERIOD_S", 30.0)      # no poll sees the error first
    ranks = Ranks(2, blocking=True)
    warm(ranks)
    together = threading.Barrier(2)

    def body(r, e):
        ranks.comm(r).fail(REMOTE_ERROR, "peer reset the connection")
        together.wait(10)
        with capture():
            w = e.allreduce([torch.ones(2)])
            together.wait(10)
        captured = w.captured
        with pytest.raises(NcclGroupError, match="remote process exited"):
            w.wait()
        time.sleep(0.2)                       # the completer would have queried it by now
        return captured, type(e.failure).__name__
    assert ranks.run(body) == [(True, "NcclGroupError")] * 2
    ranks.close()


def test_a_cuda_error_of_the_capture_check_launches_nothing_and_the_group_goes_on(no_breach):
    """cuStreamIsCapturing fails (the application's capture was invalidated): nothing reaches NCCL,
    the op raises the driver's error naming the step, the group is not failed.  Fails when the
    launch ignores the capture check's error."""
    ranks = Ranks(2, blocking=True)
    warm(ranks)
    e, lib = ranks.engines[0], ranks.lib
    starts = lib.group_starts
    ranks.runtime.capture_check_error = CAPTURE_INVALIDATED
    with pytest.raises(RuntimeError, match=r"the capture check of the caller's stream \(cuStreamIsCapturing\): "
                                           "simulated CUDA driver error 901"):
        e.allreduce([torch.ones(1)])
    ranks.runtime.capture_check_error = 0
    assert lib.group_starts == starts and e.failure is None

    def body(r, eng):
        t = torch.full((2,), r + 1.0)
        eng.allreduce([t]).wait()
        return t.tolist()
    assert ranks.run(body) == [[3.0, 3.0]] * 2
    ranks.close()


# ---------------------------------------------------------------- buffers until the kernel ends
def test_every_op_of_a_failed_batch_keeps_its_buffers_until_the_kernel_ended(no_breach):
    """A deferred send and receive go to NCCL as one group; ncclGroupEnd enqueues the kernel and
    then answers an error.  Each op has its own end event, recorded after the group whatever NCCL
    said, so neither op reads as ended, nor frees its staging buffer, until the kernel (ended by
    the abort, and here only once the test lets it) has ended.  Fails when only the first op's event is recorded."""
    lib = SimNccl(error_after_launch=True, gate_kernels=True)     # the kernels end when the test says
    ranks = Ranks(2, lib=lib, blocking=True)
    refs: dict = {}

    def body(r, e):
        out, inp = torch.empty(8)[::2], torch.full((8,), float(r))[::2]    # staged: buffers only the ops hold
        works = [e.send([inp], 1 - r), e.recv([out], 1 - r)]
        refs[r] = [weakref.ref(next(t for t in w._keep if t is not inp and t is not out)) for w in works]
        works[1].is_completed()                # launches the batch (no raise: an exception's traceback would hold it)
        assert isinstance(e.failure, NcclGroupError) and all(w.exception() is not None for w in works)
        ended = [w.is_completed() for w in works]
        del works
        return ended
    assert ranks.run(body) == [[False, False]] * 2, "an op of the batch read as ended while its kernel ran"
    gc.collect()
    assert all(ref() is not None for r in refs for ref in refs[r]), "a buffer was freed while its kernel ran"
    lib.kernel_gate.set()
    until(lambda: (gc.collect() or True) and all(ref() is None for r in refs for ref in refs[r]), 10,
          "the buffers were not released after the kernel ended")
    ranks.close()


# ---------------------------------------------------------------- bad input
def test_the_launcher_refuses_bad_calls_and_addresses_with_a_message():
    with pytest.raises(ValueError, match="the address of ncclGroupStart is 0"):
        _gloo.Launcher((1, 2, 3), (0, 5))
    launcher = _gloo.Launcher((1, 2, 3), (4, 5))           # never called with these
    flag = _gloo.AbortFlag()
    flag.raise_flag()
    with pytest.raises(ValueError, match="unknown call kind 9"):
        launcher.launch(flag, 1, 0, 0, 0, 7, [(9, 1, 0, 0, 0, 0, 0)])
    with pytest.raises(ValueError, match="a call of kind 3 takes 4 arguments, got 5"):
        launcher.launch(flag, 1, 0, 0, 0, 7, [(_gloo.CALL_P2P, 1, 0, 0, 0, 0, 0)])
    with pytest.raises(TypeError, match="calls must be a list"):
        launcher.launch(flag, 1, 0, 0, 0, 7, ((0, 1),))
    # a well-formed call with the flag raised: nothing is called (these addresses would crash)
    assert launcher.launch(flag, 1, 0, 0, 0, 7, [(_gloo.CALL_P2P, 1, 0, 0, 0, 0)]) == native.FLAG_BEFORE
