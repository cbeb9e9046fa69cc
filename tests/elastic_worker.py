"""One rank of the shrink tests (tests/test_elastic.py): argv = method out [ckpt].

method "torch" or "hd": 4 ranks refuse bad shrinks, train, rank 1 leaves, the others shrink
the default group with torch.distributed.shrink_group or hd.shrink and train on at world 3,
then shrink a subgroup.  method "ref": a fresh 3-rank world trains from the checkpoint the
shrunk world saved.  Each rank writes res-<rank>.json (and final-<new rank>.pt).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import hpct.distributed as hd

BEFORE, AFTER, LEAVER = 3, 3, 1
method, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
res = {}


def train(model, opt, first, steps):
    me, n = dist.get_rank(), dist.get_world_size()
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * step + me)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= n
        opt.step()


def refused(name, fn):
    try:
        fn()
        res[name] = "no error"
    except Exception as err:
        res[name] = f"{type(err).__name__}: {err}"


def wait_for(path, limit_s=60.0):
    end = time.monotonic() + limit_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {limit_s} s")
        time.sleep(0.01)


def save():
    with open(os.path.join(out, f"res-{rank}.json"), "w") as f:
        json.dump(res, f)


hd.init_process_group(timeout=60)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

if method == "ref":
    state = torch.load(sys.argv[3])
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    train(model, opt, BEFORE, AFTER)
    torch.save(model.state_dict(), os.path.join(out, f"final-{rank}.pt"))
    dist.barrier()
    hd.shutdown_all()
    sys.exit(0)

shrink = (lambda ranks, group=None: dist.shrink_group(ranks, group=group)) if method == "torch" else hd.shrink
# bad input: every rank gets the same refusal, and nothing changes
refused("self", lambda: shrink([rank]))
refused("all", lambda: shrink([0, 1, 2, 3]))
refused("unknown", lambda: shrink([7]))
refused("duplicate", lambda: shrink([2, 2]))
refused("empty", lambda: shrink([]))
t = torch.ones(1)
dist.all_reduce(t)
res["after_bad"] = [t.item(), dist.get_world_size(), dist.get_rank(), hd.generation()]

other = dist.new_group([0, 2, 3])
train(model, opt, 0, BEFORE)
if rank == LEAVER:
    # Leaves without a word, but stays alive holding its listening ports until the others are
    # done: a survivor that listened on its NEW rank's address (not its plan address) would
    # collide with it.
    save()
    done = os.path.join(out, "done")
    end = time.monotonic() + 60
    while not os.path.exists(done) and time.monotonic() < end:
        time.sleep(0.05)
    os._exit(0)

# The shrink aborts the old group, which resets its connections at once. A leaver still
# reading its last all_reduce (the others may finish theirs first: their small messages go out
# without waiting for its ready word) would fail on that reset; this test is about the
# survivors, so they shrink once the leaver is through, as a job that scales down would.
wait_for(os.path.join(out, f"res-{LEAVER}.json"))
t0 = time.perf_counter()
world = shrink([LEAVER])
res["shrink_s"] = time.perf_counter() - t0
res["world"] = [world is dist.group.WORLD, dist.get_rank(), dist.get_world_size(), hd.generation()]
res["other_destroyed"] = other not in c10d._world.pg_map
res["live_groups"] = len(hd.live_groups())
refused("other_used", lambda: dist.all_reduce(torch.ones(1), group=other))
me = dist.get_rank()
if me == 0:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, os.path.join(out, "ckpt.pt"))
train(model, opt, BEFORE, AFTER)
torch.save(model.state_dict(), os.path.join(out, f"final-{me}.pt"))

# a subgroup made after the shrink, then shrunk itself: new rank 0 (old 0) leaves it
sub = dist.new_group([0, 1, 2])
t = torch.ones(1)
dist.all_reduce(t, group=sub)
res["sub_before"] = t.item()
if me == 0:
    open(os.path.join(out, "sub-done"), "w").close()
else:
    wait_for(os.path.join(out, "sub-done"))   # as before the first shrink
    gen = sub.generation
    sub2 = shrink([0], group=sub)
    t = torch.tensor([float(me)])
    dist.all_reduce(t, group=sub2)
    res["sub_after"] = [t.item(), sub2.size(), sub2.rank(), sub2.generation - gen,
                        dist.get_process_group_ranks(sub2)]
dist.barrier()
save()
if me == 0:
    open(os.path.join(out, "done"), "w").close()
hd.shutdown_all()
