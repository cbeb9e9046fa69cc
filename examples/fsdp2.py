"""An FSDP2 (HSDP) training script that survives the loss of a worker without restarting the others.

    hpct run --nnodes 1 --nproc-per-node 4 examples/fsdp2.py --replicas 2 --steps 200
    torchrun --nproc-per-node 4 examples/fsdp2.py --replicas 2 --backend gloo   # the same script, stock

Plain FSDP2 keeps each parameter shard on one rank only: a lost rank's shards, and their optimizer
state, exist nowhere else, so only a checkpoint could bring them back.  HSDP (``fully_shard`` on a
2-D mesh, ``replicate`` x ``shard``) keeps ``--replicas`` copies of every shard, so a lost rank's
shards live on in its replica peers' memory.  The recovery pattern is docs/launch.md's: abort,
``hd.recover()`` (the agent replaced the lost worker at the same rank), make the mesh and the
sharded model again, and each rank takes its shards (parameters, momentum, the step) from the
lowest member of its replicate group that kept them and is furthest on.  A job survives as long as
every shard keeps one replica; losing all replicas of a shard ends it with that message.

A peer lost at the very end of a step can let some replicate groups take the step and not others
(a torn step: the shard that the lost rank's all-reduce carried stays behind).  So each rank keeps
its shards and optimizer state from before its last step, one more copy of them: the groups that
stepped go back to it, and the step is taken again by all.

Recovery needs the same world size (replacements, or spare nodes): a shrink or a grow changes
the mesh's shape, and the shards would have to be re-cut (a checkpoint's job).  ``--out DIR``
writes each process's record and the digest of the full parameters (equal on every rank, and
equal to a run without faults).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import hpct.distributed as hd


def build(replicas: int):
    """The 2-D mesh and the sharded model and optimizer: every member builds them, in this order."""
    size = dist.get_world_size()
    if size % replicas:
        raise SystemExit(f"fsdp2.py: --replicas {replicas} does not divide the world size {size}")
    mesh = init_device_mesh("cpu", (replicas, size // replicas), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def shards(opt) -> dict:
    """This rank's local shards.  The optimizer holds FSDP2's sharded parameters, which a failed
    forward or backward never changed (the module's own attributes may be unsharded then)."""
    params = opt.param_groups[0]["params"]
    return {"params": [p.to_local().detach().clone() for p in params],
            "momentum": [opt.state[p]["momentum_buffer"].to_local().clone() if "momentum_buffer" in opt.state[p]
                         else None for p in params]}


def join(mesh, opt, kept: dict | None, step: int) -> int:
    """Each rank takes its shards from the lowest member of its replicate group furthest on that kept
    them (``kept``: ``now``, the shards at ``step``, and ``before``, those from before the last step
    or None).  A torn step leaves the groups one step apart: the ones ahead take their ``before``.
    Without it the model is torn for good, and this exits with that message."""
    group = mesh.get_group("replicate")
    src = hd.healthy_source(kept is not None, group=group, progress=step)
    state = hd.broadcast_object({"kept": kept, "step": step}, src=src, group=group)
    at, older = state["step"], state["kept"]["before"]
    # One MAX gives the least and the most far group, and whether one that is most far has no older copy.
    spread = torch.tensor([-at, at, 2 * at + (older is None)], dtype=torch.int64)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    least, most, stuck = int(-spread[0]), int(spread[1]), int(spread[2]) == 2 * int(spread[1]) + 1
    if most > least + 1 or (most > least and stuck):
        raise SystemExit(f"fsdp2.py: a lost rank tore a step: some shards are at step {most} and others at "
                         f"{least}, and no replica holds the older copy; resume from a checkpoint")
    shards_at = state["kept"]["now"] if at == least else older
    params = opt.param_groups[0]["params"]
    with torch.no_grad():
        for p, local, momentum in zip(params, shards_at["params"], shards_at["momentum"]):
            p.to_local().copy_(local)
            if momentum is not None:
                opt.state[p]["momentum_buffer"] = DTensor.from_local(momentum.clone(), p.device_mesh,
                                                                     p.placements, run_check=False)
    return least


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--replicas", type=int, default=2, help="copies of every shard (the mesh's first dimension)")
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds of simulated compute per step")
    ap.add_argument("--out", default=None, help="folder for each process's record")
    ap.add_argument("--backend", default="hpct", help="hpct, or gloo for the stock reference run")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    record = {"rank": rank, "pid": os.getpid(), "generation": int(os.environ.get("HPCT_GENERATION") or 0),
              "steps": [], "recoveries": []}
    if args.backend == "hpct":
        hd.init_process_group()
    else:
        dist.init_process_group(args.backend)
    # A replacement holds no shards until it joins; everyone else starts equal (same seed).  A first
    # world past generation 0 holds a newcomer (the view moved before it formed): every rank joins
    # it, and a rank started at generation 0 offers its seeded shards (step 0).
    kept, step, model, before = None, 0, None, None     # before: the shards from before the last step
    seeded = record["generation"] == 0
    fresh = seeded and not (args.backend == "hpct" and hd.generation() > 0)
    synced = False                                        # synced: this rank's shards are the job's
    while True:
        try:
            if model is None:       # the first world, a recovery, or a replacement's first world
                synced, (mesh, model, opt) = False, build(args.replicas)
                if not fresh:
                    if seeded and kept is None:
                        kept = {"now": shards(opt), "before": None}
                    step, before = join(mesh, opt, kept, step), None
                fresh, synced, seeded = False, True, False
            if step >= args.steps:  # leave together: a peer lost now is recovered as in a step
                full = [p.full_tensor() for p in opt.param_groups[0]["params"]]
                dist.barrier()
                break
            x, y = batch(dist.get_rank(), step)
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()   # reduce-scatter, then all-reduce over replicas
        except RuntimeError:        # hpct's CollectiveError, or torch's RuntimeError around it
            if not any(pg.failure is not None for pg in hd.live_groups()):
                raise               # not a lost peer: a bug of the script
            t0 = time.time()
            if synced:              # this rank did not step: these are the shards of step `step`
                kept = {"now": shards(opt), "before": before}
            hd.abort_all()
            hd.recover()            # the agent replaced the lost worker: same ranks, new generation
            model, fresh = None, False
            record["recoveries"].append({"at_step": step, "seconds": time.time() - t0,
                                         "generation": hd.generation(), "time": time.time()})
            continue
        before = shards(opt)        # a torn step comes back to this (join)
        opt.step()
        record["steps"].append([step, time.time()])
        step += 1
        if args.out:
            (Path(args.out) / f"progress-{rank}").write_text(str(step))
        time.sleep(args.step_time)
    record.update(digest=hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in full)).hexdigest(),
                  end=time.time())
    # Beside this script (examples/_common.py), imported here so that build, shards and join load
    # without it (tests/test_launch_recovery.py loads this file by its path to run join).
    from _common import finish
    return finish(args.out, rank, record, args.backend)


if __name__ == "__main__":
    raise SystemExit(main())
