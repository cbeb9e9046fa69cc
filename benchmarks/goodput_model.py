#!/usr/bin/env python3
"""Goodput at 1,000-100,000 GPUs, fed by the per-fault costs benchmarks/goodput.py measured.

    python benchmarks/goodput.py --config 4x4 --minutes 8 --json goodput.json
    python benchmarks/goodput_model.py --inputs goodput.json [--png docs/goodput-model.png]

A fault costs a job the time from the fault to the next step of every rank, plus the work it
must do again.  The soak measures the first part for each system (its SIGKILL faults, median);
the second is 0 for hpct (the survivors keep the state, the replacement receives it) and, for
stock, half a checkpoint interval on average (``--checkpoint-minutes``; the soak's own interval
is a few seconds, a cluster's is tens of minutes).  Faults arrive at ``--rate`` per 1,000 GPUs
per hour, independently, so at N GPUs a job loses ``rate * N / 1000`` faults' costs per hour:

    goodput(N) = max(0, 1 - rate * N / 1000 / 3600 * cost)

Assumptions, named so they can be argued with: the per-fault cost does not grow with N (at
scale stock's restart grows with the rendezvous, NCCL's init and the checkpoint's load;
hpct's repair with its recovery: benchmarks/model.py models those, so this is kind to stock);
no fault lands inside another's recovery; checkpoint writes cost nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

SCHEMA = 1
RATE_FEW_HOURS = 1 / 3.0               # faults per 1,000 GPUs per hour: one every 3 hours (a harsh fleet)
# "The Llama 3 Herd of Models" (arXiv:2407.21783), its reliability section: 419 unexpected
# interruptions in a 54-day snapshot on 16,384 H100s, one every 3 hours for the whole job.
RATE_LLAMA3 = 419 / (54 * 24) / 16.384
CHECKPOINT_MINUTES = 30.0
DEFAULT_N = (1000, 10000, 100000)


def per_fault_costs(doc: dict) -> dict:
    """Each system's measured seconds from a SIGKILL to every rank's next step (median)."""
    if doc.get("benchmark") != "goodput" or doc.get("schema") != 1:
        sys.exit("goodput_model.py: --inputs is not benchmarks/goodput.py --json output (schema 1)\n"
                 "  fix: python benchmarks/goodput.py --json goodput.json")
    costs = {}
    for system, s in doc["systems"].items():
        gaps = [f["next_step_s"] for f in s["faults"] if f["kind"] in ("kill", "during") and f.get("next_step_s")]
        if gaps:
            costs[system] = statistics.median(gaps)
    if not {"hpct", "stock"} <= set(costs):
        sys.exit("goodput_model.py: the soak has no measured SIGKILL fault for both systems\n"
                 "  fix: run goodput.py with --kinds kill (or during) and both --systems, long enough for a fault")
    return costs


def cost(system: str, repair_s: float, checkpoint_minutes: float) -> float:
    return repair_s + (checkpoint_minutes * 60 / 2 if system == "stock" else 0.0)


def goodput(n: int, rate: float, cost_s: float) -> float:
    return max(0.0, 1.0 - rate * n / 1000 / 3600 * cost_s)


def table(ns, rates: dict, costs: dict, minutes: float) -> str:
    head = "| GPUs | fault rate | stock goodput | hpct goodput | stock lost h/day | hpct lost h/day |"
    rows = [head, "|" + "|".join("---" for _ in range(6)) + "|"]
    for name, rate in rates.items():
        for n in ns:
            g = {s: goodput(n, rate, cost(s, costs[s], minutes)) for s in ("stock", "hpct")}
            rows.append(f"| {n:,} | {name} | {100 * g['stock']:.1f} % | {100 * g['hpct']:.2f} % | "
                        f"{24 * (1 - g['stock']):.2f} | {24 * (1 - g['hpct']):.3f} |")
    return "\n".join(rows)


def plot(path: str, rates: dict, costs: dict, minutes: float) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("goodput_model.py: --png needs matplotlib\n  fix: pip install 'hpct[bench]' (or matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = [int(10 ** (k / 8)) for k in range(16, 41)]          # 100 .. 100,000
    fig, ax = plt.subplots(figsize=(8, 5))
    for (name, rate), style in zip(rates.items(), ("-", "--")):
        for system, color in (("stock", "C3"), ("hpct", "C0")):
            c = cost(system, costs[system], minutes)
            ax.plot(ns, [100 * goodput(n, rate, c) for n in ns], color + style,
                    label=f"{system} ({c:.1f} s per fault), {name}")
    ax.set_ylim(0, 101)
    from model import save_plot
    save_plot(fig, ax, path, "Goodput against job size: measured per-fault costs, published fault rates",
              "GPUs in the job", "goodput (%)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", required=True, help="benchmarks/goodput.py --json output")
    ap.add_argument("--png", help="write the plot here")
    ap.add_argument("--n", default=",".join(map(str, DEFAULT_N)), help="job sizes (GPUs) for the table")
    ap.add_argument("--checkpoint-minutes", type=float, default=CHECKPOINT_MINUTES,
                    help="stock's checkpoint interval on a cluster (half of it is redone per fault)")
    ap.add_argument("--repair-s", default="", metavar="SYSTEM=S,...",
                    help="use these per-fault times instead of the soak's (e.g. hpct=2.29 from an H200 run, "
                         "docs/gpu.md)")
    args = ap.parse_args(argv)
    try:
        with open(args.inputs) as f:
            doc = json.load(f)
    except (OSError, ValueError) as err:
        sys.exit(f"goodput_model.py: cannot read {args.inputs}: {err}\n"
                 "  fix: python benchmarks/goodput.py --json goodput.json")
    costs = per_fault_costs(doc)
    for item in (x for x in args.repair_s.split(",") if x):
        system, _, value = item.partition("=")
        try:
            if system not in costs:
                raise ValueError
            costs[system] = float(value)
        except ValueError:
            ap.error(f"--repair-s: {item!r} is not SYSTEM=SECONDS with SYSTEM hpct or stock")
    ns = [int(x) for x in args.n.split(",") if x]
    rates = {"1 per 3 h per 1,000 GPUs": RATE_FEW_HOURS, f"Llama 3's {RATE_LLAMA3:.3f}/h per 1,000": RATE_LLAMA3}
    print(f"per fault (SIGKILL -> every rank's next step, the soak's median on {doc['config']}, seed "
          f"{doc['seed']}{'; --repair-s ' + args.repair_s if args.repair_s else ''}): "
          + ", ".join(f"{s} {v:.2f} s" for s, v in sorted(costs.items())))
    print(f"stock also redoes half its checkpoint interval: {args.checkpoint_minutes / 2:g} minutes per fault\n")
    print(table(ns, rates, costs, args.checkpoint_minutes))
    if args.png:
        plot(args.png, rates, costs, args.checkpoint_minutes)
        print(f"\nplot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
