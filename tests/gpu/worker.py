"""One rank of tests/gpu: the engine (rootless NCCL through ctypes) against stock ProcessGroupNCCL."""

import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpct.config import Config
from hpct.distributed.nccl.plan import engine_for_group

# -P keeps the script's folder off sys.path; the settings sit beside it.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import proof_settings as ps  # noqa: E402
import verdicts  # noqa: E402

# Both stacks on the one libnccl the harness preloaded (proof_settings.proof_env), pinned alike.
rank, n, dev, mode = ps.start_rank()
R = dist.ReduceOp

# stock reference: TCPStore + root
t0 = time.perf_counter()
dist.init_process_group("nccl", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=60), device_id=dev)
dist.barrier()
torch.cuda.synchronize()
stock_start = time.perf_counter() - t0

cfg = Config.from_mapping({k: v for k, v in os.environ.items()
                           if k in ("N_PROC_PER_NODE", "HPCT_PORT_BASE", "LOCAL_WORLD_SIZE")})
eng = engine_for_group(cfg, name="0", index=0, slot=0, group_rank=rank, global_ranks=list(range(n)),
                       generation=0, op_timeout=60.0)
t0 = time.perf_counter()
eng.barrier().wait()
hpct_start = time.perf_counter() - t0


def same(a, b, what, expected=None):
    """hpct's result ``b`` equals stock's ``a`` bit for bit and, where the exact value is known
    (integer inputs, proof_settings), both equal it: two stacks that both skipped an op agree too."""
    if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
        sys.exit(f"rank {rank}: {what} differs from stock NCCL")
    if expected is not None and not torch.equal(a.cpu(), expected):
        sys.exit(f"rank {rank}: {what}: stock and hpct agree but differ from the exact value")


if mode == "exact":
    NUMEL = 1 << 16
    ops = {"SUM": R.SUM, "MAX": R.MAX, "MIN": R.MIN, "AVG": R.AVG}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        inputs = [ps.proof_input(r, n, dtype, NUMEL) for r in range(n)]     # every rank's, on the CPU
        assert ps.exact_in(inputs, dtype), f"{dtype}: inputs whose sums are not exact"
        x = inputs[rank].to(dev)
        for name, op in ops.items():
            if name == "AVG" and not dtype.is_floating_point:
                continue
            a, b = x.clone(), x.clone()
            dist.all_reduce(a, op=op)
            eng.allreduce([b], op).wait()
            exp = ps.expected_reduce(name, inputs, dtype) if name != "AVG" or ps.avg_is_exact(n) else None
            same(a, b, f"all_reduce {dtype} {name}", exp)
        a, b = x.clone(), x.clone()
        dist.broadcast(a, src=n - 1)
        eng.broadcast([b], n - 1).wait()
        same(a, b, f"broadcast {dtype}", inputs[n - 1])
        outa = torch.empty(n * x.numel(), dtype=dtype, device=dev)
        outb = torch.empty_like(outa)
        dist.all_gather_into_tensor(outa, x)
        eng.all_gather_single(outb, x).wait()
        same(outa, outb, f"all_gather_into_tensor {dtype}", torch.cat(inputs))
        la = [torch.empty_like(x) for _ in range(n)]
        lb = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(la, x)
        eng.allgather([lb], [x]).wait()
        same(torch.stack(la), torch.stack(lb), f"all_gather {dtype}", torch.stack(inputs))
        ra, rb = torch.empty(x.numel() // n, dtype=dtype, device=dev), torch.empty(x.numel() // n, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(ra, x)
        eng.reduce_scatter_single(rb, x, R.SUM).wait()
        same(ra, rb, f"reduce_scatter_tensor {dtype}", ps.chunk(ps.expected_reduce("SUM", inputs, dtype), n, rank))
        aa, ab = torch.empty_like(x), torch.empty_like(x)
        dist.all_to_all_single(aa, x)
        eng.all_to_all_single(ab, x, [], []).wait()
        same(aa, ab, f"all_to_all_single {dtype}", torch.cat([ps.chunk(t, n, rank) for t in inputs]))
        a, b = x.clone(), x.clone()
        dist.reduce(a, dst=0)
        eng.reduce(b, 0, R.SUM).wait()
        if rank == 0:
            same(a, b, f"reduce {dtype}", ps.expected_reduce("SUM", inputs, dtype))
    # point to point as batch_isend_irecv does it: both directions, one NCCL group
    peer_to, peer_from = (rank + 1) % n, (rank - 1) % n
    s = torch.full((1 << 20,), float(rank), device=dev)
    r = torch.empty_like(s)
    ws = [eng.send([s], peer_to), eng.recv([r], peer_from)]
    for w in ws:
        w.wait(datetime.timedelta(seconds=60))
    same(r, torch.full_like(r, float(peer_from)), "send/recv ring")
    eng.barrier().wait()
    print(f"EXACT OK rank {rank} start-up stock {stock_start:.3f}s hpct {hpct_start:.3f}s", flush=True)
elif mode == "bandwidth":
    lines = [f"BUSBW n={n}  size        stock GB/s   hpct GB/s   ratio"]
    size = 1 << 20
    while size <= 256 << 20:
        x = torch.ones(size // 4, device=dev)
        res = []
        for fn in (lambda: dist.all_reduce(x), lambda: eng.allreduce([x], R.SUM).wait()):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            iters = 10
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / iters
            res.append(size / dt * 2 * (n - 1) / n / 1e9)
        lines.append(f"BUSBW {size >> 20:5d} MiB  {res[0]:10.2f}  {res[1]:10.2f}  {res[1] / res[0]:6.2f}")
        size <<= 2
    if rank == 0:
        print("\n".join(lines), flush=True)
elif mode == "timing":
    # One table, same run: start-up (above), in-process recovery and 4 B latency, stock vs hpct.
    # Stock recovery is what a job does without hpct: destroy the group, a new TCPStore on
    # rank 0, init again, first collective.  hpct's: abort the communicator, a new one at the
    # next generation from the plan (no store, no root), first collective.
    def latency(fn, iters=200):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters * 1e6
    tiny = torch.ones(1, device=dev)
    lat = (latency(lambda: dist.all_reduce(tiny)), latency(lambda: eng.allreduce([tiny], R.SUM).wait()))
    t0 = time.perf_counter()
    dist.destroy_process_group()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT_2']}", rank=rank,
                            world_size=n, timeout=datetime.timedelta(seconds=60), device_id=dev)
    dist.all_reduce(tiny)
    torch.cuda.synchronize()
    stock_recover = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.abort("recovery timing")
    eng.shutdown(10.0)
    eng = engine_for_group(cfg, name="0", index=0, slot=0, group_rank=rank, global_ranks=list(range(n)),
                           generation=1, op_timeout=60.0)
    eng.allreduce([tiny], R.SUM).wait()
    torch.cuda.synchronize()
    hpct_recover = time.perf_counter() - t0
    rows = [("start-up to first collective, s", stock_start, hpct_start),
            ("in-process recovery to first collective, s", stock_recover, hpct_recover),
            ("all_reduce 4 B, us per op", *lat)]
    lines = [f"TIMING n={n}  {'what':44s} {'stock':>10s} {'hpct':>10s}  hpct/stock"]
    lines += [f"TIMING n={n}  {w:44s} {a:10.4f} {b:10.4f}  {b / a:8.2f}" for w, a, b in rows]
    lines.append(f"TIMING n={n}  4 B: hpct is {lat[1] - lat[0]:+.1f} us per op against stock (target <= +30)")
    if rank == 0:
        print("\n".join(lines), flush=True)
elif mode == "held":
    # A blocking launch that NCCL holds: the last rank forms the comm, then stops (SIGSTOP: alive and
    # silent), so the others' first collective waits inside ncclGroupEnd for the lazy connect.  The
    # watchdog must fail the group at the op timeout and its abort must end the call.
    import signal
    heng = engine_for_group(cfg, name="6", index=6, slot=6, group_rank=rank, global_ranks=list(range(n)),
                            generation=0, op_timeout=verdicts.HELD_OP_TIMEOUT_S)
    assert heng.blocking_comm, "the default comm is not blocking"
    heng._ensure_stream(dev)
    with heng._launch_lock:
        heng._ensure_comm()              # the ring and the bootstrap; no channel is connected yet
    pids = [None] * n
    dist.all_gather_object(pids, os.getpid())
    if rank == n - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)                      # continued by rank 0 once it is done
    time.sleep(1.0)
    t0 = time.perf_counter()
    m0 = time.monotonic()
    try:
        heng.allreduce([torch.ones(1, device=dev)], R.SUM).wait()
        torch.cuda.synchronize()
        outcome = "completed (unexpected: the peer is stopped)"
    except Exception as err:   # noqa: BLE001 -- reported
        outcome = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    took = time.perf_counter() - t0
    returned = time.monotonic()
    comm = heng._comm
    end = time.monotonic() + 15
    while not comm.freed and time.monotonic() < end:       # the watchdog's abort, after the call returned
        time.sleep(0.01)
    steps = "; ".join(f"{what} at {t - m0:.3f} s" for t, what in comm.trace)
    order = [what for _, what in comm.trace]
    concurrent = any(what == "ncclCommAbort called" and t < returned for t, what in comm.trace)
    os.kill(pids[n - 1], signal.SIGCONT)
    print(f"HELD n={n} rank {rank}: {took:.2f} s: {outcome} | the call returned at {returned - m0:.3f} s; "
          f"{steps} | flag first: {order[:1] == ['abort flag raised']}; abort beside the call: {concurrent}",
          flush=True)
    os._exit(0)
elif mode == "overhead":
    # Where a small op's time goes.  Under MPS (2026-11-26, H200) hpct's 4 B all_reduce took
    # 439 us against stock's 151.  NCCL runs ncclGroupEnd of a non-blocking communicator on a new
    # thread each time (group.cc, "nonblocking group"); torch's comms are blocking, and so are the
    # engine's by default since 2026-11-27.  Same library, same pins, one table: stock, the
    # engine on both kinds of comm, and the bare calls on a non-blocking and on a blocking comm.
    from hpct.distributed.nccl import find as nccl_find, library as nccl_lib
    from hpct.distributed.nccl.plan import job_key, nccl_addresses
    lib = nccl_find.load()
    stream = torch.cuda.Stream(dev)
    sh = stream.cuda_stream
    tiny = torch.ones(1, device=dev)
    F32, SUM = nccl_lib.nccl_dtype(torch.float32), nccl_lib.nccl_op(R.SUM, torch.float32)

    def settle(comm):
        end = time.monotonic() + 60
        while (state := lib.async_error(comm)) == nccl_lib.IN_PROGRESS:
            if time.monotonic() > end:
                sys.exit(f"rank {rank}: a bare comm stayed in progress for 60 s")
            os.sched_yield()
        return state

    def bare_comm(slot, blocking):
        addrs = nccl_addresses(cfg, slot, list(range(n)))
        spec = nccl_lib.RootlessSpec(addrs[rank], addrs[(rank + 1) % n], job_key(cfg, "overhead"), 0, slot, 60000)
        with torch.cuda.stream(stream):
            comm, _ = lib.comm_init_rootless(n, rank, spec, blocking=blocking)
        settle(comm)
        return comm

    def per_op(fn, iters=300):
        for _ in range(30):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters * 1e6, host / iters * 1e6

    nb, bl = bare_comm(3, False), bare_comm(4, True)
    ptr = tiny.data_ptr()

    def nb_op():
        lib.group_start()
        lib.all_reduce(ptr, ptr, 1, F32, SUM, nb, sh)
        if lib.group_end() == nccl_lib.IN_PROGRESS:
            settle(nb)

    def bl_op():
        lib.all_reduce(ptr, ptr, 1, F32, SUM, bl, sh)

    def bl_group_op():
        lib.group_start()
        lib.all_reduce(ptr, ptr, 1, F32, SUM, bl, sh)
        lib.group_end()

    # The engine over a non-blocking comm (HPCT_NCCL_BLOCKING=0; ``eng`` has the default, a
    # blocking one): the difference is NCCL's thread per ncclGroupEnd of a non-blocking comm.
    eng_nb = engine_for_group(cfg, name="5", index=5, slot=5, group_rank=rank, global_ranks=list(range(n)),
                              generation=0, op_timeout=60.0)
    eng_nb.blocking_comm = False
    eng_nb.barrier().wait()

    def with_future():
        w = eng.allreduce([tiny], R.SUM)
        w.get_future()                   # as DDP's reducer: the completer settles it
        w.wait()

    rows = [("stock ProcessGroupNCCL (blocking comm)", per_op(lambda: dist.all_reduce(tiny))),
            ("hpct engine (blocking comm, the default)", per_op(lambda: eng.allreduce([tiny], R.SUM).wait())),
            ("hpct engine, get_future() as DDP", per_op(with_future)),
            ("hpct engine (non-blocking comm)", per_op(lambda: eng_nb.allreduce([tiny], R.SUM).wait())),
            ("bare: group on a non-blocking comm, polled", per_op(nb_op)),
            ("bare: ncclAllReduce on a blocking comm", per_op(bl_op)),
            ("bare: group on a blocking comm", per_op(bl_group_op))]
    lib.abort(nb)
    lib.abort(bl)
    eng_nb.shutdown(10.0)
    lines = [f"OVERHEAD n={n}  {'4 B all_reduce':44s} {'us/op':>9s} {'host us/op':>11s}"]
    lines += [f"OVERHEAD n={n}  {w:44s} {a:9.1f} {b:11.1f}" for w, (a, b) in rows]

    # What the engine's own steps cost on this machine, one at a time (no collective).
    from hpct.distributed.nccl.work import NcclWork

    def each(fn, iters=2000):
        fn()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e6

    ev = torch.cuda.Event()
    ev.record(stream)
    torch.cuda.synchronize()

    def ctx():
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            pass

    def fut_set():
        f = torch.futures.Future(devices=[dev])
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            f.set_result((True, [tiny]))

    steps = [("torch.cuda.Event() + record", lambda: torch.cuda.Event().record(stream)),
             ("stream.wait_stream(current)", lambda: stream.wait_stream(torch.cuda.current_stream(dev))),
             ("with device(dev), stream(s)", ctx),
             ("Future(devices=[dev])", lambda: torch.futures.Future(devices=[dev])),
             ("Future + set_result on the stream", fut_set),
             ("is_current_stream_capturing", torch.cuda.is_current_stream_capturing),
             ("event.query()", ev.query),
             ("current_stream.wait_event", lambda: torch.cuda.current_stream(dev).wait_event(ev)),
             ("NcclWork(...)", lambda: NcclWork(eng, "x", dev, [tiny], keep=[tiny]))]
    lines += [f"OVERHEAD n={n}  step {w:39s} {each(fn):9.1f}" for w, fn in steps]

    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        eng.allreduce([tiny], R.SUM).wait()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    if rank == 0:
        print("\n".join(lines), flush=True)
        print("PROFILE (rank 0, 300 engine all_reduces, main thread)\n" + text.getvalue(), flush=True)
eng.shutdown(10.0)
dist.destroy_process_group()
