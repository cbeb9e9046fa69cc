"""One rank of tests/gpu's fault-path modes (issue 38): a CUDA graph's capture and replay, a failed init.

GPU_PROOF_MODE:
- ``graph``: five warm-up all_reduces, an all_reduce captured into a CUDA graph right after them
  (torch.cuda.graph, global capture mode), three replays, a barrier through the engine, an eager
  op straight after a replay, then shutdown while the graph is alive (NCCL frees a comm only once
  every graph that captured an op on it is destroyed) and again after ``del graph``.  Every stage
  is timed and bounded: past its bound every thread's stack is printed and the rank exits 3.
- ``initfail``: rank 0 forms a comm whose ring never closes (rank 1 starts late), so its init
  fails at the connect deadline; the comm NCCL left allocated must be aborted, so the new
  generation's comm forms on the same slot (the same fixed port) at once.
Both stacks share the pack's libnccl (proof_settings); the stock group only synchronises ranks.
"""

import datetime
import faulthandler
import gc
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpct.config import Config
try:
    from hpct.distributed.nccl.plan import engine_for_group
except ImportError:        # a wheel from before the engine became a package (the session-start proof)
    from hpct.distributed.nccl_engine import engine_for_group

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proof_settings as ps  # noqa: E402

rank, n, dev, mode = ps.start_rank()
dist.init_process_group("nccl", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=60), device_id=dev)
cfg = Config.from_mapping({k: v for k, v in os.environ.items()
                           if k in ("N_PROC_PER_NODE", "HPCT_PORT_BASE", "LOCAL_WORLD_SIZE")})
lines: list[str] = []


def engine(generation: int, slot: int = 2, connect_timeout: float | None = None):
    e = engine_for_group(cfg, name=str(slot), index=slot, slot=slot, group_rank=rank, global_ranks=list(range(n)),
                         generation=generation, op_timeout=20.0)
    if connect_timeout is not None:
        e.connect_timeout = connect_timeout
    return e


def stage(what: str, bound_s: float, fn):
    """Run ``fn`` under a bound: past it, every thread's stack is printed and the rank exits 3."""
    faulthandler.dump_traceback_later(bound_s, exit=True)
    t0 = time.perf_counter()
    try:
        out = fn()
    finally:
        faulthandler.cancel_dump_traceback_later()
    took = time.perf_counter() - t0
    lines.append(f"{mode.upper()} rank {rank}: {what}: {took:.3f} s" + (f" ({out})" if out else ""))
    print(lines[-1], flush=True)
    return out


if mode == "graph":
    eng = engine(0)
    x = torch.ones(1 << 10, device=dev)

    def warm():
        for _ in range(5):
            eng.allreduce([x]).wait()
    stage("5 warm-up all_reduces", 30, warm)
    g = torch.cuda.CUDAGraph()
    y = torch.ones(1 << 10, device=dev)

    def capture():
        with torch.cuda.graph(g):                  # right after the warm-ups: they may still be in flight
            eng.allreduce([y]).wait()
        with torch.cuda.stream(eng._stream):
            capturing = torch.cuda.is_current_stream_capturing()
        return f"engine stream capturing after: {capturing}"
    stage("capture", 30, capture)

    def replay():
        for _ in range(3):
            y.fill_(1.0)
            g.replay()
        torch.cuda.synchronize()
        ok = bool(torch.equal(y, torch.full_like(y, float(n))))
        if not ok:
            sys.exit(f"rank {rank}: the replayed all_reduce gave {y[:4].tolist()}, want {float(n)}")
        return "result exact"
    stage("3 replays", 30, replay)
    stage("engine barrier after the replays", 20, lambda: eng.barrier().wait())

    def eager():
        y.fill_(1.0)
        g.replay()
        z = torch.ones(4, device=dev)
        eng.allreduce([z]).wait()             # straight after a replay, no host sync between
        torch.cuda.synchronize()
        return f"eager result {z[0].item():g}"
    stage("replay, then an eager all_reduce", 20, eager)
    stage("stock barrier", 20, lambda: dist.barrier())

    def shutdown_with_graph():
        t = threading.Thread(target=eng.shutdown, args=(5.0,), daemon=True)
        t.start()
        t.join(12)
        return f"returned: {not t.is_alive()}; comm: {eng._comm!r}"
    stage("shutdown while the graph lives", 30, shutdown_with_graph)

    def free_graph():
        global g
        del g
        gc.collect()
        comm = eng._comm
        end = time.monotonic() + 10
        while comm is not None and not getattr(comm, 'freed', True) and time.monotonic() < end:
            time.sleep(0.01)
        return f"comm freed after del graph: {comm is None or getattr(comm, 'freed', 'unknown')}"
    stage("del graph", 30, free_graph)
elif mode == "initfail":
    t_fail = 0.0
    if rank == 0:
        first = engine(0, connect_timeout=2.0)

        def fail():
            try:
                first.allreduce([torch.ones(1, device=dev)]).wait()
            except Exception as err:   # noqa: BLE001 -- reported
                return f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            sys.exit("rank 0: the first init formed although rank 1 never started")
        stage("init with rank 1 absent", 30, fail)
        stage("the failed init's comm", 5, lambda: f"{first._comm!r}, freed: {getattr(first._comm, 'freed', 'unknown')}")
        first.shutdown(5.0)
    dist.barrier()                              # rank 1 starts only now
    second = engine(1)                          # recover(): the next generation, the same slot and port

    def reform():
        t = torch.ones(1, device=dev)
        second.allreduce([t]).wait()
        torch.cuda.synchronize()
        if t.item() != n:
            sys.exit(f"rank {rank}: the re-formed comm summed {t.item()}")
        return "re-formed on the same slot and summed exactly"
    stage("recover on the same slot", 40, reform)
    second.shutdown(10.0)
dist.destroy_process_group()
os._exit(0)
