"""A DDP training script that survives the loss of a worker without restarting the others.

    hpct run --nnodes 1 --nproc-per-node 4 examples/ddp.py --steps 200
    torchrun --nproc-per-node 4 examples/ddp.py --steps 200 --backend gloo   # the same script, stock

It is a torchrun script plus the recovery pattern of docs/launch.md: when a step fails (a peer
was lost), abort, ``hd.recover()`` (the node's agent says the new world), take the state from a
member that kept it, rebuild DDP, and do the failed step again.  A replacement (started by the
agent with HPCT_GENERATION above 0) joins and receives the state instead of initialising it; so
does every rank whose first world is past generation 0 (the view moved before the world formed).
At step boundaries ``hd.membership_changed()`` says whether the agents grew the world (a spare
node, or a node that came back after a shrink); every member then calls ``hd.grow()`` and the
newcomers take the state the same way.
Each step's batch is a function of (rank, step), so a run with faults ends with exactly the
parameters of a run without: ``--out DIR`` writes each process's record and the final digest,
and appends every completed step to ``steps-<place>.log`` as it goes (a killed process's steps
stay counted).  A process's place in the port plan names its files: it is its rank at the start,
and it stays with a node's slot when a shrink renumbers the ranks.  ``--checkpoint FILE --checkpoint-every K`` is the stock way, for comparison: rank 0
saves the state every K steps, and a process started again (torchrun's restart) resumes from it.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import hpct.distributed as hd
from _common import finish       # beside this script: the record written, the group left


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def ddp(model):
    # find_unused_parameters keeps DDP's first bucket order for the whole run, so a DDP rebuilt
    # after a recovery reduces in the same order as one that never failed (bit-identical runs).
    return nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def join(model, opt, step: int, healthy: bool) -> int:
    """Agree the state: the lowest of the members furthest on that kept their state sends it (with
    the step) to all.  A peer lost at a collective's very end lets some ranks take the step and not
    others: the furthest state means nobody takes a step twice."""
    src = hd.healthy_source(healthy, progress=step)
    extra = hd.broadcast_state(model, opt, src=src, extra={"step": step})
    return extra["step"]


def load_checkpoint(path: str, model, opt) -> int:
    """The step a saved state resumes at (0 with none); the state goes into model and opt."""
    if not path or not os.path.exists(path):
        return 0
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    return int(saved["step"])


def save_checkpoint(path: str, model, opt, step: int) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"       # renamed into place: a kill never leaves half a file
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds of simulated compute per step")
    ap.add_argument("--out", default=None, help="folder for each process's record")
    ap.add_argument("--backend", default="hpct", help="hpct, or gloo for the stock reference run")
    ap.add_argument("--check-every", type=int, default=1, help="steps between membership_changed() checks")
    ap.add_argument("--op-timeout", type=float, default=None,
                    help="seconds a collective may wait for a peer (default: torch's 30 minutes)")
    ap.add_argument("--checkpoint", default=None, help="file to resume from and save to (the stock pattern)")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="rank 0 saves the state every K steps")
    args = ap.parse_args()
    rank, t_start = int(os.environ["RANK"]), time.time()
    places = os.environ.get("HPCT_PLAN_PLACES")      # started into a shrunk world or a spare's slot
    place = int(places.split(",")[rank]) if places else rank
    record = {"rank": rank, "place": place, "pid": os.getpid(), "generation": int(os.environ.get("HPCT_GENERATION") or 0),
              "steps": [], "recoveries": [], "grows": []}
    timeout = {} if args.op_timeout is None else {"timeout": datetime.timedelta(seconds=args.op_timeout)}
    if args.backend == "hpct":
        hd.init_process_group(**timeout)
    else:
        dist.init_process_group(args.backend, **timeout)
    model, opt = build()
    # A replacement holds no state until it joins; everyone else starts equal (same seed).  A first
    # world past generation 0 (the view moved before it formed: a spare or a replacement is in it)
    # is joined by every rank, or the newcomers' join would meet the others' DDP set-up and both wait.
    healthy, step, net = record["generation"] == 0, 0, None
    must_join = not healthy or (args.backend == "hpct" and hd.generation() > 0)
    if args.checkpoint and healthy:
        step = load_checkpoint(args.checkpoint, model, opt)
        record["resumed_at"] = step
    log = open(Path(args.out) / f"steps-{place}.log", "a", buffering=1) if args.out else None
    while True:
        try:
            if net is not None and args.backend == "hpct" and step % args.check_every == 0 \
                    and hd.membership_changed():
                hd.grow()           # a step boundary: the agents took a node in
                net, must_join = None, True
                record["grows"].append({"at_step": step, "world_size": dist.get_world_size(),
                                        "time": time.time()})
            if net is None:         # (re)join: after a recovery or a grow, or a newcomer's first world
                if must_join:
                    step = join(model, opt, step, healthy)
                healthy, must_join, net = True, False, ddp(model)
            if step >= args.steps:  # leave together: a peer lost now is recovered as in a step
                dist.barrier()
                break
            x, y = batch(dist.get_rank(), step)
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(net(x), y).backward()     # the gradient all_reduce
        except RuntimeError:        # hpct's CollectiveError, or DDP's RuntimeError around it
            if not any(pg.failure is not None for pg in hd.live_groups()):
                raise               # not a lost peer: a bug of the script
            t0 = time.time()        # a peer was lost: nobody stepped; recover and redo the step
            hd.abort_all()
            hd.recover()            # asks this node's agent for the new world
            net, must_join = None, True
            record["recoveries"].append({"at_step": step, "seconds": time.time() - t0,
                                         "generation": hd.generation(), "time": time.time()})
            continue
        opt.step()
        record["steps"].append([step, time.time()])
        step += 1
        if args.checkpoint and args.checkpoint_every and step % args.checkpoint_every == 0 \
                and dist.get_rank() == 0:
            save_checkpoint(args.checkpoint, model, opt, step)
        if args.out:                # progress, for whoever watches the job (the tests, the benchmarks)
            (Path(args.out) / f"progress-{place}").write_text(str(step))
            log.write(f"{step - 1} {record['steps'][-1][1]:.6f} {os.getpid()}\n")
        time.sleep(args.step_time)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    record.update(digest=digest, world_size=dist.get_world_size(), start=t_start, end=time.time())
    return finish(args.out, rank, record, args.backend)


if __name__ == "__main__":
    raise SystemExit(main())
