"""One rank of tests/test_reconfigure.py: argv = out store_path.  World 4, started rootlessly.

Handles travel through a FileStore (the out-of-band exchange torch's API leaves to its caller,
as PyTorch's own suite does); hpct itself uses no store.  On torch < 2.14 the group's
reconfigure() is called directly with an object of ReconfigureOptions' shape.  Each step's
outcome goes into res-<rank>.json; the test asserts them.
"""

import datetime
import json
import os
import sys
import threading
import time
import types

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import hpct.distributed as hd

out, store_path = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
store = dist.FileStore(store_path, 4)
res = {"steps": []}


def opts(uuid, handles, timeout_s=30.0):
    make = getattr(c10d, "ReconfigureOptions", None)
    o = make() if make is not None else types.SimpleNamespace()
    o.uuid, o.handles, o.timeout = uuid, handles, datetime.timedelta(seconds=timeout_s)
    return o


def world():
    return c10d._get_default_group()


def reconfigure(uuid, handles, timeout_s=30.0):
    t0 = time.perf_counter()
    world().reconfigure(opts(uuid, handles, timeout_s)).wait()
    return time.perf_counter() - t0


def handles(key, who=range(4)):
    """Every listed rank's fresh handle (ranks not listed only publish theirs)."""
    store.set(f"{key}/{rank}", world().get_reconfigure_handle())
    return [store.get(f"{key}/{r}").decode() for r in who]


def barrier(key, who=range(4)):
    store.set(f"{key}/done/{rank}", "1")
    for r in who:
        store.get(f"{key}/done/{r}")


def total():
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    return t[0].item()


def refused(name, fn):
    try:
        fn()
        res[name] = "no error"
    except Exception as err:   # noqa: BLE001 -- the test asserts the message
        res[name] = f"{type(err).__name__}: {err}"


def note(step):
    res["steps"].append([step, dist.get_rank(), dist.get_world_size(), total(), world().generation])
    save()


def save():
    with open(os.path.join(out, f"res-{rank}.json.tmp"), "w") as f:
        json.dump(res, f)
    os.replace(os.path.join(out, f"res-{rank}.json.tmp"), os.path.join(out, f"res-{rank}.json"))


hd.init_process_group(timeout=60)
res["supports"] = dist._supports_reconfigure() if hasattr(dist, "_supports_reconfigure") else world().supports_reconfigure
note("start")

# Bad input is refused and changes nothing.
h = handles("h0")
mine = world().get_reconfigure_handle()
refused("not_a_handle", lambda: reconfigure(1, h[:3] + ["tcp://10.0.0.1:1234"]))
refused("without_me", lambda: reconfigure(2, [x for i, x in enumerate(h) if i != rank]))
refused("twice", lambda: reconfigure(3, h + [mine]))
other_job = mine.replace('"job":"', '"job":"other-')
refused("other_job", lambda: reconfigure(4, [other_job if i == rank else x for i, x in enumerate(h)]))
refused("subgroup", lambda: dist.new_group([0, 1, 2, 3]).reconfigure(opts(5, h)))
note("after_refusals")

# Shrink by a set (ranks follow the plan), then a subgroup over the shrunk world.
if rank != 1:
    res["shrink_s"] = reconfigure(10, {x for i, x in enumerate(h) if i != 1})
    note("shrunk")
    sub = dist.new_group([0, 1])                  # new ranks 0, 1: the processes of old ranks 0, 2
    if dist.get_rank() in (0, 1):
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t, group=sub)
        res["subgroup_sum"] = t[0].item()
    refused("reused_uuid", lambda: reconfigure(10, handles("h1", [0, 2, 3])))
    refused("stale_handles", lambda: reconfigure(11, [x for i, x in enumerate(h) if i != 1]))
barrier("b1")

# Grow back to 4 (the left-out process was never told: its handle is fresh all the same).
res["grow_s"] = reconfigure(20, handles("h2"))
note("grown")

# abort(): hooks fire, get_error says SUCCESS (the caller aborted), a reconfigure recovers.
fired = []
world().register_abort_hook(7, lambda: fired.append("abort"))
world().abort()
res["abort_hook"] = list(fired)
res["error_after_abort"] = str(world().get_error())
refused("op_after_abort", total)
res["recover_after_abort_s"] = reconfigure(30, handles("h3"))
note("after_abort")

# An op timeout: rank 0 sits out an all_reduce; the others' hook fires, get_error says TIMEOUT.
fired.clear()
evt = threading.Event()
world().register_abort_hook(8, evt.set)
world().set_timeout(datetime.timedelta(seconds=1.5))
if rank != 0:
    work = dist.all_reduce(torch.ones(4), async_op=True)
    res["timeout_hook"] = evt.wait(20)
    res["error_after_timeout"] = str(world().get_error())
    refused("timed_out_wait", work.wait)
world().unregister_abort_hook(7)
world().unregister_abort_hook(8)
world().set_timeout(datetime.timedelta(seconds=60))
barrier("b4")
res["recover_after_timeout_s"] = reconfigure(40, handles("h4"))
note("after_timeout")

# A member that never calls: the others' reconfigure fails at its deadline, ops are refused
# meanwhile, and the next reconfigure with everyone recovers.
h5 = handles("h5")
if rank != 3:
    t0 = time.perf_counter()
    refused("missing_member", lambda: reconfigure(50, h5, timeout_s=1.0))
    res["missing_member_s"] = time.perf_counter() - t0
    refused("op_before_reconfigure", total)
barrier("b5")
reconfigure(51, handles("h6"))
note("after_missing")

# A member dies: the survivors' ops fail, and they reconfigure without it.
if rank == 3:
    save()
    os._exit(0)
time.sleep(0.3)
refused("op_with_dead_peer", total)
res["error_after_peer_loss"] = str(world().get_error())
reconfigure(60, handles("h7", [0, 1, 2]))
note("without_dead")
save()
dist.destroy_process_group()
