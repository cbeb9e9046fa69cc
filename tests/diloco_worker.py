"""One rank of tests/test_diloco.py: DiLoCo on a small regression model, facts to OUT/diloco-<rank>.json.

    python diloco_worker.py OUT_DIR SCENARIO

Every rank trains its own replica on its own shard of one synthetic regression task (seeded), so
the replicas drift apart between syncs.  After every completed sync the rank records the bytes of
its global parameters and of its live parameters, so the test can compare them across ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import hpct.distributed as hd
from hpct.distributed.training.diloco import DiLoCo

out, scenario = Path(sys.argv[1]), sys.argv[2]
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
SCENARIOS = {   # name: (DiLoCo keyword arguments, inner steps)
    "plain": (dict(sync_every=5), 20),
    "average": (dict(sync_every=5, outer_lr=1.0, outer_momentum=0.0), 10),
    "fp16": (dict(sync_every=5, quantize="fp16"), 20),
    "int8": (dict(sync_every=5, quantize="int8"), 20),
    "streaming": (dict(sync_every=6, fragments=3, overlap=True, quantize="int8"), 36),
}
kwargs, steps = SCENARIOS[scenario]
hd.init_process_group(timeout=60.0)
torch.manual_seed(0)                                    # the same initial model everywhere
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
g = torch.Generator().manual_seed(100 + rank)           # each rank its own data
w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
diloco = DiLoCo(model, **kwargs)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def local() -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def global_params() -> torch.Tensor:
    return torch.cat([f.global_flat for f in diloco.fragments])


records, losses = [], []
for step in range(steps):
    x = torch.randn(64, 16, generator=g)
    y = x @ w_true + 0.01 * torch.randn(64, 1, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    inner.zero_grad()
    loss.backward()
    inner.step()
    losses.append(loss.item())
    before = local().clone()
    done = diloco.step()
    if done:
        rec = {"step": step, "done": done, "global": digest(global_params()), "local": digest(local()),
               "local_is_global": bool(torch.equal(local(), global_params()))}
        if scenario == "average":
            # outer_lr 1, no momentum: the new parameters are the mean of the replicas' parameters.
            gathered = [torch.empty_like(before) for _ in range(n)]
            dist.all_gather(gathered, before)
            mean = torch.stack(gathered).mean(0)
            rec["max_err_vs_mean"] = float((local() - mean).abs().max())
        records.append(rec)
diloco.finish()
(out / f"diloco-{rank}.json").write_text(json.dumps({
    "records": records, "syncs": diloco.stats.syncs, "payload_bytes": diloco.stats.payload_bytes,
    "numel": sum(p.numel() for p in model.parameters()), "first_loss": sum(losses[:5]) / 5,
    "last_loss": sum(losses[-5:]) / 5, "final_global": digest(global_params())}))
hd.shutdown_all()
