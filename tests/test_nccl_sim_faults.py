"""The NCCL engine's fault path by NCCL's own rules (issue 38), over the simulated NCCL and runtime.

The simulated library calls it a breach when ncclCommAbort runs while another thread is inside
a call on the same comm (NCCL frees the comm under that call), and the simulated runtime when a
thread in global capture mode queries an event while another thread captures a CUDA graph (CUDA
fails the call and invalidates that capture).  Each test names the item of the issue it proves
and what the engine did before.  What only a GPU proves (the real abort flag waking a real held
call, the real graph keeping the real comm): tests/gpu, the GPU proof (docs/gpu.md).
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from hpct.testing import nccl_sim
from hpct.distributed.nccl import comm as nccl_comm, watchdog as nccl_watchdog
from hpct.distributed.nccl.engine import NcclEngine
from hpct.distributed.nccl.library import BLOCKING, NONBLOCKING
from hpct.distributed.nccl.work import NcclConnectError, NcclGroupError, NcclOpTimeoutError, NcclRefusedError
from hpct.errors import HpctArgumentError
from hpct.ports import free_port_block
from hpct.testing.nccl_sim import runtime as sim_runtime
from hpct.testing.nccl_sim.library import SimNccl
from hpct.testing.nccl_sim.runtime import SimRuntime, capture
from sim_ranks import Ranks, no_breach, until  # noqa: F401 -- a fixture

pytestmark = [pytest.mark.nccl_sim]
R = dist.ReduceOp


def in_thread(fn):
    """Run ``fn`` on a daemon thread; returns (thread, box) with box["out"] or box["err"]."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as err:   # noqa: BLE001 -- handed to the test
            box["err"] = err
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


# ---------------------------------------------------------------- item 1: abort under a held call
def test_a_call_that_never_returns_leaves_the_comm_leaked_and_aborted_once_it_returns(monkeypatch, no_breach):
    """A held launch deaf to its abort flag: the watchdog fails the group at the op timeout,
    raises the flag, waits ABORT_HELD_S and leaves the comm leaked (never freed under the call),
    and the group's error says so; once the call returns, the reaper aborts it under its lock.
    Before: ncclCommAbort ran beside the held call after 1 s (a breach)."""
    monkeypatch.setattr(nccl_comm, "ABORT_HELD_S", 0.5)
    lib = SimNccl(stuck_launch=True, deaf_to_flag=True)
    ranks = Ranks(2, lib=lib, op_timeout=1.0, blocking=True)
    runner, box = in_thread(lambda: ranks.run(lambda r, e: e.allreduce([torch.ones(1)]), timeout=60))
    until(lambda: all("leaked" in str(e.failure) for e in ranks.engines), 10,
          "the watchdog did not fail the groups and leave the comms leaked")
    for e in ranks.engines:
        assert isinstance(e.failure, NcclOpTimeoutError), e.failure
        assert "the communicator was leaked: a call on it did not return within 0.5 s" in str(e.failure)
        assert e._comm.end_how.startswith("leaked") and not e._comm.freed
    assert all(c.flag.is_set() and c.ended is None for c in lib.comms.values())
    lib.release.set()                            # the held calls return at last
    runner.join(20)
    assert not runner.is_alive()
    until(lambda: all(c.ended == "aborted" for c in lib.comms.values()) and all(e._comm.freed for e in ranks.engines),
          10, "the reaper did not abort")
    ranks.close()


def test_a_libnccl_without_the_flag_gets_non_blocking_comms_whose_stuck_launch_is_aborted(no_breach):
    """An older drop-in (no ncclCommRaiseAbortFlag): blocking comms are asked for, but a held
    blocking call could not be ended by NCCL's rules, so the engine forms non-blocking ones,
    whose calls never hold; abort ends a launch NCCL never takes."""
    lib = SimNccl(raise_flag=False, stuck_launch=True)
    ranks = Ranks(2, lib=lib, op_timeout=60.0, blocking=True)
    runner, box = in_thread(lambda: ranks.run(lambda r, e: e.allreduce([torch.ones(1)]), timeout=60))
    until(lambda: len(lib.comms) == 2 and all(c.job_polls is not None for c in lib.comms.values()), 20,
          "the launches did not start")
    assert [e.comm_kind for e in ranks.engines] == [NONBLOCKING] * 2
    assert not any(c.blocking for c in lib.comms.values())
    for e in ranks.engines:
        e.abort("the test")
    runner.join(10)
    assert not runner.is_alive()
    assert all(c.ended == "aborted" for c in lib.comms.values())
    ranks.close()


# ---------------------------------------------------------------- item 2: the watchdog never launches
def test_the_watchdog_never_launches_a_deferred_send_and_waits_stay_bounded(no_breach):
    """A deferred send nobody waits for stays deferred: the watchdog never calls ncclGroupEnd
    (before: it flushed the batch after 0.2 s with a blocking ncclGroupEnd on its own thread,
    which a lazy connect to a stalled peer held, hanging the watchdog and every wait()).  The
    send goes out with the application's wait; NCCL holds that launch; the watchdog ends it
    through the flag at the op timeout."""
    lib = SimNccl(stuck_launch=True, stuck_from=1)
    ranks = Ranks(2, lib=lib, op_timeout=1.0, blocking=True)
    ranks.run(lambda r, e: e.allreduce([torch.ones(1)]).wait())       # formed, the watchdog runs
    e = ranks.engines[0]
    work = e.send([torch.ones(4)], 1)
    time.sleep(0.6)                                                    # three old flush periods
    assert not work._launched and not any(t.startswith("hpct-nccl-watchdog") and c == "ncclGroupEnd"
                                          for t, c in ranks.comm(0).calls)
    t0 = time.monotonic()
    with pytest.raises(NcclGroupError, match="NCCL did not take the launch within the op timeout"):
        work.wait()
    assert time.monotonic() - t0 < 1.0 + 3.0
    assert ranks.comm(0).flag.is_set()
    until(lambda: ranks.comm(0).ended == "aborted", 5, "the comm was not aborted once the launch returned")
    ranks.close()


# ---------------------------------------------------------------- item 3: failed or hung init
# (a hung init ended through the flag: test_nccl_sim.py::test_a_blocking_init_past_its_deadline_...)
def _engines(addrs, generation, lib, **kw):
    return [NcclEngine(rank=r, size=len(addrs), global_ranks=list(range(len(addrs))), generation=generation,
                       group_index=0, group_name="init", listen_addr=addrs[r], addresses=addrs, job_key=0x5157,
                       retry_delay_ms=20, library=lib, runtime=SimRuntime(), blocking_comm=True, **kw)
            for r in range(len(addrs))]


def test_a_failed_blocking_init_aborts_its_comm_so_the_next_generation_takes_the_same_port(no_breach):
    """Rank 1 never starts: rank 0's blocking init fails at the ring's deadline.  NCCL leaves that
    comm allocated, holding its fixed listen port, for the caller to abort; the engine aborts it,
    so the next generation forms on the same slot at once.  Before: the comm was never aborted
    and the next init on that port failed ("cannot listen ... Address already in use")."""
    base = free_port_block(2)
    addrs = [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]
    lib = SimNccl()
    first = _engines(addrs, 0, lib, connect_timeout=0.5, op_timeout=5.0)[0]
    with pytest.raises(NcclConnectError, match="rootless init"):
        first.allreduce([torch.ones(1)]).wait()
    assert first._comm.end_how == "aborted" and first._comm.freed
    second = _engines(addrs, 1, lib, connect_timeout=10.0, op_timeout=10.0)
    box: dict = {}
    ts = [threading.Thread(target=lambda e=e, r=r: box.__setitem__(r, (lambda t: (e.allreduce([t]).wait(), t)[1])(
        torch.full((2,), r + 1.0))), daemon=True) for r, e in enumerate(second)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert [box[r].tolist() for r in range(2)] == [[3.0, 3.0]] * 2
    for e in [first, *second]:
        e.shutdown(5.0)


# ---------------------------------------------------------------- item 4: one call refused
def test_an_invalid_argument_from_one_call_refuses_that_op_and_the_group_goes_on(no_breach):
    """ncclInvalidArgument at an op's own call: NCCL ends the group without launching it and the
    comm stays usable.  The op is refused at the call; the next op runs.  Before: any error in a
    launch failed and aborted the whole group."""
    ranks = Ranks(2, lib=SimNccl(refuse_calls=1), blocking=True)

    def body(r, e):
        with pytest.raises(NcclRefusedError, match="invalid argument.*nothing was launched and the group goes on"):
            e.allreduce([torch.ones(2)])
        assert e.failure is None
        t = torch.full((2,), r + 1.0)
        e.allreduce([t]).wait()
        return t.tolist()
    assert ranks.run(body) == [[3.0, 3.0]] * 2
    ranks.close()


def test_a_float8_reduction_below_sm_90_is_refused_at_the_call(monkeypatch, no_breach):
    monkeypatch.setattr(sim_runtime, "CAPABILITY", (8, 0))
    ranks = Ranks(2)

    def body(r, e):
        e.allreduce([torch.ones(2)]).wait()
        with pytest.raises(HpctArgumentError, match=r"float8_e4m3fn needs an sm_90 GPU or newer \(this one is sm_80\)"):
            e.allreduce([torch.ones(2).to(torch.float8_e4m3fn)])
        out = torch.empty(4, dtype=torch.float8_e4m3fn)
        e.all_gather_single(out, torch.ones(2).to(torch.float8_e4m3fn)).wait()     # no reduction: allowed
        return e.failure is None
    assert ranks.run(body) == [True, True]
    ranks.close()


# ---------------------------------------------------------------- item 5: tensors outlive their kernels
def test_a_launch_that_fails_after_enqueueing_keeps_its_buffers_until_the_kernel_ended(no_breach):
    """ncclGroupEnd enqueued the kernel, then answered an error: the op's end event is recorded
    at once and its staging buffer lives until that event completes (the abort ends the kernel a
    little later).  Before: no event was recorded on that path and the buffer was dropped at once."""
    lib = SimNccl(error_after_launch=True, gate_kernels=True)      # the kernels end when the test says
    ranks = Ranks(2, lib=lib, blocking=True)
    refs = {}

    def body(r, e):
        w = e.reduce_scatter(torch.empty(2), [torch.ones(2), torch.ones(2)], R.SUM)
        refs[r] = weakref.ref(next(t for t in w._keep if t.shape == (2, 2)))
        assert isinstance(e.failure, NcclGroupError) and w._event is not None
        del w
        return True
    assert ranks.run(body) == [True, True]
    gc.collect()
    assert [refs[r]() is not None for r in range(2)] == [True, True], "freed while its kernel may run"
    lib.kernel_gate.set()
    until(lambda: (gc.collect() or True) and all(refs[r]() is None for r in range(2)), 10,
          "the buffers were not released after the kernel ended")
    ranks.close()


# ---------------------------------------------------------------- item 6: every wait bounded
def test_shutdown_is_completed_and_get_future_stay_bounded_while_a_launch_holds_the_engine(monkeypatch, no_breach):
    """A launch NCCL holds forever (deaf to the flag) keeps the launch lock: shutdown returns
    within its own deadline, is_completed() of a deferred op answers at once, get_future()
    returns.  Before: each of them waited for the launch lock without a bound."""
    monkeypatch.setattr(nccl_comm, "ABORT_HELD_S", 0.3)
    lib = SimNccl(stuck_launch=True, stuck_from=1, deaf_to_flag=True)
    ranks = Ranks(2, lib=lib, op_timeout=30.0, blocking=True)
    ranks.run(lambda r, e: e.allreduce([torch.ones(1)]).wait())
    e = ranks.engines[0]
    holder, _ = in_thread(lambda: e.allreduce([torch.ones(1)]))
    until(lambda: ranks.comm(0).in_call == "ncclGroupEnd", 10, "the launch was not held")
    deferred = e.send([torch.ones(2)], 1)
    t0 = time.monotonic()
    assert deferred.is_completed() is False
    assert time.monotonic() - t0 < 0.2
    e.op_timeout = 0.5
    t0 = time.monotonic()
    deferred.get_future()
    assert time.monotonic() - t0 < 0.5 + 0.5
    t0 = time.monotonic()
    e.shutdown(1.0)
    assert time.monotonic() - t0 < 1.0 + 0.3 + 1.0
    assert e.failure is not None and "leaked" in str(e.failure)
    lib.release.set()
    holder.join(10)
    assert not holder.is_alive()
    until(lambda: ranks.comm(0).ended == "aborted", 10, "the reaper did not abort")
    ranks.engines[1].shutdown(5.0)


def test_a_send_issued_as_shutdown_looks_at_the_batch_is_refused_and_its_future_completes(no_breach):
    """The race tests/test_nccl_sim_stress.py met about once in a few hundred rounds ("a future never
    completed"): a rank's send passed the shut-down check, shutdown then found nothing batched and
    stopped the completer, the send joined the batch, and its get_future launched it on the still
    open comm and handed its future to the completer that had left.  Here the send is held between
    its check and its batching until shutdown has stopped the completer; it must come out refused,
    its future completed with the reason."""
    ranks = Ranks(2)
    ranks.run(lambda r, e: e.allreduce([torch.ones(1)]).wait())
    ranks.lib.hang_op = True              # from now on a kernel ends only at an abort, as a send no peer takes
    e = ranks.engines[0]
    at_batch, go = threading.Event(), threading.Event()
    follow, join = e._follow, e._watchers.join

    def held_follow(work, caller):
        follow(work, caller)
        at_batch.set()
        go.wait(10)

    def join_then_release(timeout):
        join(timeout)
        go.set()
        sender.join(10)                     # the send ends, and asks for its future, before the comm's end

    e._follow = held_follow
    e._watchers.join = join_then_release
    sender, box = in_thread(lambda: e.send([torch.ones(4)], 1).get_future())
    assert at_batch.wait(10), "the send did not reach its batching"
    e.shutdown(3.0)
    assert not sender.is_alive() and "out" in box, box
    fut = box["out"]
    until(fut.done, 5, "the send's future did not complete")
    with pytest.raises(Exception, match="the group is shut down"):
        fut.wait()
    ranks.engines[1].shutdown(5.0)


# ---------------------------------------------------------------- item 7: CUDA graphs
def test_helper_threads_query_in_thread_local_mode_during_a_global_capture(monkeypatch, no_breach):
    """While the application captures a graph in global mode (torch.cuda.graph's default), the
    watchdog and the completer go on querying events of earlier ops: in thread-local mode, as
    ProcessGroupNCCL's watchdog does, that neither fails nor invalidates the capture.  Before:
    they queried in global mode (the runtime calls that a breach)."""
    monkeypatch.setattr(nccl_watchdog, "WATCHDOG_PERIOD_S", 0.005)
    ranks = Ranks(2)
    # The ranks are threads of one process here (processes on a GPU): they enter and leave their
    # captures together, so that no rank's application thread queries beside another's capture.
    together = threading.Barrier(2)

    def body(r, e):
        for _ in range(5):
            e.allreduce([torch.ones(1)]).get_future()       # in flight, queued for the completer
        together.wait(10)
        with capture():
            w = e.allreduce([torch.ones(2)])
            time.sleep(0.3)                                   # the helpers tick meanwhile
            together.wait(10)
        together.wait(10)
        w.wait()
        return True
    assert ranks.run(body) == [True, True]
    ranks.lib.release_graphs()
    ranks.close()


def test_a_side_thread_query_during_a_global_capture_is_a_breach():
    """The rule the test above relies on can fail: a plain thread (global mode) querying an event
    while another thread captures is recorded as a breach."""
    rt = SimRuntime()
    stream, handle = rt.new_stream(None)
    ev = rt.take()
    rt._record(ev, handle)
    before = len(nccl_sim.BREACHES)
    inside, leave = threading.Event(), threading.Event()

    def capturer():
        with capture():
            inside.set()
            leave.wait(10)
    t = threading.Thread(target=capturer, daemon=True)
    t.start()
    inside.wait(10)
    try:
        with pytest.raises(nccl_sim.SimBreach, match="another thread captures a CUDA graph in global mode"):
            rt.done(ev)
    finally:
        leave.set()
        t.join(10)
        del nccl_sim.BREACHES[before:]


def test_shutdown_with_a_live_graph_returns_in_its_bound_and_the_comm_is_freed_with_the_graph(capfd, no_breach):
    """NCCL's destroy and abort wait for every CUDA graph that captured an op on the comm
    (commDestroySync).  Shutdown returns within its deadline, says why, and the comm is freed
    once the graph is destroyed.  Before: shutdown called ncclCommDestroy without a bound and
    never returned while the graph lived (seen on the H200 at the session's start)."""
    ranks = Ranks(2)
    together = threading.Barrier(2)             # the ranks (threads here) capture together

    def body(r, e):
        e.allreduce([torch.ones(1)]).wait()
        together.wait(10)
        with capture():
            e.allreduce([torch.ones(2)]).wait()
            together.wait(10)
        together.wait(10)
        t0 = time.monotonic()
        e.shutdown(1.0)
        return time.monotonic() - t0
    took = ranks.run(body, timeout=30)
    assert all(t < 1.0 + 1.0 for t in took), took
    err = capfd.readouterr().err
    assert "ncclCommDestroy did not return" in err and "captured into CUDA graphs: destroy those graphs" in err
    assert not any(e._comm.freed for e in ranks.engines)
    ranks.lib.release_graphs()
    until(lambda: all(e._comm.freed for e in ranks.engines), 10, "the comms were not freed with the graphs")


def test_the_comm_kind_follows_the_library():
    from hpct.distributed.nccl.library import comm_kind
    assert comm_kind(SimNccl(), True)[0] == BLOCKING
    kind, why = comm_kind(SimNccl(raise_flag=False), True)
    assert kind == NONBLOCKING and "lacks ncclCommRaiseAbortFlag" in why
    assert comm_kind(SimNccl(), False) == (NONBLOCKING, "HPCT_NCCL_BLOCKING=0")
