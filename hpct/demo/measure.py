"""Measurements shared by benchmarks/ and `hpct demo`: start-up and recovery, hpct vs stock.

Ranks are forked (os.fork) from a parent that has already imported torch and hpct, so that
"process start" means the moment the rank exists and the measurement is the
rendezvous and connect, not the ~2 s import of torch (equal for both stacks; see
recovery.py for the full-restart path, which does pay it).  Every rank reports one
JSON object through a pipe; the parent kills every rank still alive at the deadline.
"""

from __future__ import annotations

import datetime
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import hpct.distributed as hd


from .agent import free_port_block  # noqa: F401  (re-exported)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hpct_env(rank: int, world: int, base: int, generation: int = 0, connect_timeout: float = 60) -> None:
    """Configure this (forked) process for the hpct port plan on one node."""
    for k in [k for k in os.environ if k.startswith("HPCT_")]:
        del os.environ[k]
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "N_PROC_PER_NODE": str(world),
                       "HPCT_PORT_BASE": str(base), "HPCT_GENERATION": str(generation),
                       "HPCT_CONNECT_TIMEOUT": str(connect_timeout)})
    # NCCL_SOCKET_RETRY_DELAY (connect retry, ms) keeps hpct's default (100) unless set


class Ranks:
    """Forked ranks, each running fn(*args) and reporting its return value (JSON)."""

    def __init__(self, deadline_s: float):
        self.deadline = time.monotonic() + deadline_s
        self.children: dict[int, tuple[int, int]] = {}   # key -> (pid, read fd)
        self.results: dict = {}

    def fork(self, key, fn, *args) -> int:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 0
            try:
                res = fn(*args)
            except BaseException as err:  # noqa: BLE001
                res = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
                code = 1
            try:
                os.write(w, json.dumps(res).encode())
            finally:
                os._exit(code)
        os.close(w)
        self.children[key] = (pid, r)
        return pid

    def kill(self, key) -> None:
        pid, _ = self.children[key]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def collect(self, keys=None) -> dict:
        keys = list(self.children) if keys is None else list(keys)
        bufs = {k: b"" for k in keys}
        open_fds = {self.children[k][1]: k for k in keys}
        while open_fds:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.kill_all()
                raise TimeoutError(f"ranks {sorted(open_fds.values())} did not report before the deadline")
            ready, _, _ = select.select(list(open_fds), [], [], min(left, 1.0))
            for fd in ready:
                chunk = os.read(fd, 65536)
                if chunk:
                    bufs[open_fds[fd]] += chunk
                else:
                    os.close(fd)
                    del open_fds[fd]
        for k in keys:
            pid = self.children[k][0]
            os.waitpid(pid, 0)
            self.results[k] = json.loads(bufs[k]) if bufs[k] else {"error": "no report (killed?)"}
        return {k: self.results[k] for k in keys}

    def kill_all(self) -> None:
        for k, (pid, _) in self.children.items():
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def check(results: dict, what: str) -> None:
    bad = {k: v for k, v in results.items() if "error" in v}
    if bad:
        k, v = next(iter(bad.items()))
        sys.exit(f"{what}: rank {k} failed: {v['error']}\n{v.get('trace', '')}")


def table(headers: list[str], rows: list[list], title: str) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) if i == 0 and not c.replace(".", "").isdigit() else c.rjust(w)
                              for i, (c, w) in enumerate(zip(r, widths))) + " |" for r in cells]
    return "\n".join([title, "", line, sep, *body])


def median(xs) -> float:
    return statistics.median(xs)


# ---- start-up ----

def first_allreduce() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    done = time.time()
    assert t.item() == dist.get_world_size()
    return done


def quit_barrier() -> None:
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 -- a rank that left first may reset it
        pass


ORDERS = ("in order", "reverse", "random", "one late")
STAGGER_S = 0.005         # between arrivals in the ordered runs
LATE_S = 2.0              # how late the late rank is ("one late": rank 0, the one others dial)


def arrivals(order: str, n: int) -> list[float]:
    """Seconds after the release at which each rank starts, for one arrival order."""
    if order == "in order":
        return [STAGGER_S * r for r in range(n)]
    if order == "reverse":
        return [STAGGER_S * (n - 1 - r) for r in range(n)]
    if order == "random":
        import random
        perm = list(range(n))
        random.Random(n).shuffle(perm)
        return [STAGGER_S * perm[r] for r in range(n)]
    if order == "one late":
        return [LATE_S] + [0.0] * (n - 1)
    raise ValueError(f"unknown arrival order {order!r}; one of {', '.join(ORDERS)}")


def hpct_rank(rank: int, n: int, base: int) -> float:
    hpct_env(rank, n, base)
    hd.init_process_group(timeout=60)
    done = first_allreduce()
    quit_barrier()
    return done


def raw_rank(rank: int, n: int, base: int) -> float:
    """hpct's storeless context alone (lazy pairs), as the backend builds it."""
    import array
    from .. import _gloo
    ctx = _gloo.Context(rank, n, 1, [("127.0.0.1", base + r) for r in range(n)], timeout=60,
                        connect_timeout=60, lazy=True)
    buf = array.array("f", [1.0])
    ctx.allreduce(buf)
    done = time.time()
    assert buf[0] == n
    ctx.barrier()
    ctx.close()
    return done


def patched_env(rank: int, world: int, base: int, generation: int = 0) -> None:
    """hpct's patched torch (hpct-build wheel torch=2.6.0): its own rootless path, same plan."""
    hpct_env(rank, world, base, generation=generation)
    os.environ["HPCT_USE_ROOTLESS"] = "1"


def patched_rank(rank: int, n: int, base: int) -> float:
    """torch's own init_process_group("gloo") in hpct's patched torch: no store, no root."""
    patched_env(rank, n, base)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    done = first_allreduce()
    quit_barrier()
    return done


def stock_rank(rank: int, n: int, port: int) -> float:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=60))
    done = first_allreduce()
    quit_barrier()
    return done


def _released(go: int, delay: float, fn, *args) -> dict:
    os.read(go, 1)
    time.sleep(delay)
    arrived = time.time()
    return {"arrived": arrived, "done": fn(*args)}


def startup(kind: str, n: int, order: str = "in order") -> dict:
    """One start-up of N forked ranks released together, each arriving per ``order``.

    kind: hpct (the backend), raw (the storeless context alone), stock (Gloo + TCPStore),
    patched (torch's own gloo in hpct's patched torch, HPCT_USE_ROOTLESS=1).
    Returns seconds from the release to the last rank's first all_reduce (``total``) and
    from the last arrival to it (``after_last``: what a late rank costs).
    """
    delays = arrivals(order, n)
    ranks = Ranks(deadline_s=90)
    go_r, go_w = os.pipe()
    if kind == "stock":
        port = free_port()
        fn, extra = stock_rank, (port,)
    else:
        base = free_port_block(8 * n)
        fn, extra = {"raw": raw_rank, "patched": patched_rank}.get(kind, hpct_rank), (base,)
    for r in range(n):
        ranks.fork(r, _released, go_r, delays[r], fn, r, n, *extra)
    os.close(go_r)
    time.sleep(0.2)               # every child is waiting on the pipe
    release = time.time()
    os.write(go_w, b"x" * n)
    os.close(go_w)
    res = ranks.collect()
    check(res, f"{kind} N={n} ({order})")
    done = max(v["done"] for v in res.values())
    return {"total": done - release, "after_last": done - max(v["arrived"] for v in res.values())}


# ---- recovery ----

RECOVERY_DEADLINE_S = 120        # every rank of a recovery reports by then, or the run counts as hung

def loop_until_failure(ready: Path) -> float:
    t = torch.ones(1)
    ready.write_text("")
    while True:
        try:
            dist.all_reduce(t)
        except Exception:  # noqa: BLE001 -- the fault
            return time.time()
        t.fill_(1)
        time.sleep(0.002)


def one_allreduce() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    return time.time()


def hpct_recovering_rank(rank, n, base, ready_dir, generation, late=0.0):
    time.sleep(late)
    hpct_env(rank, n, base, generation=generation)
    hd.init_process_group(timeout=60)
    if generation == 0:
        t_fail = loop_until_failure(Path(ready_dir) / f"{rank}")
        hd.recover()
    else:
        t_fail = None
    done = one_allreduce()
    quit_barrier()
    return {"fail": t_fail, "done": done}


def patched_recovering_rank(rank, n, base, ready_dir, generation, late=0.0):
    """A rank of hpct's patched torch: a survivor destroys the world and forms it again in its
    process (the next generation, on the same ports); the replacement joins at that generation."""
    time.sleep(late)
    patched_env(rank, n, base, generation=generation)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", timeout=timeout)
    t_fail = None
    if generation == 0:
        t_fail = loop_until_failure(Path(ready_dir) / f"{rank}")
        dist.destroy_process_group()
        dist.init_process_group("gloo", timeout=timeout)
    done = one_allreduce()
    quit_barrier()
    return {"fail": t_fail, "done": done}


def stock_recovering_rank(rank, n, ports, ready_dir, generation, op_timeout, late=0.0):
    time.sleep(late)
    timeout = datetime.timedelta(seconds=op_timeout)
    if generation == 0:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                                world_size=n, timeout=timeout)
        t_fail = loop_until_failure(Path(ready_dir) / f"{rank}")
        dist.destroy_process_group()
    else:
        t_fail = None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank,
                            world_size=n, timeout=timeout)
    done = one_allreduce()
    quit_barrier()
    return {"fail": t_fail, "done": done}


def recovery_in_process(kind: str, n: int, op_timeout: float = 5.0, late: float = 0.0) -> float:
    """Seconds from the SIGKILL of the last rank to the rebuilt group's first all_reduce
    (hpct|patched|stock).

    ``late``: the replacement starts this many seconds after the kill (a spare that is slow
    to come up); the survivors are already waiting for it."""
    victim = n - 1
    with tempfile.TemporaryDirectory() as ready_dir:
        ranks = Ranks(deadline_s=RECOVERY_DEADLINE_S)
        if kind in ("hpct", "patched"):
            base = free_port_block(8 * n)
            fn, extra = (hpct_recovering_rank if kind == "hpct" else patched_recovering_rank), (base,)
            tail = (0.0,)
        else:
            ports = (free_port(), free_port())
            fn, extra = stock_recovering_rank, (ports,)
            tail = (op_timeout, 0.0)
        for r in range(n):
            ranks.fork(r, fn, r, n, *extra, ready_dir, 0, *tail)
        end = time.monotonic() + 60
        while len(os.listdir(ready_dir)) < n:
            if time.monotonic() > end:
                ranks.kill_all()
                raise TimeoutError(f"{kind} N={n}: ranks not ready")
            time.sleep(0.01)
        time.sleep(0.2)
        t_fault = time.time()
        ranks.kill(victim)
        ranks.collect([victim])
        ranks.children.pop(victim)
        ranks.fork("replacement", fn, victim, n, *extra, ready_dir, 1, *tail[:-1], late)
        res = ranks.collect()
    check(res, f"{kind} N={n}")
    return max(v["done"] for v in res.values()) - t_fault


RESTART = """
import sys, time, datetime
import torch, torch.distributed as dist
rank, n, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                        timeout=datetime.timedelta(seconds=60))
t = torch.ones(1); dist.all_reduce(t); print(time.time(), flush=True)
try:
    dist.barrier()
except Exception:
    pass
import os; os._exit(0)
"""


def full_restart(n: int) -> float:
    """Seconds for N fresh processes (stock Gloo + TCPStore) to run their first all_reduce."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t_fault = time.time()        # the kill of the old job is not counted (it is instant)
    procs = [subprocess.Popen([sys.executable, "-c", RESTART, str(r), str(n), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            if p.returncode != 0:
                raise RuntimeError(f"restart rank failed: {err[-2000:]}")
            done.append(float(out.split()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return max(done) - t_fault


def ddp_restart(n: int, out: Path, deadline: float) -> float:
    """Seconds for N fresh processes of the demo's trainer on stock Gloo + TCPStore to complete their
    first DDP step: torchrun's restart of every process, without its own detection and rendezvous
    (a lower bound of it) and without loading a checkpoint."""
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)}
    argv = [sys.executable, "-m", "hpct.demo.trainer", "train", str(out), "--stock", "--steps", "1", "--fast-exit"]
    t_start = time.time()
    procs = [subprocess.Popen(argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=str(out),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(n)]
    try:
        for p in procs:
            text, _ = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            if p.returncode != 0:
                raise RuntimeError(f"a stock rank exited with {p.returncode}:\n{text[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    records = [json.loads(f.read_text()) for f in out.glob("rank*.json")]
    return max(r["stepped"][0]["t"] for r in records) - t_start
