#!/usr/bin/env python3
"""Scale runs (issue 11): start-up and in-process recovery at N = 64..256 ranks.

Each hpct rank is a process holding only hpct's storeless Gloo context (no torch
import), with lazy pairs (the backend's default) or the full mesh.  All ranks are
started, import, report "ready" and are then released together, so the times are the
rendezvous and connect, not Python's start:
  start-up   release -> the slowest rank's first allreduce (one element);
  recovery   SIGKILL of rank N-1 -> the slowest rank's first allreduce of the next
             generation: survivors blocked in an allreduce learn of the death, close their
             context and form a new one with a replacement (started and imported before
             the kill, released at it) on the same ports.
After each, every rank reports its connected pairs, open descriptors and sockets.

Loopback runs use 127.0.0.1; ``--netns 8x32`` runs 8 network namespaces x 32 ranks with
real addresses on a bridge (root only; the namespaces are deleted afterwards).
Stock PyTorch Gloo (TCPStore on rank 0, full mesh) runs at the sizes of ``--stock`` in
the same invocation: ranks forked from a parent that imported torch, released together.
``--json PATH`` writes everything (and the micro-costs benchmarks/model.py needs).

    python benchmarks/scale.py [--n 64,128,256] [--stock 64,128,256] [--netns 8x32] [--json scale.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpct.ports import free_port_block

REPO = Path(__file__).resolve().parent.parent
PHASE_S = 240.0          # bound on every phase (ready, start-up, recovery)

WORKER = r"""
import array, json, os, sys, time
import hpct._gloo as g
rank, n, cfg = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
peers = [tuple(p) for p in cfg["peers"]]
def say(**kw):
    print(json.dumps(kw), flush=True)
def counts(ctx):
    fds = os.listdir("/proc/self/fd")
    socks = 0
    for f in fds:
        try:
            socks += os.readlink("/proc/self/fd/" + f).startswith("socket:")
        except OSError:
            pass
    return {"conn": ctx.connections(), "fds": len(fds), "sockets": socks}
def form(gen):
    ctx = g.Context(rank, n, gen, peers, timeout=cfg["timeout"], connect_timeout=cfg["timeout"],
                    lazy=cfg["lazy"], bind_retry_timeout=10.0,
                    float_doubling=True)    # the log-depth first all_reduce (HPCT_LOG_ALLREDUCE=1)
    buf = array.array("f", [1.0])
    ctx.allreduce(buf)
    assert buf[0] == n, buf
    return ctx
say(event="ready")
gen = int(sys.stdin.readline().split()[1])
ctx = form(gen)
say(event="formed", done=time.time(), **counts(ctx))
if sys.stdin.readline().startswith("fault"):
    failed = None
    try:
        buf = array.array("f", [1.0])
        ctx.allreduce(buf)          # the victim never joins it
    except g.GlooError:
        failed = time.time()
    ctx.close()
    ctx = form(gen + 1)
    say(event="formed", done=time.time(), failed=failed, **counts(ctx))
    sys.stdin.readline()
ctx.close()
"""


class Fleet:
    """Worker processes driven by lines on stdin, reporting JSON lines on stdout."""

    def __init__(self):
        self.procs: dict[int, subprocess.Popen] = {}
        self.sel = selectors.DefaultSelector()
        self.partial: dict[int, str] = {}

    def start(self, key: int, argv: list[str]) -> None:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd="/", bufsize=1, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.procs[key] = p
        self.partial[key] = ""
        self.sel.register(p.stdout, selectors.EVENT_READ, key)

    def send(self, keys, line: str) -> None:
        for k in keys:
            self.procs[k].stdin.write(line + "\n")
            self.procs[k].stdin.flush()

    def wait(self, keys, event: str, what: str) -> dict[int, dict]:
        """Each of ``keys`` reports ``event`` within PHASE_S, or the run fails naming who did not."""
        want, got = set(keys), {}
        deadline = time.monotonic() + PHASE_S
        while want - set(got):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{what}: ranks {sorted(want - set(got))[:8]} did not report {event} "
                                   f"within {PHASE_S:.0f} s")
            for key_obj, _ in self.sel.select(timeout=min(left, 1.0)):
                k = key_obj.data
                chunk = os.read(key_obj.fileobj.fileno(), 65536).decode()
                if not chunk:
                    self.sel.unregister(key_obj.fileobj)
                    if k in want and k not in got:
                        err = self.procs[k].stderr.read()[-1500:]
                        raise RuntimeError(f"{what}: rank {k} exited before {event}: {err}")
                    continue
                self.partial[k] += chunk
                while "\n" in self.partial[k]:
                    line, self.partial[k] = self.partial[k].split("\n", 1)
                    rec = json.loads(line)
                    if rec.get("event") == event and k in want:
                        got[k] = rec
        return got

    def kill(self, key: int) -> None:
        self.procs[key].kill()
        self.procs[key].wait(timeout=30)
        self.sel.unregister(self.procs[key].stdout)

    def close(self) -> None:
        for p in self.procs.values():
            try:
                p.stdin.close()
            except OSError:
                pass
        end = time.monotonic() + 30
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def summary(reports: dict[int, dict]) -> dict:
    conns = [r["conn"] for r in reports.values()]
    return {"conn_max": max(conns), "conn_mean": round(sum(conns) / len(conns), 2),
            "fds_max": max(r["fds"] for r in reports.values()),
            "sockets_max": max(r["sockets"] for r in reports.values())}


def hpct_run(n: int, lazy: bool, where: str, peers: list, prefix) -> dict:
    """Start-up and recovery of N raw hpct contexts; ``prefix(rank)`` is the argv prefix (netns)."""
    cfg = json.dumps({"peers": peers, "lazy": lazy, "timeout": 120.0})
    fleet = Fleet()
    victim, spare = n - 1, n
    run = {"stack": "hpct-lazy" if lazy else "hpct-mesh", "where": where, "n": n, "error": None}
    try:
        for r in range(n):
            fleet.start(r, [*prefix(r), sys.executable, "-c", WORKER, str(r), str(n), cfg])
        fleet.start(spare, [*prefix(victim), sys.executable, "-c", WORKER, str(victim), str(n), cfg])
        fleet.wait(range(n + 1), "ready", f"{run['stack']} N={n}")
        t_go = time.time()
        fleet.send(range(n), "go 1")
        formed = fleet.wait(range(n), "formed", f"{run['stack']} N={n} start-up")
        run["startup_s"] = round(max(r["done"] for r in formed.values()) - t_go, 4)
        run.update(summary(formed))
        survivors = range(n - 1)
        fleet.send(survivors, "fault")
        time.sleep(0.5)
        t_fault = time.time()
        fleet.kill(victim)
        fleet.send([spare], "go 2")
        again = fleet.wait([*survivors, spare], "formed", f"{run['stack']} N={n} recovery")
        run["recovery_s"] = round(max(r["done"] for r in again.values()) - t_fault, 4)
        run["recovery"] = summary(again)
    except RuntimeError as err:
        run["error"] = str(err)
    finally:
        fleet.close()
    return run


def loopback(n: int, lazy: bool) -> dict:
    base = free_port_block(n)
    return hpct_run(n, lazy, "loopback", [["127.0.0.1", base + r] for r in range(n)], lambda r: [])


def namespaces(nodes: int, per_node: int, lazy: bool) -> dict:
    from hpct.testing.netns import netns_network, unavailable_reason   # the harness the multihost tests use too
    n = nodes * per_node
    why = unavailable_reason()
    if why:
        return {"stack": "hpct-lazy" if lazy else "hpct-mesh", "where": "netns", "n": n, "error": why}
    with netns_network(nodes, "hpct-scale") as ns:
        peers = [[ns[r // per_node].address, 23000 + r % per_node] for r in range(n)]
        return hpct_run(n, lazy, f"netns {nodes}x{per_node}", peers, lambda r: ns[r // per_node].argv([]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="64,128,256", help="comma list of world sizes for hpct")
    ap.add_argument("--mesh", default="64,128,256", help="sizes at which hpct's full mesh also runs ('' for none)")
    ap.add_argument("--stock", default="64,128,256", help="sizes at which stock torch Gloo runs ('' for none)")
    ap.add_argument("--netns", default="8x32", help="NODESxRANKS in network namespaces ('' for none)")
    ap.add_argument("--json", help="write every run and the micro-costs here (for benchmarks/model.py)")
    args = ap.parse_args(argv)
    sizes = lambda text: [int(x) for x in text.split(",") if x]   # noqa: E731
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * max(sizes(args.n) + sizes(args.mesh) + sizes(args.stock) + [64]) + 64
    if soft < need:
        # The parent holds 3 pipes per rank; the ranks themselves stay far below 1024.
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * need), hard))
        print(f"raised this process's open-file limit from {soft} to {min(hard, 4 * need)} "
              "(3 pipes per rank); ranks keep the default", file=sys.stderr)
    runs = []

    def note(run):
        runs.append(run)
        shown = {k: run.get(k) for k in ("stack", "where", "n", "startup_s", "recovery_s", "conn_max", "fds_max",
                                         "error")}
        print(f"  {shown}", file=sys.stderr, flush=True)

    for n in sizes(args.n):
        note(loopback(n, lazy=True))
        if n in sizes(args.mesh):
            note(loopback(n, lazy=False))
    if args.netns:
        nodes, per = (int(x) for x in args.netns.split("x"))
        note(namespaces(nodes, per, lazy=True))
        note(namespaces(nodes, per, lazy=False))
    if sizes(args.stock):
        from scale_stock import stock_run      # imports torch: only when asked
        for n in sizes(args.stock):
            note(stock_run(n))
    from scale_costs import micro_costs
    costs = micro_costs()
    print(render(runs, costs))
    if args.json:
        doc = {"schema": 1, "machine": {"cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")},
               "costs": costs, "runs": runs}
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, args.json)
    return 0 if all(r.get("error") is None for r in runs) else 1


def render(runs: list[dict], costs: dict) -> str:
    head = ("| stack | where | N | start-up [ms] | recovery [ms] | conns/rank max (mean) | fds max | "
            "sockets max | after recovery: conns max | note |")
    lines = [f"Scale runs ({os.cpu_count()} CPUs): release -> slowest rank's first allreduce; "
             "SIGKILL -> first allreduce of the next generation", "", head, "|---" * 10 + "|"]
    ms = lambda s: "-" if s is None else f"{s * 1000:.0f}"   # noqa: E731
    for r in runs:
        rec = r.get("recovery") or {}
        lines.append(f"| {r['stack']} | {r['where']} | {r['n']} | {ms(r.get('startup_s'))} | "
                     f"{ms(r.get('recovery_s'))} | {r.get('conn_max', '-')} ({r.get('conn_mean', '-')}) | "
                     f"{r.get('fds_max', '-')} | {r.get('sockets_max', '-')} | {rec.get('conn_max', '-')} | "
                     f"{(r.get('error') or '')[:120]} |")
    by = {(r["stack"], r["where"], r["n"]): r for r in runs}
    ratios = []
    for (stack, where, n), r in sorted(by.items(), key=lambda kv: kv[0][2]):
        s = by.get(("stock", "loopback", n))
        if stack == "hpct-lazy" and where == "loopback" and s and s.get("startup_s") and r.get("startup_s"):
            ratios.append(f"N={n}: stock/hpct start-up {s['startup_s'] / r['startup_s']:.1f}x"
                          + (f", recovery {s['recovery_s'] / r['recovery_s']:.1f}x"
                             if s.get("recovery_s") and r.get("recovery_s") else ""))
    lines += ["", *ratios, "", "micro-costs (loopback): " + ", ".join(f"{k}={v:.6g}" if v is not None else f"{k}=n/a" for k, v in costs.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
