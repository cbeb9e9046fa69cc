"""One rank of the many-groups tests (run as a script by tests/test_backend_groups.py).

    python groups_worker.py SCENARIO OUT_DIR

Every hpct group of a process listens on one port (B + local rank; patch 0018).  Each
scenario writes OUT_DIR/<scenario>-<rank>.json.
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

from dist_worker import tcp_sockets     # tests/ is this script's folder

GROUPS = 64


def listening_ports() -> set[int]:
    """Local ports of this process's listening TCP sockets."""
    return {port for port, _, state in tcp_sockets() if state == "LISTEN"}


def many(rank: int, n: int) -> dict:
    """GROUPS live subgroups, each with a correct all_reduce, then all destroyed."""
    t0 = time.perf_counter()
    groups = [dist.new_group(list(range(n))) for _ in range(GROUPS)]
    sums = []
    for i, g in enumerate(groups):
        t = torch.tensor([float(rank + i)])
        dist.all_reduce(t, group=g)
        sums.append(t.item())
    seconds = time.perf_counter() - t0
    ports = sorted(listening_ports())
    keys = sorted(g.group_key for g in groups)
    for g in groups:
        dist.destroy_process_group(g)
    t = torch.ones(1)
    dist.all_reduce(t)                           # the world group is untouched
    return {"sums": sums, "seconds": seconds, "listening": ports, "keys": keys, "world": t.item(),
            "left": len(__import__("hpct.distributed", fromlist=["x"]).live_groups())}


def mesh(rank: int, n: int) -> dict:
    """A 3-D DeviceMesh 2x2x2: an all_reduce and an all_gather on every dimension's group."""
    from torch.distributed.device_mesh import init_device_mesh
    m = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "tp", "pp"))
    out = {}
    for dim in ("dp", "tp", "pp"):
        g = m.get_group(dim)
        members = dist.get_process_group_ranks(g)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g)
        gathered = [torch.zeros(1) for _ in members]
        dist.all_gather(gathered, torch.tensor([float(rank)]), group=g)
        out[dim] = {"members": members, "sum": t.item(), "gathered": [x.item() for x in gathered]}
    out["listening"] = sorted(listening_ports())
    return out


def abort_one(rank: int, n: int) -> dict:
    """Rank 0 aborts group a; group b on the same port keeps working on both ranks."""
    from hpct.errors import CollectiveError
    a = dist.new_group(list(range(n)))
    b = dist.new_group(list(range(n)))
    for g in (a, b):
        t = torch.ones(1)
        dist.all_reduce(t, group=g)
    out = {}
    if rank == 0:
        a.abort("test abort of group a")
    dist.barrier(group=b)                        # rank 1 goes on only after the abort
    try:
        t = torch.ones(1)
        dist.all_reduce(t, group=a)
        out["a"] = f"ok {t.item()}"
    except CollectiveError as err:
        out["a"] = f"{type(err).__name__}: {err}"
    sums = []
    for i in range(3):
        t = torch.tensor([float(rank + i)])
        dist.all_reduce(t, group=b)
        sums.append(t.item())
    out["b"] = sums
    dist.destroy_process_group(a)
    c = dist.new_group(list(range(n)))           # a new group after the abort, same port
    t = torch.ones(1)
    dist.all_reduce(t, group=c)
    out["c"] = t.item()
    out["listening"] = sorted(listening_ports())
    return out


def key_clash(rank: int, n: int) -> dict:
    """A live subgroup, then subgroups created and destroyed until a new one's key repeats."""
    from hpct import _gloo
    from hpct.errors import PortPlanError
    keep = dist.new_group(list(range(n)))
    out = {"keep": keep.group_key}
    for _ in range(_gloo.GROUP_KEYS - 2):
        dist.destroy_process_group(dist.new_group(list(range(n))))
    try:
        dist.new_group(list(range(n)))
        out["clash"] = "created"
    except PortPlanError as err:
        out["clash"] = str(err)
    dist.destroy_process_group(keep)
    g = dist.new_group(list(range(n)))           # the key is free again
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    out["after"] = [g.group_key, t.item()]
    return out


SCENARIOS = {"many": many, "mesh": mesh, "abort_one": abort_one, "key_clash": key_clash}


def main() -> int:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import hpct.distributed as hd
    hd.init_process_group(timeout=datetime.timedelta(seconds=60))
    res = SCENARIOS[scenario](rank, n)
    (out / f"{scenario}-{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    hd.shutdown_all()
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
