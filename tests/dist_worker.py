"""One rank of the backend parity test (run as a script by tests/test_backend.py).

    python dist_worker.py BACKEND OUT_DIR [FILESTORE]
    python dist_worker.py abort|torchform OUT_DIR

BACKEND "hpct": rootless start-up through hpct.distributed.init_process_group (RANK,
WORLD_SIZE and the port plan from the environment).  BACKEND "gloo": stock
ProcessGroupGloo through a FileStore (the reference).  Both run the same collectives on
the same inputs through the public torch.distributed API and save every result to
OUT_DIR/<backend>-<rank>.pt ("ERR:<type>" where the op raised); the hpct run also records
this process's TCP sockets.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

R = dist.ReduceOp
INT_TYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
FLOAT_TYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def values(rank: int, n: int, dtype, salt: int = 0) -> torch.Tensor:
    """Small integer-valued inputs: every reduction is exact in every dtype."""
    base = torch.arange(n, dtype=torch.int64) + 3 * rank + salt
    if dtype == torch.bool:
        return (base % (rank + 2)) == 0
    if dtype in (torch.uint8,):
        return (base % 5 + 1).to(dtype)
    return (base % 7 - 2).to(dtype)


def tcp_sockets() -> list[tuple[int, int, str]]:
    """(local port, remote port, state) of every TCP socket this process holds."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[9] in inodes:
                state = {"0A": "LISTEN", "01": "ESTABLISHED"}.get(f[3], f[3])
                out.append((int(f[1].split(":")[1], 16), int(f[2].split(":")[1], 16), state))
    return out


def run_cases(rank: int, n: int) -> dict:
    res: dict = {}

    def case(name, fn):
        try:
            res[name] = fn()
        except Exception as err:  # noqa: BLE001
            res[name] = f"ERR:{type(err).__name__}"

    def allreduce(dtype, op):
        t = values(rank, 5, dtype)
        dist.all_reduce(t, op=op)
        return t

    for dtype in INT_TYPES + FLOAT_TYPES + [torch.bool]:
        for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX):
            case(f"all_reduce/{dtype}/{op}", lambda d=dtype, o=op: allreduce(d, o))
    for dtype in INT_TYPES + [torch.bool]:
        for op in (R.BAND, R.BOR, R.BXOR):
            case(f"all_reduce/{dtype}/{op}", lambda d=dtype, o=op: allreduce(d, o))
    case("all_reduce/avg", lambda: allreduce(torch.float32, R.AVG))
    case("all_reduce/complex64", lambda: allreduce_complex(rank))

    def noncontig():
        t = values(rank, 12, torch.float32).reshape(3, 4).t()
        dist.all_reduce(t)
        return t.clone()
    case("all_reduce/noncontiguous", noncontig)
    case("all_reduce/empty", lambda: allreduce_empty())

    def async_allreduce():
        t = values(rank, 1000, torch.float64)
        w = dist.all_reduce(t, async_op=True)
        w.wait(datetime.timedelta(seconds=30))
        return [t, w.is_completed()]
    case("all_reduce/async", async_allreduce)

    for dtype in (torch.float32, torch.int8, torch.bfloat16, torch.bool):
        def bcast(d=dtype):
            t = values(rank, 7, d)
            dist.broadcast(t, src=1)
            return t
        case(f"broadcast/{dtype}", bcast)

    def reduce(op):
        t = values(rank, 6, torch.int32)
        dist.reduce(t, dst=2, op=op)
        return t if rank == 2 else None
    for op in (R.SUM, R.MAX):
        case(f"reduce/{op}", lambda o=op: reduce(o))

    def all_gather(dtype):
        out = [torch.zeros(3, dtype=dtype) for _ in range(n)]
        dist.all_gather(out, values(rank, 3, dtype))
        return out
    for dtype in (torch.float32, torch.int16, torch.bool):
        case(f"all_gather/{dtype}", lambda d=dtype: all_gather(d))

    def all_gather_into_tensor():
        out = torch.zeros(n * 4, dtype=torch.float64)
        dist.all_gather_into_tensor(out, values(rank, 4, torch.float64))
        return out
    case("all_gather_into_tensor", all_gather_into_tensor)

    def all_gather_object():
        out = [None] * n
        dist.all_gather_object(out, {"rank": rank, "s": "x" * rank})
        return out
    case("all_gather_object", all_gather_object)

    def reduce_scatter():
        out = torch.zeros(3, dtype=torch.float32)
        dist.reduce_scatter(out, [values(rank, 3, torch.float32, salt=i) for i in range(n)])
        return out
    case("reduce_scatter", reduce_scatter)

    def reduce_scatter_tensor():
        out = torch.zeros(2, dtype=torch.int64)
        dist.reduce_scatter_tensor(out, values(rank, 2 * n, torch.int64), op=R.MAX)
        return out
    case("reduce_scatter_tensor", reduce_scatter_tensor)

    def all_to_all():
        ins = [values(rank, j + 1, torch.float32, salt=10 * j) for j in range(n)]
        outs = [torch.zeros(rank + 1, dtype=torch.float32) for _ in range(n)]
        dist.all_to_all(outs, ins)
        return outs
    case("all_to_all", all_to_all)

    def all_to_all_single(uneven):
        if uneven:
            in_splits = [(rank + j) % 3 + 1 for j in range(n)]
            out_splits = [(j + rank) % 3 + 1 for j in range(n)]
        else:
            in_splits = out_splits = None
        rows = sum(in_splits) if in_splits else 2 * n
        inp = values(rank, rows * 2, torch.int32).reshape(rows, 2)
        out_rows = sum(out_splits) if out_splits else 2 * n
        out = torch.zeros(out_rows, 2, dtype=torch.int32)
        dist.all_to_all_single(out, inp, out_splits, in_splits)
        return out
    case("all_to_all_single/even", lambda: all_to_all_single(False))
    case("all_to_all_single/uneven", lambda: all_to_all_single(True))

    def gather():
        out = [torch.zeros(4, dtype=torch.int64) for _ in range(n)] if rank == 1 else None
        dist.gather(values(rank, 4, torch.int64), out, dst=1)
        return out
    case("gather", gather)

    def scatter():
        out = torch.zeros(3, dtype=torch.float32)
        ins = [values(j, 3, torch.float32, salt=5) for j in range(n)] if rank == 3 else None
        dist.scatter(out, ins, src=3)
        return out
    case("scatter", scatter)

    def broadcast_object_list():
        objs = [{"a": 1, "b": [1, 2]}, "text"] if rank == 0 else [None, None]
        dist.broadcast_object_list(objs, src=0)
        return objs
    case("broadcast_object_list", broadcast_object_list)

    case("barrier", lambda: dist.barrier() or "ok")

    def ring():
        buf = torch.zeros(4, dtype=torch.float32)
        mine = values(rank, 4, torch.float32)
        if rank % 2 == 0:
            dist.send(mine, (rank + 1) % n)
            dist.recv(buf, (rank - 1) % n)
        else:
            dist.recv(buf, (rank - 1) % n)
            dist.send(mine, (rank + 1) % n)
        return buf
    case("send_recv", ring)

    def healthy_source():
        from hpct.distributed import healthy_source as pick
        got = [pick(rank != 0, progress=[9, 7, 8, 8][rank]),     # rank 0 is furthest but lost its state
               pick(True),
               pick(rank in (1, 3), progress=5)]
        for healthy, progress in ((False, 3), (True, -1)):
            try:
                got.append(pick(healthy, progress=progress))
            except (RuntimeError, ValueError) as err:
                got.append(f"{type(err).__name__}: {err}")
        return got
    case("healthy_source", healthy_source)

    def subgroup():
        g = dist.new_group([1, 3])
        if rank in (1, 3):
            t = values(rank, 4, torch.int64)
            dist.all_reduce(t, group=g)
            return t
        return None
    case("new_group/all_reduce", subgroup)
    return res


def allreduce_complex(rank):
    t = torch.complex(values(rank, 3, torch.float32), values(rank, 3, torch.float32, salt=1))
    dist.all_reduce(t)
    return t


def allreduce_empty():
    t = torch.zeros(0, dtype=torch.float32)
    dist.all_reduce(t)
    return t


def abort_scenario(out: Path, rank: int) -> int:
    """Abort with an allreduce in flight on the group's worker and a SIGSTOPped peer."""
    import hpct.distributed as hd
    hd.init_process_group(timeout=120)          # the op timeout is not what ends the op
    dist.barrier()
    (out / f"ready-{rank}").write_text("")
    while not (out / "go").exists():
        time.sleep(0.01)
    t = torch.ones(1 << 16)
    work = dist.all_reduce(t, async_op=True)    # blocks: rank 2 is stopped
    time.sleep(0.5)
    t0 = time.monotonic()
    hd.abort_all("test abort")
    try:
        work.wait()
        outcome = "completed"
    except hd.HpctError as err:
        outcome = str(err)
    t_wait = time.monotonic() - t0
    hd.shutdown_all()
    t_all = time.monotonic() - t0
    later = dist.is_initialized()
    (out / f"abort-{rank}.json").write_text(__import__("json").dumps(
        {"outcome": outcome, "wait_s": t_wait, "shutdown_s": t_all, "initialized_after": later}))
    sys.stdout.flush()
    os._exit(0)


def torch_form_scenario(out: Path, rank: int, n: int) -> int:
    """The documented torch form, TORCH_DIST_INIT_BARRIER=1, and more live groups than
    HPCT_PORT_SLOTS=2 (which no longer caps hpct groups: they all share one port)."""
    import json

    import hpct.distributed as hd
    dist.init_process_group("hpct", store=dist.HashStore(), rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=60))
    res = {"backend": dist.get_backend()}
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    res["sum"] = t.item()
    g1 = dist.new_group(list(range(n)))
    res["g1"] = [g1.group_index, g1.context.peers[rank][1]]
    g2 = dist.new_group(list(range(n)))         # 3 groups alive with HPCT_PORT_SLOTS=2
    t = torch.ones(1)
    dist.all_reduce(t, group=g2)
    res["g2"] = [g2.group_index, g2.context.peers[rank][1], t.item()]
    dist.destroy_process_group(g1)
    g3 = dist.new_group([0, 1])
    if rank in (0, 1):
        t = torch.tensor([1.0])
        dist.all_reduce(t, group=g3)
        res["g3"] = [g3.group_index, g3.context.peers[rank][1], t.item()]
    res["groups"] = [pg.group_index for pg in hd.live_groups()]
    (out / f"torchform-{rank}.json").write_text(json.dumps(res))
    quit_together()
    return 0


def main() -> int:
    backend, out = sys.argv[1], Path(sys.argv[2])
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "abort":
        return abort_scenario(out, rank)
    if backend == "torchform":
        return torch_form_scenario(out, rank, n)
    extra = {}
    if backend == "hpct":
        import hpct.distributed as hd
        hd.init_process_group(timeout=60)
        extra["sockets_after_init"] = tcp_sockets()
    else:
        dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=60))
    res = run_cases(rank, n)
    if backend == "hpct":
        extra["sockets_end"] = tcp_sockets()
    torch.save({"results": res, **extra}, out / f"{backend}-{rank}.pt")
    quit_together()
    return 0


def quit_together() -> None:
    """Leave with the peers: a last barrier, then a clean tear-down of every group."""
    dist.barrier()
    if dist.get_backend() == "hpct":
        import hpct.distributed as hd
        hd.shutdown_all()
    else:
        dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
