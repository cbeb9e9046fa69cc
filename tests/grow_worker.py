"""One process of tests/test_grow.py: a member of a 2-rank job that grows to 4, or a joiner.

    python grow_worker.py OUT_DIR ROLE      ROLE: member | joiner

Members train STEPS steps at world 2, try the bad grows (each must change nothing), write
OUT/boundary-<rank> and wait for OUT/go, grow to 4 and hand the state over; joiners start
with WORLD_SIZE=4 and HPCT_GENERATION=1 and take it.  Then everyone trains STEPS more steps.
Facts go to OUT/grow-<rank>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hpct.distributed as hd
from util import state_digest     # tests/ is this script's folder

out, role = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
STEPS, BEFORE, AFTER = 5, 2, 4
facts: dict = {"role": role}
torch.manual_seed(0)
model = torch.nn.Linear(8, 1, dtype=torch.float64)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def digest() -> str:
    return state_digest(model, opt)


def train(steps: int, first: int) -> None:
    n = dist.get_world_size()
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x = torch.randn(16, 8, generator=g, dtype=torch.float64)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= n
        opt.step()


if role == "member":
    hd.init_process_group(rank, BEFORE, timeout=30.0)
    train(STEPS, 0)
    for label, call in (("same_size", lambda: hd.grow(BEFORE)),
                        ("no_address", lambda: hd.grow(9))):        # P = 4, one host: places 4.. have no node
        try:
            call()
        except hd.HpctError as err:
            facts[label] = f"{type(err).__name__}: {err}"
    t = torch.ones(1)
    dist.all_reduce(t)                          # nothing changed: the world of 2 still works
    facts["still_two"] = t.item()
    (out / f"boundary-{rank}").write_text("")
    end = time.monotonic() + 60
    while not (out / "go").exists() and time.monotonic() < end:
        time.sleep(0.01)
    t0 = time.monotonic()
    hd.grow(AFTER)
    facts["admit_s"] = time.monotonic() - t0
    src = hd.healthy_source(True)
else:
    t0 = time.monotonic()
    hd.init_process_group(timeout=30.0)
    facts["admit_s"] = time.monotonic() - t0
    src = hd.healthy_source(False)
t0 = time.monotonic()
hd.broadcast_state(model, opt, src=src)
facts["state_s"] = time.monotonic() - t0
facts["state_at_join"] = digest()
t0 = time.monotonic()
train(1, STEPS)                                 # the joiner's first step: admitted to trained
facts["first_step_s"] = time.monotonic() - t0
train(STEPS - 1, STEPS + 1)
facts.update(world=dist.get_world_size(), generation=hd.generation(), final=digest())
(out / f"grow-{rank}.json").write_text(json.dumps(facts))
dist.barrier()
hd.shutdown_all()
