"""Stock PyTorch Gloo at scale for benchmarks/scale.py: a TCPStore on rank 0 and the full
mesh.  Ranks are forked from this process (which imports torch once) and released
together through one pipe, as scale.py releases hpct's ranks; each reports its first
all_reduce and its descriptors.  Recovery is hpct.demo.measure's stock path
(destroy, a new store, init; the survivors learn of the death by the op timeout)."""

from __future__ import annotations

import datetime
import json
import os
import select
import signal
import time

import torch
import torch.distributed as dist

from hpct.demo.measure import free_port, recovery_in_process

PHASE_S = 240.0
OP_TIMEOUT_S = 5.0


def _descriptors() -> tuple[int, int]:
    fds = os.listdir("/proc/self/fd")
    socks = 0
    for f in fds:
        try:
            socks += os.readlink(f"/proc/self/fd/{f}").startswith("socket:")
        except OSError:
            pass
    return len(fds), socks


def _rank(rank: int, n: int, port: int, go: int, out: int) -> None:
    os.read(go, 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=PHASE_S))
    t = torch.ones(1)
    dist.all_reduce(t)
    done = time.time()
    fds, socks = _descriptors()
    os.write(out, json.dumps({"done": done, "ok": t.item() == n, "fds": fds, "sockets": socks}).encode())
    os.close(out)
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 -- a rank that left first may reset it
        pass


def _startup(n: int) -> dict:
    port = free_port()
    go_r, go_w = os.pipe()
    children = {}
    for r in range(n):
        rd, wr = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(rd)
                _rank(r, n, port, go_r, wr)
            except BaseException:  # noqa: BLE001
                code = 1
            os._exit(code)
        os.close(wr)
        children[rd] = (r, pid)
    t_go = time.time()
    os.write(go_w, b"x" * n)
    reports, bufs = {}, {fd: b"" for fd in children}
    deadline = time.monotonic() + PHASE_S
    try:
        while bufs:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"stock N={n}: {len(bufs)} ranks did not report within {PHASE_S:.0f} s")
            for fd in select.select(list(bufs), [], [], min(left, 1.0))[0]:
                chunk = os.read(fd, 65536)
                if chunk:
                    bufs[fd] += chunk
                    continue
                r = children[fd][0]
                if not bufs[fd]:
                    raise RuntimeError(f"stock N={n}: rank {r} exited without a report")
                reports[r] = json.loads(bufs.pop(fd))
                os.close(fd)
    finally:
        for _, pid in children.values():
            if bufs:                     # a rank failed or hung: end them all
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    if not all(v["ok"] for v in reports.values()):
        raise RuntimeError(f"stock N={n}: wrong all_reduce result")
    socks = [v["sockets"] for v in reports.values()]
    return {"startup_s": round(max(v["done"] for v in reports.values()) - t_go, 4),
            "conn_max": max(socks), "conn_mean": round(sum(socks) / len(socks), 2),
            "fds_max": max(v["fds"] for v in reports.values()), "sockets_max": max(socks)}


def stock_run(n: int) -> dict:
    run = {"stack": "stock", "where": "loopback", "n": n, "error": None,
           "note": "conns = sockets (mesh + store); recovery includes the op timeout"}
    try:
        run.update(_startup(n))
        run["recovery_s"] = round(recovery_in_process("stock", n, op_timeout=OP_TIMEOUT_S), 4)
    except (RuntimeError, TimeoutError, SystemExit) as err:
        run["error"] = str(err)
    return run
