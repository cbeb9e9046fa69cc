"""One rank of the sync_state tests (tests/test_parity.py): argv = out.  4 ranks."""

import json
import os
import sys

import torch
import torch.distributed as dist

import hpct.distributed as hd
from hpct.distributed.training.parity import digest, named_state

out = sys.argv[1]
rank = int(os.environ["RANK"])
res = {}
hd.init_process_group(timeout=60)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
model(torch.randn(4, 8)).sum().backward()
opt.step()


def digests():
    return [digest(t) for _, t in named_state(model, opt)]


def everyone_equal():
    mine = torch.tensor(digests(), dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(4)]
    dist.all_gather(rows, mine)
    return all(torch.equal(rows[0], r) for r in rows)


res["healthy"] = str(hd.sync_state(model, opt))
# drift: one weight element on rank 2, an Adam moment on rank 3
with torch.no_grad():
    if rank == 2:
        model[0].weight[3, 1] += 1e-6
    if rank == 3:
        opt.state[model[2].weight]["exp_avg"].mul_(2)
res["equal_before"] = everyone_equal()
weight_ref = model[0].weight                       # repaired in place: references stay valid
report = hd.sync_state(model, opt)
res["moves"] = [[m.name, m.nbytes, m.src, m.dst] for m in report.moves]
res["report"] = str(report)
res["equal_after"] = everyone_equal() and weight_ref is model[0].weight
res["again"] = [m.name for m in hd.sync_state(model, opt).moves]

# no majority: two versions of the last bias, two members each
with torch.no_grad():
    model[2].bias.add_(1.0 if rank < 2 else 2.0)
before = digests()
try:
    hd.sync_state(model, opt)
    res["split"] = "no error"
except hd.ParityError as err:
    res["split"] = str(err)
res["split_unchanged"] = digests() == before
with torch.no_grad():
    model[2].bias.sub_(1.0 if rank < 2 else 2.0)

# different tensors: rank 1 has an extra buffer
if rank == 1:
    model.register_buffer("extra", torch.zeros(3))
try:
    hd.sync_state(model)
    res["manifest"] = "no error"
except hd.ParityError as err:
    res["manifest"] = str(err)
with open(os.path.join(out, f"res-{rank}.json"), "w") as f:
    json.dump(res, f)
dist.barrier()
hd.shutdown_all()
