"""One rank of a job on torch 2.6.0, stock or hpct's patched wheel (tests/test_patched_torch.py).

    <venv>/bin/python patched_torch_worker.py MODE [JSON]

The rank comes from RANK/WORLD_SIZE/LOCAL_RANK (torchrun's variables); the job's other settings
from the environment (HPCT_USE_ROOTLESS, HPCT_HOSTS, HPCT_PORT_BASE, HPCT_GENERATION, ...).  Only
torch's own API is used: with the patched wheel, init_process_group("gloo") is the series' path.
The last line printed is one JSON object.

MODE world: init_process_group("gloo"), collectives on the world and on a subgroup, the default
    store probed, the TCP ports this process listens on, destroy_process_group.
MODE ddp: DDP training; {"steps", "kill_rank", "kill_step"}: that rank SIGKILLs itself before
    that step (in its first generation).  A survivor whose step fails destroys the world and
    forms it again (the patched torch moves to the next generation on the same ports), wraps the
    model in DDP again (which broadcasts rank 0's parameters) and learns the step from rank 0;
    a replacement (HPCT_GENERATION > 0) joins that world the same way.
MODE nccl: what the NCCL half says without a GPU: the libnccl probe, then a rootless
    init_process_group("nccl"), whose error is reported.
MODE gpu: (a GPU machine with the patched wheel and hpct's NCCL; tests/gpu/test_torch26_nccl.py) a rootless
    NCCL world with device_id on GPU 0 (each rank its own NCCL host), a split subgroup, a send/recv
    ring, then ({"kill": true}) the last rank of the first generation exits, the survivors' blocking
    wait times out, they abort the world and form it again at the next generation on the same
    ports with the replacement, and run the collectives again.
MODE abort: 2 ranks build dist.ProcessGroupGloo storeless themselves ({"base": port}), as the
    series' Python binding allows: rank 1 starts late (the connect retries); rank 0 aborts a running
    and a queued all_reduce that rank 1 never joins; both groups are dropped; a group of the next
    generation forms on the same ports; rank 0 alone then waits out a short connect deadline.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

MODE = sys.argv[1]
ARGS = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
RANK = int(os.environ.get("RANK", "0"))
TIMEOUT = timedelta(seconds=float(ARGS.get("timeout", 60)))


def out(**fields) -> None:
    # One write with its newline: ranks share torchrun's stdout, and print() writes the newline apart.
    sys.stdout.write(json.dumps({"rank": RANK, "pid": os.getpid(), "torch": torch.__version__, **fields}) + "\n")
    sys.stdout.flush()


def listening_ports() -> list[int]:
    """The TCP ports this process listens on (its own sockets, from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:          # state LISTEN, one of ours
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def world() -> None:
    t0 = time.monotonic()
    dist.init_process_group("gloo", timeout=TIMEOUT)
    formed = time.monotonic() - t0
    size = dist.get_world_size()
    t = torch.full((4,), float(RANK + 1))
    dist.all_reduce(t)
    half = dist.new_group(list(range(size // 2)))
    h = torch.ones(2)
    if RANK < size // 2:
        dist.all_reduce(h, group=half)
    b = torch.tensor([float(RANK)])
    dist.broadcast(b, src=size - 1)
    try:
        dist.distributed_c10d._get_default_store().get("any-key")
        store = "a store answered"
    except Exception as err:           # noqa: BLE001 - the message is the result
        store = f"{type(err).__name__}: {err}"
    ports = listening_ports()
    dist.barrier()
    dist.destroy_process_group()
    out(formed_s=round(formed, 3), sum=t.tolist(), half=h.tolist(), bcast=b.item(), store=store, ports=ports,
        master=os.environ.get("MASTER_ADDR"), backend_class=_backend_class())


def _backend_class() -> str:
    pg = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    return type(pg._get_backend(torch.device("cpu"))).__module__ if pg is not None else ""


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def ddp() -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    steps, kill_rank, kill_step = ARGS["steps"], ARGS.get("kill_rank", -1), ARGS.get("kill_step", -1)
    # The kill happens once: not in a replacement (hpct run's, at the next generation) nor after
    # torchrun restarted every worker.
    first_generation = int(os.environ.get("HPCT_GENERATION", "0")) == 0 and \
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    started = time.monotonic()
    dist.init_process_group("gloo", timeout=TIMEOUT)
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    step, recoveries, events, logged = 0, 0, [], None
    while True:
        net = DDP(model)               # its constructor broadcasts rank 0's parameters
        if logged is None:
            # DDP's C++ logger static_casts the GLOO backend to torch's own ProcessGroupGloo to read
            # its thread count: the series' class must have that field where torch's has it.
            backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            logged = {"ddp_logger": net._get_ddp_logging_data().get("gloo_num_threads"),
                      "options": backend.options._threads}
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        where = torch.tensor([step])
        dist.broadcast(where, src=0)
        step = int(where.item())
        try:
            while step < steps:
                if first_generation and RANK == kill_rank and step == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                g = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
                x = torch.randn(16, 32, generator=g)
                loss = net(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
            break
        except Exception as err:       # noqa: BLE001 - a peer is gone: rebuild in this process
            t = time.monotonic()
            recoveries += 1
            dist.destroy_process_group()
            dist.init_process_group("gloo", timeout=TIMEOUT)
            events.append({"step": step, "error": f"{type(err).__name__}: {str(err)[:200]}",
                           "rebuilt_s": round(time.monotonic() - t, 3)})
    result = digest(model)
    dist.barrier()
    dist.destroy_process_group()
    out(digest=result, steps=step, recoveries=recoveries, events=events, gloo_threads=logged,
        seconds=round(time.monotonic() - started, 2))


def nccl() -> None:
    c10d = torch._C._distributed_c10d
    probe = c10d._hpct_nccl_rootless_probe() if hasattr(c10d, "_hpct_nccl_rootless_probe") else None
    try:
        dist.init_process_group("nccl", timeout=TIMEOUT)
        error = None
    except Exception as err:           # noqa: BLE001 - the message is the result
        error = f"{type(err).__name__}: {err}"
    out(probe=list(probe) if probe else None, error=error, has_nccl=bool(getattr(torch, "_hpct_c10d", None)
                                                                       and torch._hpct_c10d.has_nccl))


def _storeless(base: int, generation: int, connect_s: float = 30.0, size: int = 2):
    pg_cls = dist.ProcessGroupGloo
    opts = pg_cls._Options()
    opts._timeout = timedelta(seconds=30)
    opts._devices = [pg_cls.create_device(hostname="127.0.0.1", port=base + RANK)]
    opts._threads = 1
    opts._storeless_hosts = ["127.0.0.1"] * size
    opts._storeless_ports = [base + r for r in range(size)]
    opts._generation = generation
    opts._connect_timeout = timedelta(seconds=connect_s)
    return pg_cls(dist.HashStore(), RANK, size, opts)       # the store is never used: storeless


def _fails(fn) -> str | None:
    try:
        fn()
    except Exception as err:           # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return None


def abort() -> None:
    import gc
    import threading
    base, facts = ARGS["base"], {}
    if RANK == 1:
        time.sleep(0.7)
    t = time.monotonic()
    pg = _storeless(base, 0)
    facts["connect_s"] = round(time.monotonic() - t, 3)
    x = torch.ones(4)
    pg.allreduce([x]).wait()
    facts["sum"] = x.tolist()
    if RANK == 0:
        running, queued = pg.allreduce([torch.ones(4)]), pg.allreduce([torch.ones(4)])
        time.sleep(0.3)
        facts["pending"] = not running.is_completed() and not queued.is_completed()
        t = time.monotonic()
        aborter = threading.Thread(target=pg.abort, args=("test abort",))
        aborter.start()
        facts["running"], facts["queued"] = _fails(running.wait), _fails(queued.wait)
        aborter.join()
        facts["abort_s"] = round(time.monotonic() - t, 3)
        facts["after"] = _fails(lambda: pg.allreduce([torch.ones(4)]).wait())
        facts["aborted"] = pg._aborted
    else:
        time.sleep(1.5)
        pg._shutdown()
    t = time.monotonic()
    del pg
    gc.collect()
    facts["destroyed_s"] = round(time.monotonic() - t, 3)
    time.sleep(1.5 if RANK == 0 else 0.2)
    pg = _storeless(base, 1)
    y = torch.ones(4)
    pg.allreduce([y]).wait()
    facts["sum_next_generation"] = y.tolist()
    pg._shutdown()
    del pg
    if RANK == 0:
        t = time.monotonic()
        facts["absent_peer"] = _fails(lambda: _storeless(base, 2, connect_s=1.5))
        facts["absent_peer_s"] = round(time.monotonic() - t, 3)
    out(**facts)


def _nccl_round(dev) -> dict:
    size, rank = dist.get_world_size(), dist.get_rank()
    x = torch.full((1024,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    sub = dist.new_group(list(range(size)))           # split from the world: no port, no store
    y = torch.ones(8, device=dev)
    dist.all_reduce(y, group=sub)
    sent, got = torch.full((4,), float(rank), device=dev), torch.empty(4, device=dev)
    ops = [dist.P2POp(dist.isend, sent, (rank + 1) % size), dist.P2POp(dist.irecv, got, (rank - 1) % size)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    torch.cuda.synchronize()
    return {"sum": x[0].item(), "sub": y[0].item(), "recv": got[0].item()}


def gpu() -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    first = int(os.environ.get("HPCT_GENERATION", "0")) == 0
    t = time.monotonic()
    dist.init_process_group("nccl", device_id=dev, timeout=TIMEOUT)
    facts = {"formed_s": round(time.monotonic() - t, 3)}
    if first:                                     # a replacement joins the survivors' second round
        facts["first"] = _nccl_round(dev)
    if ARGS.get("kill"):
        if first:
            dist.barrier()
            if RANK == dist.get_world_size() - 1:
                os._exit(17)                      # gone without a word, as a crashed process is
            t = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1, device=dev))   # TORCH_NCCL_BLOCKING_WAIT=1: fails at the timeout
                torch.cuda.synchronize()
                facts["missed"] = "an all_reduce with a rank gone completed"
            except Exception as err:              # noqa: BLE001 - the fault
                facts["fault"] = f"{type(err).__name__}: {str(err)[:200]}"
            dist.distributed_c10d._abort_process_group()
            facts["aborted_s"] = round(time.monotonic() - t, 3)
            t = time.monotonic()
            dist.init_process_group("nccl", device_id=dev, timeout=TIMEOUT)
            facts["reformed_s"] = round(time.monotonic() - t, 3)
        facts["again"] = _nccl_round(dev)
    dist.destroy_process_group()
    out(**facts)


if __name__ == "__main__":
    {"world": world, "ddp": ddp, "nccl": nccl, "abort": abort, "gpu": gpu}[MODE]()
