"""One rank of tests/gpu's speed modes (issue 39): a DDP step, and where a GPU recovery's time goes.

GPU_PROOF_MODE:
- ``ddpstep`` (DDP_STACK=stock|hpct): a transformer encoder of about 25 M parameters (an
  embedding, 4 layers of width 640, a head) under DDP with its default 25 MB buckets, AdamW,
  batch 8 x 128 tokens; 10 warm-up steps, then STEPS steps each ended by a device sync (the
  median is the table's number) and STEPS more without a sync between them (their mean); the
  parameters' digest shows both stacks trained alike.
- ``recovery``: start-up, then three in-process recoveries of each stack, each split into its
  phases: hpct's abort, engine shutdown, the new communicator's formation, the first op; stock's
  destroy, init (a new TCPStore), the first op.  NCCL's own "Init timings" lines (NCCL_DEBUG=INFO,
  set by the test for this mode) split the formation further.
"""

import datetime
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proof_settings as ps  # noqa: E402

rank, n, dev, mode = ps.start_rank()
STEPS = int(os.environ.get("DDP_STEPS", "40"))


def sync_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


if mode == "ddpstep":
    stack = os.environ["DDP_STACK"]
    if stack == "stock":
        dist.init_process_group("nccl", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=60),
                                device_id=dev)
    else:
        import hpct.distributed as hd
        hd.init_process_group(timeout=60.0)
    if stack == "hpct-launch":
        # A measurement, not a mode of hpct: futures completed at launch, CUDA-aware, as
        # ProcessGroupNCCL's (DDP's finalize then makes the stream wait instead of the host).
        # The difference to "hpct" is what DDP's guarantee costs: no step on a gradient that a
        # lost peer never finished reducing needs the host to know the reduction ended.
        from hpct.distributed.nccl.work import NcclWork

        def launch_future(self):
            if self._fut is None:
                self._fut = torch.futures.Future(devices=[self.device])
                with torch.cuda.stream(self._engine._stream):
                    self._fut.set_result(self._result)
            return self._fut
        NcclWork.get_future = launch_future
    # Both stacks must train alike to the bit: math attention (the fused kernels' backward adds
    # with atomics), deterministic algorithms (CUBLAS_WORKSPACE_CONFIG comes from the test).
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    vocab, width, seq, batch = 8192, 640, 128, 8

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, width)
            layer = torch.nn.TransformerEncoderLayer(width, 10, 4 * width, dropout=0.0, batch_first=True)
            self.enc = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
            self.head = torch.nn.Linear(width, vocab)

        def forward(self, ids):
            return self.head(self.enc(self.emb(ids)))
    model = Net().to(dev)
    params = sum(p.numel() for p in model.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(100 + rank)
    data = [torch.randint(0, vocab, (batch, seq + 1), generator=g).to(dev) for _ in range(8)]

    def step(i):
        ids = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
    for i in range(10):
        step(i)
    synced = [sync_ms(lambda i=i: step(i)) for i in range(STEPS)]
    free = sync_ms(lambda: [step(i) for i in range(STEPS)]) / STEPS
    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
    buckets = len(getattr(ddp.reducer, "_get_zeros_like_grad_buckets", lambda: [])())
    if rank == 0:
        print(f"DDPSTEP n={n} stack={stack} params={params} buckets={buckets or '?'} "
              f"median_ms={statistics.median(synced):.3f} p90_ms={sorted(synced)[int(0.9 * STEPS)]:.3f} "
              f"unsynced_mean_ms={free:.3f} digest={digest[:16]}", flush=True)
    dist.destroy_process_group()
elif mode == "recovery":
    from hpct.config import Config
    try:
        from hpct.distributed.nccl.plan import engine_for_group
    except ImportError:    # a wheel from before the engine became a package (the session-start proof)
        from hpct.distributed.nccl_engine import engine_for_group
    ports = os.environ["MASTER_PORTS"].split(",")
    tiny = torch.ones(1, device=dev)
    t0 = time.perf_counter()
    dist.init_process_group("nccl", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=60), device_id=dev)
    dist.all_reduce(tiny)
    torch.cuda.synchronize()
    stock_start = time.perf_counter() - t0
    cfg = Config.from_mapping({k: v for k, v in os.environ.items()
                               if k in ("N_PROC_PER_NODE", "HPCT_PORT_BASE", "LOCAL_WORLD_SIZE")})

    def engine(gen):
        return engine_for_group(cfg, name="0", index=0, slot=0, group_rank=rank, global_ranks=list(range(n)),
                                generation=gen, op_timeout=60.0)
    t0 = time.perf_counter()
    eng = engine(0)
    eng.allreduce([tiny]).wait()
    torch.cuda.synchronize()
    hpct_start = time.perf_counter() - t0
    rows: dict[str, list[float]] = {}

    def add(name, seconds):
        rows.setdefault(name, []).append(seconds * 1e3)
    for k in range(3):
        dist.barrier()                                 # every rank starts the recovery together
        torch.cuda.synchronize()
        a = time.perf_counter()
        eng.abort("recovery timing")
        b = time.perf_counter()
        eng.shutdown(10.0)
        c = time.perf_counter()
        eng = engine(k + 1)
        eng._ensure_stream(dev)
        with eng._launch_lock:
            eng._ensure_comm()                         # the rootless ring, the topology, the rest of init
        d = time.perf_counter()
        eng.allreduce([tiny]).wait()                   # the first op connects its channels (runtime connect)
        torch.cuda.synchronize()
        e = time.perf_counter()
        add("hpct abort", b - a)
        add("hpct shutdown of the aborted engine", c - b)
        add("hpct communicator formed (ncclCommInitRankRootless)", d - c)
        add("hpct first op (channel connect + kernel)", e - d)
        add("hpct recovery to the first op", e - a)
        a = time.perf_counter()
        dist.destroy_process_group()
        b = time.perf_counter()
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{ports[k]}", rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=60), device_id=dev)
        c = time.perf_counter()
        dist.all_reduce(tiny)
        torch.cuda.synchronize()
        d = time.perf_counter()
        add("stock destroy_process_group", b - a)
        add("stock init_process_group (new TCPStore)", c - b)
        add("stock first op", d - c)
        add("stock recovery to the first op", d - a)
    if rank == 0:
        out = [f"RECOVERY n={n}  {'phase (ms; median of 3, then each)':56s} {'median':>9s}  each"]
        out.append(f"RECOVERY n={n}  {'start-up to the first op, stock / hpct':56s} "
                   f"{stock_start * 1e3:9.1f}  {hpct_start * 1e3:.1f}")
        for name, v in rows.items():
            out.append(f"RECOVERY n={n}  {name:56s} {statistics.median(v):9.1f}  "
                       + " ".join(f"{x:.1f}" for x in v))
        ratio = statistics.median(rows["hpct recovery to the first op"]) / statistics.median(
            rows["stock recovery to the first op"])
        out.append(f"RECOVERY n={n}  hpct/stock recovery to the first op: {ratio:.3f} (target <= 0.25)")
        print("\n".join(out), flush=True)
    eng.shutdown(10.0)
    dist.destroy_process_group()
os._exit(0)
