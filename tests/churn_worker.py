"""One process of tests/test_churn.py: a spare that the driver (the test, acting as cluster
agent) turns into a rank, then drives through training and membership changes.

Commands arrive as JSON lines on stdin, events leave as JSON lines on stdout.  A reader thread
queues the commands so that the training loop can look for a "leave" between steps without
blocking.  Every wait has a deadline (IDLE_S): a worker the driver forgot exits non-zero
rather than hang.

    {"cmd": "join", "rank", "size", "gen", "plan", "member": false}   become a rank (a spare)
    {"cmd": "train", "steps": K}     train K steps; reports "done" or "failed"
    {"cmd": "leave"}                 (between steps) close gracefully and exit 0
    {"cmd": "reform", "how": "shrink"|"recover"|"grow"|"check", "exclude", "size", "plan",
     "joiners": bool}                re-form the world, then check parity; reports "reformed"
                                     (or "reform_failed": a member was lost meanwhile)
    {"cmd": "reform", "how": "rejoin", "rank", "size", "plan", "gen"}   after a failed one
    {"cmd": "exit"}

Parity after a change: a collective that failed mid-step changes no state here (the update
is applied only after the step's one all_reduce), but a member may have finished the step the
others failed (it had every chunk it needed when the peer died), so members keep the state
after each of their last steps and all go back to the oldest step any member holds.  Then,
if joiners came, a member broadcasts the state; hd.sync_state must find nothing to repair.
"""

from __future__ import annotations

import copy
import json
import os
import queue
import sys
import threading
import time

import torch
import torch.distributed as dist

import hpct.distributed as hd
from util import state_digest     # tests/ is this script's folder

IDLE_S = 240.0              # no command for this long: the driver is gone, exit non-zero
FAR = 1 << 62               # a joiner's "steps done" in the MIN: it holds no state
commands: queue.Queue = queue.Queue()


def emit(ev: str, **facts) -> None:
    sys.stdout.write(json.dumps({"ev": ev, "pid": os.getpid(), **facts}) + "\n")
    sys.stdout.flush()


def reader() -> None:
    for line in sys.stdin:
        commands.put(json.loads(line))
    commands.put({"cmd": "exit"})         # the driver closed our stdin


def next_command(timeout: float = IDLE_S) -> dict:
    try:
        return commands.get(timeout=timeout)
    except queue.Empty:
        emit("idle", seconds=timeout)
        os._exit(3)


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
done = 0                    # steps this process's state has taken
kept: dict[int, tuple] = {}   # steps done -> (model, optimizer) state after them (the last 3)


def digest() -> str:
    return state_digest(model, opt)


def keep() -> None:
    kept[done] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    for old in [s for s in kept if s < done - 2]:
        del kept[old]


def step() -> None:
    """One deterministic step: data from (step, rank), ONE all_reduce of the flat gradient."""
    global done
    g = torch.Generator().manual_seed(1000 * done + dist.get_rank())
    x = torch.randn(16, 8, generator=g, dtype=torch.float64)
    opt.zero_grad()
    (model(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    i = 0
    for p in model.parameters():
        p.grad.copy_(flat[i:i + p.numel()].view_as(p))
        i += p.numel()
    opt.step()
    done += 1
    keep()


def train(steps: int) -> None:
    t0 = time.monotonic()
    for _ in range(steps):
        try:
            cmd = commands.get_nowait()
        except queue.Empty:
            cmd = None
        if cmd is not None and cmd["cmd"] == "leave":
            hd.shutdown_all()             # idle between steps: a graceful close, peers see it
            emit("left", done=done)
            os._exit(0)
        if cmd is not None:
            emit("protocol", problem=f"unexpected {cmd} while training")
            os._exit(4)
        try:
            step()
        except hd.HpctError as err:
            # Abort at once, so peers waiting on THIS rank (not on the lost one) fail too.
            hd.abort_all("a peer failed")
            emit("failed", type=type(err).__name__, message=str(err)[:800], done=done,
                 seconds=time.monotonic() - t0)
            return
        except Exception as err:          # anything else is a bug the test must show
            emit("failed", type=type(err).__name__, message=str(err)[:800], done=done, unclear=True)
            return
    emit("done", done=done, digest=digest())


def settle(member: bool, joiners: bool, t0: float) -> None:
    """After any change: agree on the step, roll back to it, hand state to joiners, check parity."""
    global done
    n = torch.tensor([done if member else FAR], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    agreed = int(n.item())
    pre, back = None, (done - agreed if member else 0)
    if member:
        if agreed not in kept:
            raise RuntimeError(f"steps done {done}, the group agreed on {agreed}: no state kept for it")
        model.load_state_dict(kept[agreed][0])
        opt.load_state_dict(kept[agreed][1])
        pre = digest()
    done = agreed
    if joiners:
        hd.broadcast_state(model, opt, src=hd.healthy_source(member))
    report = hd.sync_state(model, opt)
    keep()
    emit("reformed", rank=dist.get_rank(), size=dist.get_world_size(), gen=hd.generation(), done=done,
         pre=pre, digest=digest(), moves=len(report.moves), compared=report.tensors,
         back=back, seconds=time.monotonic() - t0)


def reform(cmd: dict) -> None:
    t0 = time.monotonic()
    how = cmd["how"]
    if how == "shrink":
        hd.shrink(cmd["exclude"])
    elif how == "recover":
        hd.recover()
    elif how == "grow":
        hd.grow(cmd["size"], plan_ranks=cmd["plan"])
    elif how == "rejoin":     # after a failed change: the membership and generation the agent names
        hd.recover(world_size=cmd["size"], rank=cmd["rank"], generation=cmd["gen"], plan_ranks=cmd["plan"])
    settle(True, cmd.get("joiners", False), t0)


def main() -> int:
    threading.Thread(target=reader, daemon=True).start()
    emit("spare")
    cmd = next_command()
    if cmd["cmd"] != "join":
        return 0
    t0 = time.monotonic()
    hd.init_process_group(cmd["rank"], cmd["size"], timeout=cmd.get("op_timeout", 30.0),
                          generation=cmd["gen"], plan_ranks=cmd["plan"])
    if cmd.get("member"):                 # the first world: everyone starts from the same seed
        keep()
        emit("reformed", rank=dist.get_rank(), size=dist.get_world_size(), gen=hd.generation(), done=0,
             pre=digest(), digest=digest(), moves=0, compared=0, seconds=time.monotonic() - t0)
    else:
        settle(False, True, t0)
    while True:
        cmd = next_command()
        try:
            if cmd["cmd"] == "train":
                train(cmd["steps"])
            elif cmd["cmd"] == "reform":
                reform(cmd)
            elif cmd["cmd"] == "leave":      # the round ended (or failed) before it looked
                hd.shutdown_all()
                emit("left", done=done)
                return 0
            elif cmd["cmd"] == "exit":
                hd.shutdown_all()
                return 0
            else:
                emit("protocol", problem=f"unknown command {cmd}")
                return 4
        except Exception as err:
            hd.abort_all("reform failed")
            emit("reform_failed", type=type(err).__name__, message=str(err)[:800], gen=hd.generation(),
                 unclear=not isinstance(err, hd.HpctError))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
