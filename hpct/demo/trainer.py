"""One training rank for the recovery tests, the demo and the benchmark (python -m).

    python -m hpct.demo.trainer train OUT_DIR --steps S [--hang RANK:STEP:GEN ...] [--replacement]
    hpct run --nproc-per-node N -m hpct.demo.trainer train OUT_DIR ...     (what `hpct demo` runs)

--device cuda runs the same job on CUDA tensors (the hpct backend's NCCL engine; ranks that
share a GPU each get their own NCCL_HOSTID, so NCCL treats them as hosts and uses sockets);
--stock runs it on torch's own backend (gloo or nccl, env:// with MASTER_ADDR/MASTER_PORT),
the reference a run on hpct must match bit for bit.

Configuration comes from the environment: RANK, WORLD_SIZE, N_PROC_PER_NODE,
HPCT_PORT_BASE, HPCT_CONNECT_TIMEOUT, HPCT_GENERATION.  A process started at a generation above
0 is a replacement (as ``hpct run`` starts one; --replacement says so too) and receives the
state.  Every rank writes OUT_DIR/rank<R>-<pid>.json (events, and "stepped": the time of the
process's first completed step and of the first after each rejoin, when training resumed) and
OUT_DIR/params-<R>.pt (final parameters).

train: a small MLP under DistributedDataParallel with Adam; the batch of step s on rank r
is a pure function of (r, s).  Step semantics: a step is forward, backward (the gradient
allreduce), optimizer.step; if the allreduce fails, no rank has stepped, so after the
in-process recovery the same step is done again and a run with faults ends with exactly
the parameters of a run without (see wrap() for the one DDP setting this needs).
--hang R:K:G: rank R, in generation G, writes OUT_DIR/hang-<R>-<G> before step K's backward
and waits there (the harness SIGKILLs it).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import hpct.distributed as hd


def model_and_optimizer():
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def device_of(kind: str) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    count = torch.cuda.device_count()
    if count == 0:
        raise SystemExit("trainer: --device cuda, but torch sees no CUDA device")
    if count < int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1):
        # Several ranks on one GPU: NCCL refuses two ranks of a comm on one device of one host,
        # unless each rank is a host of its own (then it talks over sockets).
        os.environ.setdefault("NCCL_HOSTID", f"hpct-trainer-rank-{os.environ['RANK']}")
    dev = torch.device("cuda", local % count)
    torch.cuda.set_device(dev)
    return dev


def wrap(model):
    # find_unused_parameters=True keeps DDP's first bucket layout for the whole run (no
    # rebuild after iteration 1).  A DDP built after a recovery then reduces every element
    # at the same position, hence in the same order, as the DDP of a run without faults:
    # the condition for bit-identical parameters.
    dev = next(model.parameters()).device
    ids = [dev.index] if dev.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, find_unused_parameters=True)


def rejoin(log, model, opt, step, *, healthy, recover_first, args):
    """Recover (unless this is a replacement's first join) and re-sync state; retried on faults."""
    t0 = time.time()
    for attempt in range(args.max_recoveries):
        try:
            if recover_first or attempt:
                hd.recover()
            t_rec = time.time()
            src = hd.healthy_source(healthy, progress=step)
            extra = hd.broadcast_state(model, opt, src=src, extra={"step": step} if healthy else None)
            ddp = wrap(model)
            log.event("recovered" if healthy else "synced", step=extra["step"],
                      generation=hd.generation(), src=src, recover_s=t_rec - t0, total_s=time.time() - t0)
            return extra["step"], ddp
        except Exception as err:    # a fault during recovery: move on to the next generation
            log.event("recover_failed", step=step, error=str(err)[:2000], type=type(err).__name__,
                      generation=hd.generation())
            if attempt == args.max_recoveries - 1:
                raise
    raise AssertionError("unreachable")


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100_003 * step + rank)
    x = torch.randn(8, 16, generator=g)
    y = torch.randn(8, 4, generator=g)
    return x, y


class Log:
    def __init__(self, out: Path, rank: int):
        self.path = out / f"rank{rank}-{os.getpid()}.json"
        self.data = {"rank": rank, "pid": os.getpid(), "events": []}

    def event(self, what: str, **kw):
        self.data["events"].append({"what": what, "t": time.time(), **kw})
        self.flush()

    def stepped(self, step: int, generation: int):
        """A step completed, the first since the process started or last rejoined (kept apart from
        the events, whose sequence the recovery tests assert)."""
        self.data.setdefault("stepped", []).append({"step": step, "t": time.time(), "generation": generation})
        self.flush()

    def flush(self):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(self.path)


def train(args) -> int:
    out = Path(args.out)
    rank = int(os.environ["RANK"])
    log = Log(out, rank)
    log.event("start", generation=int(os.environ.get("HPCT_GENERATION", "0") or 0))
    dev = device_of(args.device)
    if args.stock:
        import datetime
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=args.op_timeout))
    else:
        hd.init_process_group(timeout=args.op_timeout)
    log.event("connected", generation=hd.generation())
    model, opt = model_and_optimizer()
    model.to(dev)       # in place: the optimizer's parameters stay the model's
    step = 0
    ddp = None
    started_at = int(os.environ.get("HPCT_GENERATION", "0") or 0)
    if args.replacement or started_at > 0:
        step, ddp = rejoin(log, model, opt, step, healthy=False, recover_first=False, args=args)
    elif not args.stock and hd.generation() > 0:
        # hpct run moved the view before this first world formed: a newcomer is in it and waits
        # for the state, so every rank joins (its seeded state is step 0), as examples/ddp.py does.
        step, ddp = rejoin(log, model, opt, step, healthy=True, recover_first=False, args=args)
    else:
        ddp = wrap(model)
    resumed = False     # whether this process has stepped since it started or last rejoined
    loss_fn = nn.MSELoss()
    while step < args.steps:
        opt.zero_grad(set_to_none=True)
        x, y = (t.to(dev) for t in batch(rank, step))
        try:
            loss = loss_fn(ddp(x), y)
            if (rank, step, hd.generation()) in args.hang:
                (out / f"hang-{rank}-{hd.generation()}").write_text(str(os.getpid()))
                log.event("hanging", step=step)
                while True:
                    time.sleep(1)
            loss.backward()
        except Exception as err:     # the gradient allreduce failed: a peer is gone
            log.event("failure", step=step, error=str(err)[:2000], type=type(err).__name__,
                      generation=hd.generation())
            if args.no_recover or args.stock:
                raise
            del ddp
            step, ddp = rejoin(log, model, opt, step, healthy=True, recover_first=True, args=args)
            resumed = False
            continue
        opt.step()
        step += 1
        if not resumed:
            log.stepped(step - 1, hd.generation())
            resumed = True
    torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, out / f"params-{rank}.pt")
    log.event("done", step=step, generation=hd.generation())
    if args.fast_exit:
        # Leave without tearing the mesh down (a peer that exits first may reset the last
        # barrier: that is not a training failure).
        try:
            dist.barrier()
        except Exception:   # noqa: BLE001
            pass
        sys.stdout.flush()
        os._exit(0)
    dist.barrier()
    if args.stock:
        dist.destroy_process_group()
    else:
        hd.shutdown_all()
    return 0


def main(argv=None) -> int:
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("out")
    t.add_argument("--steps", type=int, default=8)
    t.add_argument("--hang", action="append", default=[], type=lambda v: tuple(int(x) for x in v.split(":")),
                   metavar="RANK:STEP:GEN")
    t.add_argument("--replacement", action="store_true")
    t.add_argument("--no-recover", action="store_true")
    t.add_argument("--max-recoveries", type=int, default=3)
    t.add_argument("--op-timeout", type=float, default=30.0)
    t.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    t.add_argument("--stock", action="store_true", help="torch's own backend (the reference run)")
    t.add_argument("--fast-exit", action="store_true", help="os._exit after the last barrier, no tear-down")
    args = ap.parse_args(argv)
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
