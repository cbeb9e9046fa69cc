#!/usr/bin/env python3
"""A start-up and recovery model for 1K-100K ranks, fed by benchmarks/scale.py's measurements.

    python benchmarks/scale.py --json scale.json
    python benchmarks/model.py --inputs scale.json [--png docs/scale-model.png] [--n 1000,...]

Every cost comes from scale.py's micro-measurements on this machine (one connect, one
message hop, one store request, one Python + torch start); every assumption is a
named constant or formula below.  The measured scale runs are printed and plotted
beside the curves.  See docs/scale.md for the reasoning.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

SCHEMA = 1
DEFAULT_N = (1000, 2000, 4000, 8000, 16000, 32000, 64000, 100000)
OPEN_FILES_DEFAULT = 1024      # the usual soft RLIMIT_NOFILE
BASE_FDS = 16                  # a rank's descriptors besides its sockets (measured: 8-18)
NCCL_STAGGER_RANKS = 256       # NCCL's bootstrap root staggers connects beyond this many ranks
NCCL_CONNECTS_PER_S = 7000     # ... at this rate
# NCCL init's allgathers, per pin: the bytes each rank adds to each (2.21.5: bootstrapInit's
# listen, proxy and UDS addresses, then initTransportsRank's peer info and topology (allGather3);
# 2.30.7: ringAllInfo, peer info, allGather3, the first collective's lazy-connect ring info; the
# struct sizes as benchmarks/nccl_bootstrap.py's harness reports them), and whether its ring
# allgather is bidirectional (2.28.9+: N/2 steps, else N-1).  Stock NCCL gathers them over
# its ring; hpct's rootless comm over the log-depth exchange (issue 60).
NCCL_INIT_ALLGATHERS = {"2.21.5": ((28, 28, 8, 96, 1220), False), "2.30.7": ((120, 144, 2304, 2), True)}
NCCL_MODEL_PIN = "2.21.5"      # torch 2.6.0's
CONNECT_HOPS = 4               # a connect and its handshake: two round trips
NET_HOP_S = 100e-6             # a cluster network's hop for the second scenario (issue 60: 25-100 us)
NCCL_BOOTSTRAP_GOAL_S = 0.020  # issue 60: NCCL's bootstrap at 100K ranks with loopback costs ...
NCCL_BOOTSTRAP_NET_GOAL_S = 0.5   # ... and with a 100 us hop
STARTUP_GOAL_S = 1.0           # issue 60: the whole hpct start-up to the first collective at 100K
# The published figure issue 60 compares with: stock NCCL's init at 96K GPUs (Meta's NCCLX paper,
# arXiv 2510.20171).
STOCK_NCCL_PUBLISHED = (98304, 265.0, "stock NCCL init at 96K GPUs, published (NCCLX, arXiv 2510.20171)")
STORE_OPS_PER_RANK = 2         # a rank sets its address, then gets every other rank's: 1 + (N-1) requests
GLOO_TARGET_S = 5.0            # issue 20 item 4: start-up of a 100K-rank hpct group
DETECT_HOPS = 0.5              # a failure notice reaches a rank after ~N/2 hops on a ring, log2 N on a tree


def stock_startup(n: int, c: dict) -> dict:
    """Stock: N^2 store requests served by one store, N-1 connects per rank, NCCL's root.
    ``gloo`` is the part scale.py measures (store, mesh, first all_reduce)."""
    store = n * (1 + (n - 1)) * c["store_op_s"]                        # serialised at rank 0's store
    mesh = (n - 1) * c["conn_s"]                                        # each rank's connects, ranks in parallel
    first = 2 * (n - 1) * c["hop_s"]                                    # the first ring all_reduce
    root = n * c["conn_s"] + max(0, n - NCCL_STAGGER_RANKS) / NCCL_CONNECTS_PER_S
    rings = nccl_bootstrap(n, c, log=False)["total"]
    gloo = store + mesh + first
    return {"total": gloo + root + rings, "gloo": gloo, "store": store}


def log_rounds(n: int) -> int:
    """ceil(log2 N): rounds of the log-depth exchange (0 for one rank)."""
    return (max(n, 1) - 1).bit_length()


def nccl_bootstrap(n: int, c: dict, log: bool = True) -> dict:
    """NCCL init's allgathers at N ranks: ``latency`` (connects and hops one after the other),
    ``bytes`` (what every rank receives, the same for every allgather algorithm) and ``total``.

    log: the exchange forms in ceil(log2 N) rounds (a connect with its handshake, then the
    next address, one hop) and each allgather takes ceil(log2 N) hops.  Ring: one connect,
    then N-1 (or N/2) hops per allgather.  c["nccl_pin"] picks the pin (default 2.21.5)."""
    sizes, bidirectional = NCCL_INIT_ALLGATHERS[c.get("nccl_pin", NCCL_MODEL_PIN)]
    data = (n - 1) * sum(sizes) * c.get("byte_s", 0.0)
    if log:
        k = log_rounds(n)
        latency = k * (c["conn_s"] + c["hop_s"]) + len(sizes) * k * c["hop_s"]
    else:
        steps = n // 2 if bidirectional else n - 1
        latency = c["conn_s"] + len(sizes) * steps * c["hop_s"]
    return {"latency": latency, "bytes": data, "total": latency + data}


def network_costs(c: dict, hop_s: float = NET_HOP_S) -> dict:
    """The loopback costs with a network's hop: a connect with its handshake is CONNECT_HOPS
    hops more; bytes keep the loopback cost (a 100 Gb/s link moves them about as fast)."""
    return {**c, "hop_s": hop_s, "conn_s": c["conn_s"] + CONNECT_HOPS * (hop_s - c["hop_s"])}


def first_allreduce_hops(n: int) -> int:
    """Message hops of hpct's first (small) all_reduce: recursive doubling among the largest
    power of two p <= N, plus a fold in and out for the N - p others (src/gloo_ext/small.cpp)."""
    p = 1 << (max(n, 2).bit_length() - 1)
    return int(math.log2(p)) + (2 if p < n else 0)


def hpct_startup(n: int, c: dict) -> dict:
    """hpct: no store, no root; a group forms on a binomial tree of lazy pairs (log2 N + 1
    connects, 2 log2 N hops); its first all_reduce is recursive doubling, whose partners
    rank ^ 2^k include the tree's (at most log2 N - 1 new connects, one per step, in the
    worst case); NCCL's rootless bootstrap gathers in log depth (nccl_bootstrap).
    ``gloo`` is the part scale.py measures (formation, first all_reduce)."""
    depth = math.ceil(math.log2(max(n, 2)))
    form = (depth + 1) * c["conn_s"] + 2 * depth * c["hop_s"]
    first = max(depth - 1, 0) * c["conn_s"] + first_allreduce_hops(n) * c["hop_s"]
    nccl = nccl_bootstrap(n, c)["total"]
    return {"total": form + first + nccl, "gloo": form + first, "form": form, "nccl": nccl}


def stock_rank0_fds(n: int) -> int:
    """Rank 0 holds its N-1 mesh sockets and the store's N client connections (measured at
    N=256: 514 sockets, 730 descriptors)."""
    return (n - 1) + n + BASE_FDS


def stock_recovery(n: int, c: dict) -> float:
    """Stock: every process restarts (Python + torch), then the whole start-up again."""
    return c["proc_start_s"] + stock_startup(n, c)["total"]


def hpct_recovery(n: int, c: dict) -> float:
    """hpct: the failure notice spreads, survivors abort and form the next generation in place."""
    detect = DETECT_HOPS * n * c["hop_s"]
    return detect + hpct_startup(n, c)["total"]


def _slope(pts) -> float | None:
    """Least squares through the origin: y = k x."""
    pts = [(x, y) for x, y in pts if x > 0]
    return sum(x * y for x, y in pts) / sum(x * x for x, _ in pts) if pts else None


def fitted_costs(runs: list[dict], c: dict) -> dict:
    """The per-rank CPU and store costs that reproduce this machine's scale runs.

    On 2 cores running N processes, start-up is mostly the ranks' own CPU work (start,
    connects, the first all_reduce), served N / CPUs at a time: a term linear in N that a
    cluster, where every rank has its own cores, does not have.  ``rank_s`` is that work
    per rank, fitted to the hpct runs over the loopback model; a store request also waits
    behind N clients, so ``store_op_s`` is fitted to the stock runs."""
    loop = [r for r in runs if r["where"] == "loopback" and r.get("startup_s")]
    cpus = os.cpu_count() or 1
    rank = _slope((r["n"] / cpus, r["startup_s"] - hpct_startup(r["n"], c)["gloo"])
                  for r in loop if r["stack"] == "hpct-lazy") or 0.0
    store = _slope((r["n"] ** 2, r["startup_s"] - stock_startup(r["n"], {**c, "store_op_s": 0})["gloo"]
                    - r["n"] / cpus * rank)
                   for r in loop if r["stack"] == "stock") or c["store_op_s"]
    return {**c, "rank_s": max(rank, 0.0), "store_op_s": max(store, c["store_op_s"])}


def on_this_machine(f, n: int, c_fit: dict) -> float:
    """The Gloo part of ``f`` (stock_startup or hpct_startup) with N ranks sharing this machine's CPUs."""
    return f(n, c_fit)["gloo"] + n / (os.cpu_count() or 1) * c_fit["rank_s"]


def load(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        sys.exit(f"model.py: cannot read {path}: {err}\n  fix: run benchmarks/scale.py --json {path} first")
    if doc.get("schema") != SCHEMA or "costs" not in doc or "runs" not in doc:
        sys.exit(f"model.py: {path} is not a scale.py result of schema {SCHEMA}\n"
                 f"  fix: write it again with this checkout's benchmarks/scale.py --json")
    missing = [k for k in ("conn_s", "hop_s", "store_op_s", "proc_start_s") if doc["costs"].get(k) is None]
    if missing:
        sys.exit(f"model.py: {path} lacks the costs {', '.join(missing)} (torch missing when it ran?)\n"
                 "  fix: run scale.py where torch is installed")
    return doc


def table(ns, c: dict) -> str:
    lines = ["| N | stock start-up (s) | hpct start-up (s) | stock/hpct | stock recovery (s) | "
             "hpct recovery (s) | stock/hpct | conns per rank stock / hpct | stock rank 0 over 1024 fds |",
             "|---" * 9 + "|"]
    for n in ns:
        s, h = stock_startup(n, c)["total"], hpct_startup(n, c)["total"]
        sr, hr = stock_recovery(n, c), hpct_recovery(n, c)
        conns = f"{n - 1} / {n.bit_length()}"          # doubling partners + the fold partner
        lines.append(f"| {n} | {s:.2f} | {h:.3f} | {s / h:.0f}x | {sr:.2f} | {hr:.3f} | {sr / hr:.0f}x | "
                     f"{conns} | {'yes' if stock_rank0_fds(n) > OPEN_FILES_DEFAULT else 'no'} |")
    return "\n".join(lines)


def stock_nccl_bootstrap(n: int, c: dict) -> float:
    """Stock NCCL's bootstrap alone: N connects to the root (staggered beyond 256 ranks), then
    its ring allgathers.  Its init does more (topology, connections): the published figure is
    the whole init."""
    return n * c["conn_s"] + max(0, n - NCCL_STAGGER_RANKS) / NCCL_CONNECTS_PER_S + nccl_bootstrap(n, c, log=False)["total"]


def nccl_table(ns, c: dict) -> str:
    """NCCL's bootstrap: stock's (root and ring), hpct's rootless ring (before issue 60) and its log
    depth, with the loopback costs and a network's hop, and the whole hpct start-up to the first
    collective; the published stock figure beside them."""
    net = network_costs(c)
    hop = f"{NET_HOP_S * 1e6:.0f} us hop"
    lines = [f"| N | stock NCCL bootstrap, root + ring, model (s) | hpct rootless ring (s) | hpct log depth: latency "
             f"+ bytes (s) | hpct log depth, {hop} (s) | hpct start-up to first collective, loopback / {hop} (s) |",
             "|---" * 6 + "|"]
    pub_n, pub_s, pub_what = STOCK_NCCL_PUBLISHED
    for n in sorted(set(ns) | {pub_n}):
        ring, log, lognet = nccl_bootstrap(n, c, log=False), nccl_bootstrap(n, c), nccl_bootstrap(n, net)
        stock = f"{stock_nccl_bootstrap(n, c):.1f}" + (f" ({pub_what}: {pub_s:.0f} s)" if n == pub_n else "")
        lines.append(f"| {n} | {stock} | {ring['total']:.3f} | {log['total']:.4f} = {log['latency']:.4f} + "
                     f"{log['bytes']:.4f} | {lognet['total']:.4f} | {hpct_startup(n, c)['total']:.3f} / "
                     f"{hpct_startup(n, net)['total']:.3f} |")
    return "\n".join(lines)


def nccl_goals(n: int, c: dict) -> str:
    """Issue 60's goals at N, each with what the model gives and whether it is met."""
    net = network_costs(c)
    log, lognet, start = nccl_bootstrap(n, c), nccl_bootstrap(n, net), hpct_startup(n, c)["total"]
    met = lambda v, goal: f"{v * 1e3:.1f} ms (goal <= {goal * 1e3:g} ms: {'met' if v <= goal else 'NOT met'})"
    return (f"at N = {n}: NCCL's rootless bootstrap with loopback costs {met(log['total'], NCCL_BOOTSTRAP_GOAL_S)}, "
            f"of which latency {log['latency'] * 1e3:.1f} ms and bytes {log['bytes'] * 1e3:.1f} ms; "
            f"with a {NET_HOP_S * 1e6:.0f} us hop {met(lognet['total'], NCCL_BOOTSTRAP_NET_GOAL_S)}; "
            f"hpct start-up to the first collective {met(start, STARTUP_GOAL_S)}")


def fit_table(runs: list[dict], c: dict, c_fit: dict) -> str:
    lines = ["| stack | N | measured start-up (s) | model, loopback costs (s) | model, this machine's costs (s) |",
             "|---|---|---|---|---|"]
    for r in runs:
        if r["where"] != "loopback" or r["stack"] not in ("stock", "hpct-lazy") or not r.get("startup_s"):
            continue
        f = stock_startup if r["stack"] == "stock" else hpct_startup
        lines.append(f"| {r['stack']} | {r['n']} | {r['startup_s']:.3f} | {f(r['n'], c)['gloo']:.3f} | "
                     f"{on_this_machine(f, r['n'], c_fit):.3f} |")
    return "\n".join(lines)


def plot(path: str, runs: list[dict], c: dict, c_fit: dict) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("model.py: --png needs matplotlib\n  fix: pip install 'hpct[bench]' (or matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = [int(2 ** (k / 4)) for k in range(4 * 2, 4 * 17 + 1)]            # 4 .. 131072
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for label, f, style in (("stock start-up", lambda n, k: stock_startup(n, k)["total"], "C3-"),
                            ("stock recovery (full restart)", stock_recovery, "C3--"),
                            ("hpct start-up", lambda n, k: hpct_startup(n, k)["total"], "C0-"),
                            ("hpct recovery (in-process)", hpct_recovery, "C0--")):
        ax.plot(ns, [f(n, c) for n in ns], style, label=f"{label}, loopback costs")
    for label, f, style in (("stock Gloo start-up", stock_startup, "C3:"), ("hpct Gloo start-up", hpct_startup, "C0:")):
        ax.plot(ns, [on_this_machine(f, n, c_fit) for n in ns], style, label=f"{label}, this machine's costs")
    for stack, key, marker in (("stock", "startup_s", "C3o"), ("hpct-lazy", "startup_s", "C0o"),
                               ("hpct-lazy", "recovery_s", "C0s")):
        pts = [(r["n"], r[key]) for r in runs if r["stack"] == stack and r["where"] == "loopback" and r.get(key)]
        if pts:
            ax.plot(*zip(*pts), marker, label=f"measured {stack} {key.split('_')[0]} (loopback, {os.cpu_count()} CPUs)")
    ax.set_yscale("log")
    save_plot(fig, ax, path, "Start-up and recovery: model (lines) and scale runs (markers)", "ranks (N)", "seconds")


def save_plot(fig, ax, path: str, title: str, xlabel: str, ylabel: str) -> None:
    """A log-x plot's labels, grid and legend, written through a temporary name (goodput_model.py too)."""
    import matplotlib.pyplot as plt
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", required=True, help="scale.py --json output")
    ap.add_argument("--png", help="write the plot here")
    ap.add_argument("--n", default=",".join(map(str, DEFAULT_N)), help="world sizes to predict")
    args = ap.parse_args(argv)
    doc = load(args.inputs)
    c = doc["costs"]
    c_fit = fitted_costs(doc["runs"], c)
    ns = [int(x) for x in args.n.split(",") if x]
    print("inputs (loopback micro-costs): " + ", ".join(f"{k}={v:.3g}" for k, v in c.items()))
    print(f"this machine's costs, fitted to the scale runs: rank_s={c_fit['rank_s']:.3g} (CPU per rank, "
          f"N ranks sharing {os.cpu_count()} CPUs), store_op_s={c_fit['store_op_s']:.3g}")
    print()
    print("Predicted with the loopback costs (a cluster's hop is of this order; see docs/scale.md):\n")
    print(table(ns, c))
    print()
    big = max(ns)
    h = hpct_startup(big, c)
    print(f"hpct at N = {big}: the Gloo group (formation + first all_reduce, both log depth) "
          f"{h['gloo']:.3f} s (target <= {GLOO_TARGET_S:g} s: {'met' if h['gloo'] <= GLOO_TARGET_S else 'NOT met'}); "
          f"with NCCL's rootless bootstrap in log depth {h['total']:.3f} s")
    if "byte_s" not in c:
        print("(these inputs have no byte_s: NCCL's bytes are left out; benchmarks/nccl_bootstrap.py measures it)")
    print()
    print("NCCL's bootstrap, ring against log depth:\n")
    print(nccl_table(ns, c))
    print()
    print(nccl_goals(big, c))
    print()
    print("Measured against the model (the Gloo part that scale.py measures):\n")
    print(fit_table(doc["runs"], c, c_fit))
    if args.png:
        plot(args.png, doc["runs"], c, c_fit)
        print(f"\nplot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
