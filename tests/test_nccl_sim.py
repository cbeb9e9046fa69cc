"""The NCCL engine's own code over the simulated NCCL and CUDA runtime (hpct/testing/nccl_sim), ranks as threads.

Every op form against its definition, and one test per defect that a reading of the engine
against NCCL 2.30.7 and ProcessGroupNCCL found (issue 27; the number is the issue's).  What
these prove is the engine's logic; NCCL on a GPU is tests/gpu's (docs/gpu.md).
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from hpct.errors import CollectiveError, HpctArgumentError
from hpct.distributed.nccl import comm as nccl_comm, library as nccl_lib, watchdog as nccl_watchdog
from hpct.distributed.nccl.work import NcclAbortedError, NcclGroupError
from hpct.testing.nccl_sim.library import REMOTE_ERROR, SimNccl
from hpct.testing.nccl_sim.runtime import capture, drain
from sim_ranks import Ranks, no_breach  # noqa: F401 -- a fixture

pytestmark = [pytest.mark.nccl_sim]
R = dist.ReduceOp


def wait_done(fut, seconds: float = 10.0):
    end = time.monotonic() + seconds
    while not fut.done():
        if time.monotonic() > end:
            pytest.fail(f"a future was not completed within {seconds:g} s")
        time.sleep(0.002)
    return fut


def strided(*shape, fill=0.0):
    """A non-contiguous tensor of ``shape`` (a transposed view), filled with ``fill``."""
    t = torch.empty(tuple(reversed(shape))).t() if len(shape) == 2 else torch.empty(shape[0] * 2)[::2]
    t.fill_(fill)
    assert not t.is_contiguous()
    return t


@pytest.fixture(params=[False, True], ids=["nonblocking", "blocking"])
def ranks3(request, no_breach):
    r = Ranks(3, blocking=request.param)
    yield r
    r.close()


# ---------------------------------------------------------------- every op, exact
def test_collectives_are_exact_with_non_contiguous_outputs(ranks3):
    """Defect 7: a staged (non-contiguous) output is copied back by the launch itself."""
    n = 3

    def body(r, e):
        x = strided(2, 3, fill=r + 1.0)
        e.allreduce([x]).wait()
        assert torch.equal(x, torch.full((2, 3), 6.0))
        out = strided(2, 3)
        e.all_gather_single(out, torch.full((2,), float(r))).wait()
        assert torch.equal(out, torch.tensor([0.0, 0, 1, 1, 2, 2]).reshape(2, 3))
        rs = strided(2, 2)
        e.reduce_scatter_single(rs, torch.arange(12.0) + r, R.SUM).wait()
        assert torch.equal(rs, (3 * torch.arange(12.0)[4 * r:4 * r + 4] + 3).reshape(2, 2))
        a2a = strided(3, 2)
        e.all_to_all_single(a2a, torch.arange(6.0).reshape(3, 2) + 10 * r, [], []).wait()
        assert torch.equal(a2a, torch.tensor([[10.0 * p + 2 * r, 10.0 * p + 2 * r + 1] for p in range(n)]))
        b = strided(4, fill=float(r))
        e.broadcast([b], 2).wait()
        assert torch.equal(b, torch.full((4,), 2.0))
        red = strided(4, fill=r + 1.0)
        e.reduce(red, 0, R.PRODUCT).wait()
        assert torch.equal(red, torch.full((4,), 6.0 if r == 0 else r + 1.0))
        return True
    assert ranks3.run(body) == [True] * n


def test_list_forms_coalesced_forms_and_their_futures_complete(ranks3):
    """Defect 8: the future of a Work made of several NCCL calls (coalesced ops, alltoall,
    gather, scatter) is completed like any other."""
    n = 3

    def body(r, e):
        outs = [torch.empty(2) for _ in range(n)]
        f = e.allgather([outs], [torch.full((2,), float(r))]).get_future()
        assert [o.tolist() for o in wait_done(f).wait()] == [[float(p)] * 2 for p in range(n)]
        a, c = torch.full((3,), r + 1.0), strided(2, 2, fill=10.0 * r)
        f = e.allreduce_coalesced([a, c], R.SUM).get_future()
        wait_done(f).wait()
        assert a.tolist() == [6.0] * 3 and torch.equal(c, torch.full((2, 2), 30.0))
        lists = [[torch.empty(1), torch.empty(2)] for _ in range(n)]
        wait_done(e.allgather_coalesced(lists, [torch.full((1,), float(r)), torch.full((2,), 5.0 + r)])
                  .get_future())
        assert [[x.tolist() for x in row] for row in lists] == [[[float(p)], [5.0 + p] * 2] for p in range(n)]
        outs = [torch.empty(2) for _ in range(n)]
        wait_done(e.alltoall(outs, [torch.full((2,), 10.0 * r + p) for p in range(n)]).get_future())
        assert [o.tolist() for o in outs] == [[10.0 * p + r] * 2 for p in range(n)]
        got = [torch.empty(2) for _ in range(n)] if r == 1 else []
        wait_done(e.gather(got, torch.full((2,), r * 3.0), 1).get_future())
        assert [g.tolist() for g in got] == ([[3.0 * p] * 2 for p in range(n)] if r == 1 else [])
        mine = torch.empty(3)
        wait_done(e.scatter(mine, [torch.full((3,), 7.0 + p) for p in range(n)] if r == 0 else [], 0)
                  .get_future())
        assert mine.tolist() == [7.0 + r] * 3
        rs = torch.empty(2)
        wait_done(e.reduce_scatter(rs, [torch.full((2,), 100.0 * p + r) for p in range(n)], R.MAX)
                  .get_future())
        assert rs.tolist() == [100.0 * r + 2] * 2
        ag = [torch.empty(2 * n), torch.empty(n)]
        wait_done(e.all_gather_single_coalesced(ag, [torch.full((2,), float(r)), torch.full((1,), -r - 1.0)])
                  .get_future())
        assert ag[1].tolist() == [-1.0, -2.0, -3.0]
        o2 = [torch.empty(1), torch.empty(2)]
        wait_done(e.reduce_scatter_single_coalesced(o2, [torch.ones(n), torch.ones(2 * n)], R.SUM).get_future())
        assert o2[0].tolist() == [3.0] and o2[1].tolist() == [3.0, 3.0]
        return True
    assert ranks3.run(body) == [True] * n


def test_dtypes_ops_uneven_all_to_all_send_recv_and_barrier(ranks3):
    n = 3

    def body(r, e):
        for dtype, op, want in ((torch.float16, R.SUM, 6.0), (torch.bfloat16, R.MAX, 3.0),
                                (torch.int64, R.MIN, 1), (torch.float32, R.AVG, 2.0), (torch.uint8, R.SUM, 6)):
            t = torch.full((5,), r + 1, dtype=dtype)
            e.allreduce([t], op).wait()
            assert torch.equal(t, torch.full((5,), want, dtype=dtype)), (dtype, op, t)
        flags = torch.tensor([r == 1, False])
        e.allreduce([flags], R.SUM).wait()                 # bool sum is "any"
        assert flags.tolist() == [True, False]
        z = torch.full((3,), complex(r, -r), dtype=torch.complex64)
        e.allreduce([z], R.SUM).wait()
        assert torch.equal(z, torch.full((3,), complex(3, -3), dtype=torch.complex64))
        # uneven all_to_all: rank r sends (r + p) % 2 + 1 rows of 2 to rank p
        send_rows = [(r + p) % 2 + 1 for p in range(n)]
        inp = torch.cat([torch.full((k, 2), 100.0 * r + p) for p, k in enumerate(send_rows)])
        out = torch.empty(sum(send_rows), 2)
        e.all_to_all_single(out, inp, send_rows, send_rows).wait()
        assert torch.equal(out, torch.cat([torch.full((k, 2), 100.0 * p + r) for p, k in enumerate(send_rows)]))
        s, got = torch.full((4,), float(r)), torch.empty(4)
        works = [e.send([s], (r + 1) % n), e.recv([got], (r - 1) % n)]
        for w in works:
            w.wait()
        assert got.tolist() == [float((r - 1) % n)] * 4
        e.barrier().wait()
        return True
    assert ranks3.run(body) == [True] * n


# ---------------------------------------------------------------- the defects
def test_a_failed_ops_future_is_an_error_to_cpp_consumers(no_breach):
    """Defect 1: DDP's reducer reads a Work's future in C++; a failed op's future must hold an
    error there, not the exception object as its value."""
    ranks = Ranks(2, lib=SimNccl(hang_op=True))

    def body(r, e):
        work = e.allreduce([torch.ones(4)])
        fut = work.get_future()
        e.abort("the test aborts it")
        cpp = wait_done(_create_work_from_future(fut).get_future())   # a wrapper without Python's unwrap
        with pytest.raises(RuntimeError, match="NcclAbortedError: .* aborted: the test aborts it"):
            cpp.value()
        with pytest.raises(RuntimeError, match="aborted: the test aborts it"):
            fut.wait()
        with pytest.raises(CollectiveError, match="aborted: the test aborts it"):
            work.wait()
        return True
    assert ranks.run(body) == [True, True]
    ranks.close()


def test_calls_on_one_comm_never_overlap(monkeypatch, no_breach):
    """Defect 2: the watchdog polls ncclCommGetAsyncError while ops launch and settle; every
    call on a comm holds its lock (the library holds each call open to make an overlap show)."""
    monkeypatch.setattr(nccl_watchdog, "WATCHDOG_PERIOD_S", 0.0005)
    ranks = Ranks(2, lib=SimNccl(jitter=0.0003, launch_polls=3))

    def body(r, e):
        total = 0.0
        for _ in range(150):
            t = torch.ones(8)
            e.allreduce([t]).wait()
            total += t.sum().item()
        return total
    assert ranks.run(body, timeout=120) == [150 * 16.0] * 2
    polls = [c for c in ranks.comm(0).calls if c[1] == "ncclCommGetAsyncError"]
    assert any(t.startswith("hpct-nccl-watchdog") for t, _ in polls), "the watchdog never polled"
    ranks.close()


def calls_once_ended(comm, seconds: float = 10.0) -> list[str]:
    """The comm's calls once ncclCommAbort has run: a wait() may raise the group's failure
    before the thread that aborts the comm (after the held call returned) got to it."""
    deadline = time.monotonic() + seconds
    while "ncclCommAbort" not in (calls := [c for _, c in comm.calls]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return calls


def launches_waiting(lib: SimNccl, n: int, seconds: float = 20.0) -> None:
    """Until ``n`` comms have a launch NCCL has not taken yet."""
    deadline = time.monotonic() + seconds
    while len(lib.comms) < n or not all(c.job_polls is not None or c.in_call == "ncclGroupEnd"
                                        for c in lib.comms.values()):
        assert time.monotonic() < deadline, "the launches never started"
        time.sleep(0.01)


@pytest.mark.parametrize("blocking", [False, True], ids=["nonblocking", "blocking"])
def test_abort_is_ncclCommAbort_alone_and_ends_a_stuck_launch(no_breach, blocking):
    """Defects 3 and 5: abort during a launch that NCCL never takes returns at once from
    another thread (no engine lock held across the wait), calls ncclCommAbort and no revoke
    (revoke then abort walks the group job revoke freed), and the launch fails.  On a blocking
    comm the launch holds the comm's lock inside NCCL: abort raises the abort flag alone, the
    held call returns, and ncclCommAbort runs under the lock with no call beside it (the
    library calls an abort beside a call a breach)."""
    lib = SimNccl(stuck_launch=True)
    ranks = Ranks(2, lib=lib, op_timeout=120.0, blocking=blocking)
    works = {}
    runner = threading.Thread(target=lambda: works.update(enumerate(ranks.run(
        lambda r, e: e.allreduce([torch.ones(1)]), timeout=60))), daemon=True)
    runner.start()
    launches_waiting(lib, 2)
    t0 = time.monotonic()
    for e in ranks.engines:
        e.abort("ending a stuck launch")
    took = time.monotonic() - t0
    runner.join(10)
    assert not runner.is_alive(), "the launching threads did not return after the abort"
    assert took < 3.0, took
    for r, e in enumerate(ranks.engines):
        # Rank 0's abort may reach rank 1 before the test aborts it: the simulated peer closed
        # the link, and rank 1's poll fails the group with that remote error (then aborts).
        assert isinstance(e.failure, NcclAbortedError) or (r > 0 and "[peer rank 0]" in str(e.failure)), e.failure
        with pytest.raises(NcclGroupError):
            works[r].wait()
        calls = calls_once_ended(ranks.comm(r))
        assert "ncclCommAbort" in calls and "ncclCommRevoke" not in calls, calls
        if blocking:     # the held call was woken by the flag (a nonblocking one may see it too,
            assert ranks.comm(r).flag.is_set()   # when abort met a poll holding the comm's lock)
    ranks.close()


def test_an_async_error_during_a_launch_fails_the_group_and_its_futures(no_breach):
    """Defect 4: NCCL reports an error while the engine waits for it to take a launch: the
    group fails, the comm is aborted and the op's future completes with the error."""
    lib = SimNccl(launch_polls=10 ** 6)
    ranks = Ranks(2, lib=lib)

    def body(r, e):
        e.allreduce([torch.ones(1)])           # waits (polling) for NCCL to take it
        return e
    runner = threading.Thread(target=lambda: ranks.run(body), daemon=True)
    runner.start()
    launches_waiting(lib, 2)
    for c in lib.comms.values():
        c.fail(REMOTE_ERROR, "peer 1 reset the connection")
    runner.join(10)
    assert not runner.is_alive()
    for r, e in enumerate(ranks.engines):
        assert isinstance(e.failure, NcclGroupError)
        assert "remote process exited or there was a network error" in str(e.failure)
        assert "ncclCommAbort" in [c for _, c in ranks.comm(r).calls]
    ranks.close()


def test_settle_polls_and_yields_without_sleeping(monkeypatch):
    """Defect 6: a launch that NCCL takes after k polls costs k polls and k sched_yields, no
    sleep (a 2 ms sleep per poll cost every small op 2 ms); only a long wait backs off."""
    sleeps, yields = [], []
    monkeypatch.setattr(nccl_comm.time, "sleep", sleeps.append)
    monkeypatch.setattr(nccl_comm.os, "sched_yield", lambda: yields.append(1))

    class Lib:
        def __init__(self, k):
            self.left = k

        def async_error(self, handle):
            self.left -= 1
            return nccl_lib.IN_PROGRESS if self.left >= 0 else nccl_lib.SUCCESS

    for k in (0, 1, 37, nccl_comm.SPIN_POLLS):
        sleeps.clear(), yields.clear()
        assert nccl_comm.Communicator(Lib(k), "test").settle(60.0) == nccl_lib.SUCCESS
        assert (len(yields), sleeps) == (k, [])
    sleeps.clear(), yields.clear()
    k = nccl_comm.SPIN_POLLS + 40
    assert nccl_comm.Communicator(Lib(k), "test").settle(60.0) == nccl_lib.SUCCESS
    assert len(yields) == k and len(sleeps) == 40 and max(sleeps) <= nccl_comm.MAX_BACKOFF_S


def test_ranks_binding_at_once_get_the_one_table_of_callbacks():
    """The simulated library's callbacks are the functions every engine's native launch calls:
    ranks that bind at once must all get the same ones, kept alive by the library.  A second table
    made by a racing rank was dropped with its callbacks while that rank's engine called them
    (a segfault in a formation)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)          # threads switch inside the table's making, as under load
    try:
        _bind_at_once()
    finally:
        sys.setswitchinterval(interval)


def _bind_at_once() -> None:
    for _ in range(20):
        lib = SimNccl()
        start = threading.Barrier(8)
        got: list = []

        def bind():
            start.wait(10)
            got.append(lib.addresses())
        threads = [threading.Thread(target=bind, daemon=True) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(got) == 8 and all(a == got[0] for a in got), "ranks bound to different callbacks"


def test_shutdown_racing_a_failure_ends_the_comm_once(no_breach):
    """Defect 9: a watchdog failure (abort) racing the application's shutdown (destroy) ends
    the comm exactly once: the library calls a second end a use after free."""
    for _ in range(12):
        ranks = Ranks(2)
        ranks.run(lambda r, e: e.allreduce([torch.ones(1)]).wait())
        start = threading.Barrier(4)

        def fail(e):
            start.wait(10)
            e._fail(e._err(NcclGroupError, "op", "asynchronous error (the test's)"))

        def shut(e):
            start.wait(10)
            e.shutdown(5.0)
        threads = [threading.Thread(target=f, args=(e,), daemon=True) for e in ranks.engines for f in (fail, shut)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads)
        for r in range(2):
            ends = [c for _, c in ranks.comm(r).calls if c in ("ncclCommAbort", "ncclCommDestroy")]
            assert len(ends) == 1, ends


def test_a_refused_dtype_inside_a_coalesced_group_launches_none_of_it(no_breach):
    """Defect 13: the data type is checked at the call, so a refused op launches nothing
    (not the part of the group before it: peers would wait for the rest), and the group
    goes on."""
    ranks = Ranks(2)

    def body(r, e):
        e.allreduce([torch.ones(1)]).wait()
        before = list(ranks.comm(r).groups)
        e.start_coalescing()
        first = e.send([torch.ones(2)], 1 - r)
        with pytest.raises(HpctArgumentError, match="NCCL has no data type for torch.int16"):
            e.send([torch.ones(2, dtype=torch.int16)], 1 - r)
        assert "not launched" in str(first.exception())
        assert ranks.comm(r).groups == before
        t = torch.full((2,), r + 1.0)
        e.allreduce([t]).wait()
        return t.tolist()
    assert ranks.run(body) == [[3.0, 3.0]] * 2
    ranks.close()


def test_kept_tensors_outlive_the_abort_that_ends_their_kernel(no_breach):
    """Defect 13: an aborted op's kernel may write its buffers until the abort has ended it,
    so the staging buffer lives until then even when the caller dropped everything."""
    lib = SimNccl(hang_op=True)
    ranks = Ranks(2, lib=lib)
    refs, alive_in_abort = {}, {}
    lib.on_abort.append(lambda comm: alive_in_abort.setdefault(comm.rank, refs[comm.rank]() is not None))

    def body(r, e):
        # The list form stacks its inputs into a buffer only the op holds: the kernel reads it.
        w = e.reduce_scatter(torch.empty(2), [torch.ones(2), torch.ones(2)], R.SUM)
        refs[r] = weakref.ref(next(t for t in w._keep if t.shape == (2, 2)))
        del w
        gc.collect()
        return refs[r]() is not None
    assert ranks.run(body) == [True, True]
    for e in ranks.engines:
        e.abort("the test aborts it")
    assert alive_in_abort == {0: True, 1: True}
    drain()
    ranks.close()
    gc.collect()
    assert [refs[r]() for r in range(2)] == [None, None], "kept after the kernel ended"


def test_a_dropped_failed_op_keeps_its_tensors_until_its_kernel_ends_after_the_abort(no_breach):
    """Defect 13 with futures made on demand: nobody asked this op for a future and the caller
    dropped its Work, so only the completer holds it -- until the kernel, which the abort ends
    a little later (here: when the test opens the gate), has ended.  Freed at the abort, the
    buffer could be handed to another tensor while the kernel still writes it."""
    lib = SimNccl(hang_op=True, gate_kernels=True)
    ranks = Ranks(2, lib=lib)
    refs = {}

    def body(r, e):
        w = e.reduce_scatter(torch.empty(2), [torch.ones(2), torch.ones(2)], R.SUM)
        refs[r] = weakref.ref(next(t for t in w._keep if t.shape == (2, 2)))
        assert w._raw is None
        del w
        return True
    assert ranks.run(body) == [True, True]
    for e in ranks.engines:
        e.abort("the test aborts it")
    gc.collect()
    assert [refs[r]() is not None for r in range(2)] == [True, True], "freed while its kernel still ran"
    lib.kernel_gate.set()
    end = time.monotonic() + 10
    while any(refs[r]() is not None for r in range(2)) and time.monotonic() < end:
        time.sleep(0.02)
        gc.collect()
    assert [refs[r]() for r in range(2)] == [None, None], "kept after the kernel ended"
    ranks.close()


def test_a_plain_collective_never_reaches_the_completer_and_its_buffers_go_after_its_kernel(ranks3):
    """A collective whose future nobody asks for costs no future and no completer step (that
    was ~40 us of host time per small op on an H200 host); the watchdog's look drops its
    staging buffer once its event has completed."""
    def body(r, e):
        out = strided(2, 2, fill=r + 1.0)          # non-contiguous: staged through a buffer only the op holds
        w = e.allreduce([out])
        staging = weakref.ref(next(t for t in w._keep if t is not out))
        w.wait()
        assert w._raw is None and e._watchers.queued == 0
        del w
        end = time.monotonic() + 5
        while staging() is not None and time.monotonic() < end:
            time.sleep(0.02)
            gc.collect()
        return staging() is None, out.tolist()
    assert ranks3.run(body) == [(True, [[6.0, 6.0], [6.0, 6.0]])] * 3


def test_a_future_asked_for_before_or_after_its_kernel_ended_completes_with_the_result(ranks3):
    def body(r, e):
        a = torch.full((2,), r + 1.0)
        early = e.allreduce([a]).get_future()      # the completer settles it when the kernel ends
        late_work = e.allreduce([torch.ones(2)])
        end = time.monotonic() + 5
        while not late_work.is_completed() and time.monotonic() < end:
            time.sleep(0.005)
        late = late_work.get_future()              # the kernel has ended: settled at once
        assert late.done()
        return wait_done(early).value()[0].tolist(), late.value()[0].tolist()
    assert ranks3.run(body) == [([6.0, 6.0], [3.0, 3.0])] * 3


def test_ops_launched_into_a_graph_capture_are_never_polled(no_breach):
    """Defect 13: querying or waiting for an event of a capture breaks the capture: captured
    work is completed at launch (as ProcessGroupNCCL does) and the watchdog and the completer
    leave it alone."""
    ranks = Ranks(2)
    together = threading.Barrier(2)             # the ranks (threads here) capture together

    def body(r, e):
        e.allreduce([torch.ones(1)]).wait()
        together.wait(10)
        with capture():
            w = e.allreduce([torch.ones(2)])
            together.wait(10)
        together.wait(10)
        assert w.get_future().done()
        time.sleep(0.3)                       # watchdog ticks and the completer run meanwhile
        w.wait()
        return True
    assert ranks.run(body) == [True, True]
    ranks.lib.release_graphs()                # the graph is destroyed: NCCL may free the comm
    ranks.close()


@pytest.mark.parametrize("blocking", [False, True], ids=["nonblocking", "blocking"])
def test_forming_a_comm_may_take_the_op_timeout_after_the_connect_deadline(no_breach, blocking):
    """Defect 13: the connect deadline bounds the rootless ring; transport set-up after it
    (long at scale) is bounded by the op timeout, not by one more second."""
    ranks = Ranks(2, lib=SimNccl(init_delay=1.6), connect_timeout=0.4, op_timeout=10.0, blocking=blocking)

    def body(r, e):
        t = torch.ones(2)
        e.allreduce([t]).wait()
        return t.tolist()
    assert ranks.run(body) == [[2.0, 2.0]] * 2
    ranks.close()


# ---------------------------------------------------------------- a blocking communicator
def test_a_blocking_launch_that_nccl_holds_is_ended_by_the_watchdog_at_the_op_timeout(no_breach):
    """A blocking ncclGroupEnd that NCCL holds (a lazy connect to a peer that never answers) is
    not settled by anyone's poll: the watchdog sees the launch older than the op timeout, fails
    the group with the reason and aborts the comm, which ends the call."""
    lib = SimNccl(stuck_launch=True)
    ranks = Ranks(2, lib=lib, op_timeout=1.0, blocking=True)

    def body(r, e):
        t0 = time.monotonic()
        w = e.allreduce([torch.ones(1)])
        with pytest.raises(NcclGroupError) as info:
            w.wait()
        return time.monotonic() - t0, str(info.value), type(e.failure).__name__
    out = ranks.run(body, timeout=30)
    for took, text, failure in out:
        assert failure == "NcclOpTimeoutError", out
        assert "NCCL did not take the launch within the op timeout (1 s)" in text, text
        assert took < 1.0 + 2.0, took
    for r in range(2):
        calls = calls_once_ended(ranks.comm(r))
        assert "ncclCommAbort" in calls and "ncclCommRevoke" not in calls, calls
    ranks.close()


def test_a_blocking_init_past_its_deadline_is_ended_through_the_flag_and_its_comm_aborted(no_breach):
    """The blocking init runs on a helper thread; its transport set-up outlasts the caller's bound
    (connect deadline + op timeout).  The caller raises the comm's abort flag (NCCL filled the
    handle in before the init ran), the init returns, and the comm is aborted under its lock,
    long before the set-up would have ended on its own (never leaked, never used).  Before: the
    caller gave up at the bound and the comm stayed inside NCCL until the set-up ended."""
    lib = SimNccl(init_delay=30.0)
    ranks = Ranks(2, lib=lib, connect_timeout=0.5, op_timeout=0.5, blocking=True)

    def body(r, e):
        t0 = time.monotonic()
        with pytest.raises(NcclGroupError) as info:
            e.allreduce([torch.ones(1)]).wait()
        return time.monotonic() - t0, str(info.value)
    out = ranks.run(body, timeout=30)
    for took, text in out:
        assert "communicator creation" in text and \
            "not formed within 1 s; the init was ended through the abort flag" in text, text
        assert 0.9 < took < 3.0, took
    assert all(c.flag.is_set() for c in lib.comms.values())
    end = time.monotonic() + 10
    while any(c.ended != "aborted" for c in lib.comms.values()) and time.monotonic() < end:
        time.sleep(0.05)
    assert sorted(c.ended for c in lib.comms.values()) == ["aborted", "aborted"]
    ranks.close()


def test_a_blocking_init_with_a_missing_peer_fails_with_the_ring_deadline(no_breach):
    """Rank 1 never starts: NCCL's own ring deadline ends the blocking init, and its error
    reaches the caller as the group's connect error (not a hang, not a helper's traceback)."""
    ranks = Ranks(2, connect_timeout=0.5, op_timeout=5.0, blocking=True)

    def body(r, e):
        with pytest.raises(NcclGroupError) as info:
            e.allreduce([torch.ones(1)]).wait()
        return type(info.value).__name__, str(info.value)
    [(name, text)] = ranks.run(body, timeout=30, ranks=[0])
    assert name == "NcclConnectError" and "communicator creation" in text and "rootless init" in text, text
    ranks.close()
