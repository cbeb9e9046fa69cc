"""What benchmarks/nccl_bootstrap.py makes of its runs: the ring-against-log table, one connect
and one hop fitted from each size's two runs, and the model carried to 100K ranks.

Counting what a run does one thing after another (a rank can do no better than the longest
chain of dependent steps):

* log depth: ceil(log2 N) forming rounds (a connect with its handshake, then the next address,
  one hop), then ceil(log2 N) hops per allgather;
* ring: one connect, then N-1 hops per allgather (2.30.7's bidirectional ring: N/2).

Both receive the same bytes, (N-1) times each allgather's block, at the exchange's cost per
byte.  Take from each run's time the forks (when its last rank started) and those bytes, and
two runs of one size give two equations in the cost of a connect and of a hop.  On 2 CPUs with
N processes these are what a step costs when N ranks share the machine; the model at 100K
takes the costs of one pair of processes instead (a rank with its own CPU, as on a cluster).
"""

from __future__ import annotations

import os
import statistics

import model
import scale_costs

SCHEMA = 1
FIT_N = 100000            # where the goals are judged


def micro_costs(byte_s: float | None) -> dict:
    """One pair of processes on loopback: a connect with its handshake, a hop, a byte (the
    exchange's own allgather when measured, else a Python bulk transfer), and what the stock
    model needs besides (a store request, a process start)."""
    conn, hop = scale_costs.connect_and_hop()
    return {"conn_s": conn, "hop_s": hop, "byte_s": byte_s if byte_s else scale_costs.byte_cost(),
            "byte_source": "the exchange (2-rank allgather)" if byte_s else "Python bulk transfer",
            "store_op_s": scale_costs.store_op(), "proc_start_s": scale_costs.proc_start()}


def chain(n: int, bootstrap: str, allgathers: int, version: str) -> tuple[int, int]:
    """(connects, hops) one after another in a run of ``allgathers`` allgathers."""
    if bootstrap == "log":
        k = model.log_rounds(n)
        return k, k + allgathers * k
    bidirectional = model.NCCL_INIT_ALLGATHERS[version][1]
    return 1, allgathers * (n // 2 if bidirectional else n - 1)


def row(n: int, runs: dict, version: str) -> dict:
    """The median run of each bootstrap at N, with its chain counts."""
    out: dict = {"n": n, "failures": [r for got in runs.values() for r in got if isinstance(r, str)]}
    for b, got in runs.items():
        good = [g for g in got if isinstance(g, dict)]
        if not good:
            out[b] = None
            continue
        med = sorted(good, key=lambda g: g["total_ms"])[len(good) // 2]
        out[b] = dict(med, runs=len(good), total_ms=statistics.median(g["total_ms"] for g in good))
    digests = {tuple(out[b]["digests"]) for b in runs if out.get(b)}
    if len(digests) > 1:
        out["failures"].append(f"N={n}: the bootstraps gathered different bytes: {sorted(digests)}")
    log = out.get("log")
    gathers = log["allgathers"] if log else None
    for b in runs:
        if out.get(b) and gathers:
            out[b]["connects"], out[b]["hops"] = chain(n, b, gathers, version)
    return out


def solve(r: dict, byte_s: float) -> dict | None:
    """One connect and one hop from a size's ring and log runs (forks and bytes taken off)."""
    ring, log = r.get("ring"), r.get("log")
    if not ring or not log or "hops" not in ring:
        return None
    data_s = log["bytes"] * byte_s
    t = [(x["total_ms"] - x["spread_ms"]) / 1e3 - data_s for x in (ring, log)]
    (c1, h1), (c2, h2) = (ring["connects"], ring["hops"]), (log["connects"], log["hops"])
    det = c1 * h2 - c2 * h1
    if det == 0:
        return None
    return {"conn_s": (t[0] * h2 - t[1] * h1) / det, "hop_s": (c1 * t[1] - c2 * t[0]) / det, "bytes_s": data_s}


def report(rows: list[dict], costs: dict, version: str, series_id: str, repeat: int, no_spin: bool) -> dict:
    c = dict(costs, nccl_pin=version)
    sizes = model.NCCL_INIT_ALLGATHERS[version][0]
    lines = [f"NCCL {version} bootstrap on loopback, N forked ranks, harness launch -> the slowest rank's last "
             f"allgather (bootstrapInit's, the rank table, then peer info and allGather3 at this pin's sizes); "
             f"series {series_id}; {os.cpu_count()} CPUs; median of {repeat}; NCCL's sockets "
             f"{'wait in poll() (harness shim)' if no_spin else 'spin'}", "",
             "| N | ring (ms) | log depth (ms) | ring/log | ring/log after the forks | in a row, ring: connects + hops | "
             "in a row, log: connects + hops | connections per rank, log (opened + accepted) | bytes received per "
             "rank | forks, ring / log (ms) |",
             "|---" * 10 + "|"]
    ms = lambda x, k="total_ms": f"{x[k]:.0f}" if x else "failed"
    for r in rows:
        ring, log = r.get("ring"), r.get("log")
        net = lambda x: x["total_ms"] - x["spread_ms"]       # from the last rank's start
        cells = [str(r["n"]), ms(ring), ms(log),
                 f"{ring['total_ms'] / log['total_ms']:.1f}x" if ring and log else "n/a",
                 f"{net(ring) / net(log):.1f}x" if ring and log else "n/a",
                 f"{ring['connects']} + {ring['hops']}" if ring and "hops" in ring else "-",
                 f"{log['connects']} + {log['hops']}" if log and "hops" in log else "-",
                 f"{log['opened']} + {log['accepted']}" if log else "-",
                 str(log["bytes"]) if log else "-",
                 " / ".join(f"{x['spread_ms']:.0f}" if x else "-" for x in (ring, log))]
        lines.append("| " + " | ".join(cells) + " |")
    if any(r.get("stock") for r in rows):
        lines += ["", "stock (NCCL's root): " + ", ".join(f"N={r['n']} {ms(r.get('stock'))} ms" for r in rows)]
    fits = [(r["n"], solve(r, c["byte_s"])) for r in rows]
    fits = [(n, f) for n, f in fits if f]
    lines += ["", f"Fitted from each size's two runs (this machine, N ranks on {os.cpu_count()} CPUs; forks and "
                  f"bytes at {c['byte_s'] * 1e9:.2f} ns/B taken off):", "",
              "| N | one connect (ms) | one hop (us) | bytes (ms) |", "|---|---|---|---|"]
    lines += [f"| {n} | {f['conn_s'] * 1e3:.2f} | {f['hop_s'] * 1e6:.0f} | {f['bytes_s'] * 1e3:.1f} |" for n, f in fits]
    lines += ["", f"One pair of processes (a rank with its own CPU): connect {c['conn_s'] * 1e3:.3f} ms, hop "
                  f"{c['hop_s'] * 1e6:.1f} us, byte {c['byte_s'] * 1e9:.3f} ns ({c['byte_source']}); allgathers "
                  f"per init ({version}): {len(sizes)} of {', '.join(map(str, sizes))} bytes per rank", "",
              "Carried to 100K ranks (benchmarks/model.py; the one-pair costs):", "",
              model.nccl_table(model.DEFAULT_N, c), "", model.nccl_goals(FIT_N, c)]
    if fits:
        n, f = fits[-1]
        here = dict(c, conn_s=max(f["conn_s"], 0.0), hop_s=max(f["hop_s"], 0.0))
        lines += [f"With N = {n}'s fitted costs instead (every rank sharing 2 CPUs with {n - 1} others), NCCL's "
                  f"bootstrap at {FIT_N}: log depth {model.nccl_bootstrap(FIT_N, here)['total']:.2f} s, ring "
                  f"{model.nccl_bootstrap(FIT_N, here, log=False)['total']:.0f} s"]
    return {"schema_version": SCHEMA, "nccl_version": version, "series_id": series_id, "costs": c, "rows": rows,
            "repeat": repeat, "no_spin": no_spin,
            "fits": [dict(f, n=n) for n, f in fits], "text": "\n".join(lines)}
