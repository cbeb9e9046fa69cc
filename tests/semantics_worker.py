"""One rank of tests/test_backend_semantics.py: hpct cases that once gave wrong answers or were missing.

    python semantics_worker.py OUT_DIR

Started by the local agent (RANK, WORLD_SIZE, HPCT_PORT_BASE, HPCT_PORT_SLOTS from the
environment).  Every case records ("ok", value) or ("ERR", "<type>: <message>") in
OUT_DIR/sem-<rank>.json, with the seconds it took; the test judges the values.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hpct.distributed as hd

out = Path(sys.argv[1])
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
hd.init_process_group(timeout=30)
pg = dist.group.WORLD
res: dict = {}


def case(name, fn):
    t0 = time.monotonic()
    try:
        value = fn()
        res[name] = {"ok": True, "value": value}
    except Exception as err:  # noqa: BLE001 -- recorded for the test
        res[name] = {"ok": False, "value": f"{type(err).__name__}: {err}"}
    res[name]["seconds"] = round(time.monotonic() - t0, 3)
    dist.barrier()


def lst(ts):
    return [t.tolist() for t in ts]


def coalesced_order():
    a = torch.full((2,), float(rank))
    b = torch.arange(3.0) + 10 * rank
    outs = [[torch.zeros(2), torch.zeros(3)] for _ in range(n)]
    dist.all_gather_coalesced(outs, [a, b])
    return [lst(row) for row in outs]


def coalesced_duplicate():
    t = torch.tensor([float(rank + 1)])
    pg.allreduce_coalesced([t, t]).wait()
    return t.tolist()


def allgather_several():
    ins = [torch.tensor([float(2 * rank + i)]) for i in range(2)]
    outs = [[torch.zeros(1) for _ in range(2 * n)] for _ in range(2)]
    pg.allgather(outs, ins).wait()
    return [lst(o) for o in outs]


def gather_several():
    ins = [torch.tensor([1.0]), torch.tensor([2.0])]
    outs = [[torch.zeros(1) for _ in range(n)]] if rank == 0 else []
    opts = dist.GatherOptions()
    opts.rootRank = 0
    pg.gather(outs, ins, opts).wait()
    return "no error"


def broadcast_root_tensor():
    ts = [torch.tensor([10.0 * rank]), torch.tensor([10.0 * rank + 1])]
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 1, 1
    pg.broadcast(ts, opts).wait()
    return lst(ts)


def broadcast_short_form():
    t = torch.tensor([float(rank + 5)])
    pg.broadcast(t, root=1).wait()
    return t.tolist()


def checks():
    got = []
    t1, t2 = torch.zeros(1), torch.zeros(1, dtype=torch.float64)
    for call in (lambda: pg.allreduce([]), lambda: pg.allreduce([t1, t2]),
                 lambda: pg.broadcast([t1], _bopts(-1)), lambda: pg.allgather([[t1] * (n - 1)], [t1])):
        try:
            call()
            got.append("accepted")
        except RuntimeError as err:
            got.append(str(err))
    return got


def _bopts(root):
    o = dist.BroadcastOptions()
    o.rootRank = root
    return o


def premul_sum():
    t = torch.ones(1)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
    return t.tolist()


def inference_gather():
    with torch.inference_mode():
        outs = [torch.zeros(2) for _ in range(n)]
        dist.all_gather(outs, torch.full((2,), float(rank)))
    return lst(outs)


def sparse_sum():
    t = torch.sparse_coo_tensor([[rank]], [float(rank + 1)], size=(n + 1,))
    dist.all_reduce(t)
    return t.to_dense().tolist()


def monitored():
    hd.monitored_barrier(timeout=10)
    return "passed"


def gloo_subgroup():
    dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    return "created"


def many_groups():
    """HPCT_PORT_SLOTS + 2 subgroups in turn, each destroyed, then 2*S alive at once: no cap,
    every group on this process's one port."""
    slots = int(os.environ["HPCT_PORT_SLOTS"])
    seen = []
    for i in range(slots + 2):
        g = dist.new_group(list(range(n)))
        t = torch.ones(1)
        dist.all_reduce(t, group=g)
        seen.append([g.context.peers[rank][1] - int(os.environ["HPCT_PORT_BASE"]), t.item()])
        dist.destroy_process_group(g)
    alive = [dist.new_group(list(range(n))) for _ in range(2 * slots)]
    sums = []
    for g in alive:
        t = torch.ones(1)
        dist.all_reduce(t, group=g)
        sums.append(t.item())
    seen.append(sums)
    seen.append(len({g.group_key for g in alive}))
    for g in alive:
        dist.destroy_process_group(g)
    return seen


def overlapping_subgroups():
    """Members that saw different subgroups still agree on a new group's key."""
    if n < 3:
        return "needs 3 ranks"
    a = dist.new_group([0, 1])
    b = dist.new_group([1, 2])
    c = dist.new_group([0, 2])
    if rank in (0, 1):
        dist.destroy_process_group(a)
    d = dist.new_group([0, 2])                  # ranks 0 and 2 hold different groups
    got = None
    if rank in (0, 2):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=d)
        got = [t.item(), d.group_key]
        dist.destroy_process_group(d)
        dist.destroy_process_group(c)
    if rank in (1, 2):
        dist.destroy_process_group(b)
    return got


def background():
    """An async all_reduce that rank 0 never waits for before it blocks in a recv, which
    rank 1 sends only after its own (blocking) all_reduce: rank 0's op must run on its own.
    Once after an idle spell and once right after another op."""
    got = []
    for idle in (0.2, 0.0):
        time.sleep(idle)
        t = torch.full((3,), float(rank + 1))
        token = torch.zeros(1)
        if rank == 0:
            w = dist.all_reduce(t, async_op=True)
            dist.recv(token, src=1)
            w.wait()
        else:
            dist.all_reduce(t)
            if rank == 1:
                dist.send(torch.full((1,), 7.0), dst=0)
        got.append([t.tolist(), token.item()])
    return got


CASES = {"coalesced_order": coalesced_order, "coalesced_duplicate": coalesced_duplicate,
         "allgather_several": allgather_several, "gather_several": gather_several,
         "broadcast_root_tensor": broadcast_root_tensor, "broadcast_short_form": broadcast_short_form,
         "checks": checks, "premul_sum": premul_sum, "inference_gather": inference_gather,
         "sparse_sum": sparse_sum, "monitored": monitored, "many_groups": many_groups,
         "overlapping_subgroups": overlapping_subgroups, "gloo_subgroup": gloo_subgroup,
         "background": background}

def monitored_missing():
    """Rank n-1 skips the monitored barrier: rank 0 names it, every rank fails promptly."""
    if rank == n - 1:
        time.sleep(4)
        return "skipped"
    hd.monitored_barrier(timeout=1.0, wait_all_ranks=True)
    return "passed"


for name in (os.environ.get("SEM_CASES") or ",".join(CASES)).split(","):
    case(name, CASES[name])
    if not dist.is_initialized() or pg.failure is not None:
        res["stopped_after"] = name
        break
else:       # the group fails in this one: it comes last, with no barrier after it
    t0 = time.monotonic()
    try:
        res["monitored_missing"] = {"ok": True, "value": monitored_missing()}
    except Exception as err:  # noqa: BLE001
        res["monitored_missing"] = {"ok": False, "value": f"{type(err).__name__}: {err}"}
    res["monitored_missing"]["seconds"] = round(time.monotonic() - t0, 3)

(out / f"sem-{rank}.json").write_text(json.dumps(res))
hd.shutdown_all()
