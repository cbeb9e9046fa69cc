"""benchmarks/goodput.py's arguments and its report: the table, each fault's end, the verdict."""

from __future__ import annotations

import random

import goodput_faults as gf
from launch import table

SCHEMA = 1
GOAL = "hpct: goodput >= 97 % and lost time <= 1/3 of stock's, over >= 30 minutes at one fault per 2 minutes"


def check_args(args, ap) -> None:
    try:
        args.nodes, args.nproc = (int(x) for x in args.config.lower().split("x"))
    except ValueError:
        ap.error(f"--config: {args.config!r} is not NODESxWORKERS such as 3x2 or 4x4")
    if args.nodes < 2 or args.nproc < 1:
        ap.error(f"--config {args.config}: at least 2 nodes (network namespaces) of at least 1 worker")
    args.kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in args.kinds if k not in gf.KINDS]
    if bad or not args.kinds:
        ap.error(f"--kinds: unknown {', '.join(bad) or '(none given)'} (known: {', '.join(gf.KINDS)})")
    args.systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in args.systems if s not in ("hpct", "stock")]
    if bad or not args.systems:
        ap.error(f"--systems: unknown {', '.join(bad) or '(none given)'} (known: hpct, stock)")
    for name in ("minutes", "mtbf", "stop_s", "stop_long_s", "op_timeout", "during_s", "lossy_s"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be above 0")
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be at least 1 (or left out: as many as --minutes holds)")
    if args.node_return_s < 0:
        ap.error("--node-return-s must be 0 or above")
    if args.stop_s >= args.op_timeout or args.stop_long_s <= args.op_timeout:
        ap.error(f"--stop-s ({args.stop_s:g}) must be below --op-timeout ({args.op_timeout:g}) and "
                 f"--stop-long-s ({args.stop_long_s:g}) above it")
    if args.seed is None:
        args.seed = random.randrange(1 << 31)
    if args.timeout is None:
        args.timeout = 3 * args.minutes * 60 + 120


def _row(system: str, r: dict, acc: dict | None, outcomes: list[str], same: bool) -> list[str]:
    if acc is None:
        return [system, "failed", "-", "-", "-", str(len(r["injected"])), "-", "-"]   # the verdict says why
    gaps = acc["next_step_s"]
    ends = {}
    for o in outcomes:
        ends[o] = ends.get(o, 0) + 1
    return [system, f"{100 * acc['goodput']:.1f} %", f"{acc['wall_s']:.1f}",
            f"{acc['lost_s']:.1f} ({r['startup_s']:.1f} + {r['shutdown_s']:.1f})",
            str(acc["steps_redone"]), str(len(r["injected"])),
            "-" if gaps is None else f"{gaps['median']:.2f} / {gaps['p95']:.2f} / {gaps['max']:.2f}",
            ", ".join(f"{n} {o}" for o, n in sorted(ends.items()))
            + f"; digest {same if isinstance(same, str) else 'equal' if same else 'DIFFERS'}"]


def report(results: dict, step_s: dict, faults: list[gf.Fault], args) -> tuple[dict, str, bool]:
    """(the JSON document, the text, whether the soak is clean)."""
    # both systems' reference may be one run (the same reduction order): its error is told once
    problems = [f"{name}: {r['error']}" for name, r in {id(r): (n, r) for n, r in results.items()}.values()
                if r["error"]]
    rows, systems = [], {}
    for system in args.systems:
        r = results.get(system)
        if r is None:
            continue
        reference = results.get(f"reference-{system}", {}).get("digests")
        if reference is not None and len(reference) != 1:
            problems.append(f"{system}: its fault-free run's ranks end with {len(reference)} digests")
        acc = None if r["error"] or not step_s.get(system) else \
            gf.account(r["logs"], r["injected"], args.steps, step_s[system], r["wall_s"])
        if acc:
            clear, n = gf.clear_step_s(r["logs"], r["injected"], args.lossy_s, args.node_return_s)
            acc.update(clear_step_s=clear and round(clear, 5), clear_steps=n,
                       clear_goodput=clear and round(args.steps * clear / r["wall_s"], 4))
        untils = [f["t"] for f in r["injected"][1:]] + [float("inf")]
        outcomes, carried = [], frozenset()
        for f, u in zip(r["injected"], untils) if acc else ():
            outcomes.append(gf.outcome(f, r["logs"], u, carried))
            overlapped = outcomes[-1] == "overlapped by the next fault"
            carried = carried | gf.hit_ranks(f) if overlapped else frozenset()
        for f, o in zip(r["injected"], outcomes):
            f["outcome"] = o
        # a shrunk world reduces over fewer ranks: other bits (two nodes lost inside one repair
        # may end as a spare's fill and a shrink at once, so the final world says it too)
        shrunk = any(o.startswith("shrunk") for o in outcomes) or \
            (r.get("final_world") or args.nodes * args.nproc) < args.nodes * args.nproc
        same = bool(reference) and r["digests"] == reference
        if acc:
            if not same and not shrunk:
                problems.append(f"{system}: final digests {r['digests']} differ from the fault-free run's {reference}")
            if acc["steps_missing"]:
                problems.append(f"{system}: no rank logged steps {acc['steps_missing'][:10]}")
            problems += [f"{system}: fault {f['kind']} of rank {f['rank']} at t+{f['at_s']} s: {f['outcome']}"
                         for f in r["injected"] if f["outcome"].startswith("unexplained")]
            problems += [f"{system}: a slot moved with no lossy link in force: {m}" for m in r.get("unexplained_moves", ())]
            if len(r["injected"]) < len(faults):
                problems.append(f"{system}: {len(faults) - len(r['injected'])} of {len(faults)} faults found no "
                                "process to hit (the job ended first, or no worker held the rank for 60 s)")
        rows.append(_row(system, r, acc, outcomes, "n/a (shrunk)" if shrunk else same))
        systems[system] = {"accounting": acc, "job_restarts": r.get("job_restarts", 0), "faults": [{k: v for k, v in f.items() if k != "pids"}
                                                         for f in r["injected"]],
                           "digests": r["digests"], "error": r["error"], "folder": r["folder"]}
    head = ["system", "goodput", "wall (s)", "lost (s) (start-up + end)", "steps redone", "faults",
            "fault -> next step of every rank, median / p95 / max (s)", "how the faults ended"]
    title = (f"Goodput under random faults: examples/ddp.py on {args.config} in network namespaces, "
             f"{args.steps} steps of --step-time {args.step_time:g} s, faults {','.join(args.kinds)} "
             f"at a mean of one per {args.mtbf:g} s (seed {args.seed}); stock checkpoints every "
             f"{args.checkpoint_every} steps")
    lines = [title, "", table(head, rows), ""]
    lost = {s: (systems.get(s, {}).get("accounting") or {}).get("lost_s") for s in ("hpct", "stock")}
    if lost["hpct"] is not None and lost["stock"]:
        lines.append(f"lost time, hpct / stock: {lost['hpct']:.1f} / {lost['stock']:.1f} s = "
                     f"{lost['hpct'] / lost['stock']:.2f}")
    lines.append("fault-free step time (s): " + ", ".join(f"{s} {v:.4f}" for s, v in step_s.items() if v))
    clear = {s: a for s in args.systems if (a := systems.get(s, {}).get("accounting")) and a["clear_step_s"]}
    if clear:
        lines.append("the same from the run's own clear stretches (s): " + "; ".join(
            f"{s} {a['clear_step_s']:.4f} over {a['clear_steps']} steps, goodput by it "
            f"{100 * a['clear_goodput']:.1f} %" for s, a in clear.items()))
    lines.append(f"goal ({GOAL}): "
                 + ("measured only at this length and rate" if args.minutes < 30 else "see the table"))
    lines += ["", "verdict: clean" if not problems else "verdict: NOT clean", *(f"  - {p}" for p in problems)]
    doc = {"schema": SCHEMA, "benchmark": "goodput", "config": args.config, "steps": args.steps,
           "step_time": args.step_time, "mtbf_s": args.mtbf, "seed": args.seed, "kinds": args.kinds,
           "checkpoint_every": args.checkpoint_every, "fault_free_step_s": step_s,
           "schedule": gf.as_dicts(faults), "systems": systems, "problems": problems}
    return doc, "\n".join(lines), not problems

