#!/usr/bin/env python3
"""profile_comm's cost and accuracy on a small DDP job: 2 processes, stock gloo, CPU, loopback.

Every rank trains one seeded MLP per mode, all over the same process group; each of the
``--rounds`` x ``--steps`` steps runs every mode once, in a fresh random order, so machine
noise falls on all alike:

* ``plain``: DDP with its built-in allreduce; the baseline;
* ``off``: ``profile_comm(model, enabled=False)``: nothing is registered;
* ``hook``: DDP with torch's Python ``allreduce_hook`` registered directly;
* ``on``: ``profile_comm(model)``: the same hook, wrapped and timed;
* ``disabled``: ``profile_comm(model)`` then ``disable()``: the wrapper as a plain call-through.

The step time is forward + backward + ``optimizer.step()``, median per mode (mean of the
two ranks).  Accuracy: the profile's communication time per step (union of the buckets'
[hook called, future done]) against the same bucket sizes all_reduced directly, back to back.

    python benchmarks/profile_comm.py [--rounds 8] [--steps 10] [--width 512] [--layers 8]
                                      [--bucket-mb 1] [--timeout 110]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("plain", "off", "hook", "on", "disabled")

WORKER = r"""
import datetime, json, random, statistics, sys, time
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from hpct.distributed.diagnostics.profile_comm import profile_comm

rank, size, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = json.loads(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(path, size), rank=rank, world_size=size,
                        timeout=datetime.timedelta(seconds=60))
W = cfg["width"]

def make():
    torch.manual_seed(0)
    layers = []
    for _ in range(cfg["layers"]):
        layers += [torch.nn.Linear(W, W), torch.nn.ReLU()]
    return DDP(torch.nn.Sequential(*layers), bucket_cap_mb=cfg["bucket_mb"])

models, profs = {}, {}
for mode in cfg["modes"]:
    m = make()
    if mode == "hook":
        m.register_comm_hook(None, allreduce_hook)
    elif mode in ("on", "disabled", "off"):
        profs[mode] = profile_comm(m, enabled=(mode != "off"))
        if mode == "disabled":
            profs[mode].disable()
    models[mode] = (m, torch.optim.SGD(m.parameters(), lr=1e-3))

g = torch.Generator().manual_seed(rank)
x, y = torch.randn(cfg["batch"], W, generator=g), torch.randn(cfg["batch"], W, generator=g)
times = {m: [] for m in models}

def step(mode):
    m, opt = models[mode]
    t0 = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.mse_loss(m(x), y).backward()
    opt.step()
    return time.perf_counter() - t0

for mode in models:  # warm-up: DDP rebuilds its buckets after the first step
    for _ in range(3):
        step(mode)
profs["on"].reset()
order = random.Random(0)  # the same on every rank: collectives must match
for r in range(cfg["rounds"] * cfg["steps"]):
    for mode in order.sample(cfg["modes"], len(cfg["modes"])):
        times[mode].append(step(mode))

rep = profs["on"].report()
comm = statistics.median(s["comm_s"] for s in rep["steps"])
exposed = statistics.median(s["exposed_s"] for s in rep["steps"])
sizes = [b["bytes"] for b in sorted(rep["steps"][-1]["buckets"], key=lambda b: b["index"])]
bufs = [torch.randn(n // 4) for n in sizes]
direct = []
for _ in range(cfg["rounds"] * cfg["steps"]):
    dist.barrier()
    t0 = time.perf_counter()
    works = [dist.all_reduce(b, async_op=True) for b in bufs]
    for w in works:
        w.wait()
    direct.append(time.perf_counter() - t0)
print(json.dumps({"rank": rank, "step": {m: statistics.median(v) for m, v in times.items()},
                  "comm": comm, "exposed": exposed, "direct": statistics.median(direct),
                  "sizes": sizes, "text": profs["on"].summary_text()}), flush=True)
dist.destroy_process_group()
"""


def run(cfg: dict, timeout: float, scratch: str) -> list[dict]:
    path = os.path.join(scratch, f"store-{time.monotonic_ns()}")
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), "2", path, json.dumps(cfg)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/", env=env)
             for r in range(2)]
    from hpct.demo.agent import rank_results
    return rank_results(procs, time.monotonic() + timeout, "profile_comm benchmark")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="rounds x steps = steps timed per mode")
    ap.add_argument("--steps", type=int, default=10, help="see --rounds")
    ap.add_argument("--width", type=int, default=512, help="width of the square Linear layers")
    ap.add_argument("--layers", type=int, default=8, help="Linear layers in the MLP")
    ap.add_argument("--batch", type=int, default=64, help="samples per step and rank")
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket_cap_mb")
    ap.add_argument("--timeout", type=float, default=110.0, help="seconds for the whole job")
    args = ap.parse_args(argv)
    import torch
    started = time.monotonic()
    cfg = {"modes": list(MODES), "rounds": args.rounds, "steps": args.steps, "width": args.width,
           "layers": args.layers, "batch": args.batch, "bucket_mb": args.bucket_mb}
    with tempfile.TemporaryDirectory(prefix="hpct-profile-comm-") as scratch:
        ranks = run(cfg, args.timeout, scratch)
    step = {m: statistics.fmean(r["step"][m] for r in ranks) for m in MODES}
    comm = statistics.fmean(r["comm"] for r in ranks)
    direct = statistics.fmean(r["direct"] for r in ranks)
    sizes = ranks[0]["sizes"]
    print(f"profile_comm on a DDP step: 2 ranks, stock gloo, loopback; {os.cpu_count()} CPUs; torch {torch.__version__}; "
          f"MLP {args.layers}x{args.width}, batch {args.batch}, {len(sizes)} buckets of "
          f"{min(sizes) / 2**20:.2f}-{max(sizes) / 2**20:.2f} MB; median of {args.rounds * args.steps} steps per mode")
    print(f"{'mode':>9}  {'step [ms]':>10}  {'vs plain':>9}  {'vs hook':>8}")
    for m in MODES:
        print(f"{m:>9}  {step[m] * 1e3:>10.2f}  {step[m] / step['plain'] - 1:>+8.1%}  {step[m] / step['hook'] - 1:>+7.1%}")
    print(ranks[0]["text"])
    print(f"accuracy: profile communication {comm * 1e3:.2f} ms/step, same buckets all_reduced directly "
          f"{direct * 1e3:.2f} ms, ratio {comm / direct:.2f}")
    print(f"summary: profiling overhead {step['on'] / step['hook'] - 1:+.1%} of step time against the same hook "
          f"unprofiled ({step['on'] / step['plain'] - 1:+.1%} against built-in DDP), off {step['off'] / step['plain'] - 1:+.1%}, "
          f"disabled {step['disabled'] / step['hook'] - 1:+.1%}; comm/direct {comm / direct:.2f}; "
          f"total benchmark time {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
