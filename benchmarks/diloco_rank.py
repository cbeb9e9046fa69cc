"""One rank of benchmarks/diloco.py (run inside its network namespace): train, print one JSON line.

    python diloco_rank.py MODE STEPS H      MODE: ddp-gloo | diloco | diloco-fp16 | diloco-int8

ddp-gloo is stock PyTorch (DDP on torch's Gloo, TCPStore on rank 0's host); the DiLoCo modes run on
hpct (no store).  Every mode trains the same model from the same seed on the same per-rank data.
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

mode, steps, h = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)
timeout = datetime.timedelta(seconds=300)
if mode == "ddp-gloo":
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=timeout)
else:
    import hpct.distributed as hd
    hd.init_process_group(timeout=300.0)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
                            torch.nn.Linear(256, 1))
w_true = torch.randn(64, 1, generator=torch.Generator().manual_seed(7)) / 8
g = torch.Generator().manual_seed(100 + rank)
inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
if mode == "ddp-gloo":
    from torch.nn.parallel import DistributedDataParallel
    net, diloco = DistributedDataParallel(model), None
else:
    from hpct.distributed.training.diloco import DiLoCo
    quantize = {"diloco": None, "diloco-fp16": "fp16", "diloco-int8": "int8"}[mode]
    net, diloco = model, DiLoCo(model, sync_every=h, quantize=quantize)
dist.barrier()
t0 = time.perf_counter()
for step in range(steps):
    x = torch.randn(128, 64, generator=g)
    y = torch.sin(x @ w_true)
    loss = torch.nn.functional.mse_loss(net(x), y)
    inner.zero_grad()
    loss.backward()
    inner.step()
    if diloco is not None:
        diloco.step()
if diloco is not None:
    diloco.finish()
dist.barrier()
elapsed = time.perf_counter() - t0
xe = torch.randn(4096, 64, generator=torch.Generator().manual_seed(99))
with torch.no_grad():
    if diloco is not None:          # evaluate the shared (global) model, the same on every rank
        for f in diloco.fragments:
            f.set_local(f.global_flat)
    eval_loss = torch.nn.functional.mse_loss(model(xe), torch.sin(xe @ w_true)).item()
print(json.dumps({"rank": rank, "s_per_step": elapsed / steps, "eval_loss": eval_loss,
                  "params": sum(p.numel() for p in model.parameters())}), flush=True)
dist.destroy_process_group()
