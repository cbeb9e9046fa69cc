"""benchmarks/goodput.py's arguments and its report: the table, each fault's end, the verdict."""

from __future__ import annotations

import random

import goodput_faults as gf
from tables import table

SCHEMA = 1
GOAL_GOODPUT, GOAL_LOST_RATIO, GOAL_MINUTES, GOAL_MTBF_S = 0.97, 1 / 3, 30, 120      # issue 42's targets
GOAL = (f"hpct: goodput >= {100 * GOAL_GOODPUT:g} % and lost time <= 1/{1 / GOAL_LOST_RATIO:.0f} of stock's, over >= "
        f"{GOAL_MINUTES} minutes at one fault per {GOAL_MTBF_S / 60:g} minutes")
JUDGE = "the run's clear step"    # the fault-free step the goal is judged by (goal())
DISTURBED = 1.02    # a calibration whose step is this much slower than the run's clear one was disturbed


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
                       clear_goodput=clear and round(args.steps * clear / r["wall_s"], 4),
                       clear_lost_s=clear and round(r["wall_s"] - args.steps * clear, 2))
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
    accs = {s: a for s in args.systems if (a := systems.get(s, {}).get("accounting"))}
    lines.append("fault-free step time (s): " + ", ".join(f"{s} {v:.4f}" for s, v in step_s.items() if v))
    clear = {s: a for s, a in accs.items() if a["clear_step_s"]}
    if clear:
        lines.append("the same from the run's own clear stretches (s): " + "; ".join(
            f"{s} {a['clear_step_s']:.4f} over {a['clear_steps']} steps, goodput by it "
            f"{100 * a['clear_goodput']:.1f} %" for s, a in clear.items()))
    for s, a in accs.items():
        if disturbed(a):
            lines.append(f"{s}'s calibration was disturbed: its step ({a['step_s']:.4f} s) is slower than the "
                         f"run's own clear step ({a['clear_step_s']:.4f} s); its goodput and lost time by the "
                         "calibration are void, read those by the clear step (run the soak on a quiet machine)")
    verdicts = goal(accs, bool(results["hpct"]["error"]), args) if "hpct" in results else {"text": "hpct was not run"}
    for measure, (a, b) in verdicts.get("lost_s", {}).items():
        lines.append(f"lost time by {measure}, hpct / stock: {a:.1f} / {b:.1f} s = {verdicts['lost_ratio'][measure]:.2f}")
    lines.append(f"goal ({GOAL}): {verdicts['text']}")
    lines += ["", "verdict: clean" if not problems else "verdict: NOT clean", *(f"  - {p}" for p in problems)]
    doc = {"schema": SCHEMA, "benchmark": "goodput", "config": args.config, "steps": args.steps,
           "step_time": args.step_time, "mtbf_s": args.mtbf, "seed": args.seed, "kinds": args.kinds,
           "checkpoint_every": args.checkpoint_every, "fault_free_step_s": step_s,
           "schedule": gf.as_dicts(faults), "systems": systems, "goal": {k: v for k, v in verdicts.items() if k != "text"},
           "problems": problems}
    return doc, "\n".join(lines), not problems


def disturbed(acc: dict) -> bool:
    """The calibration timed a slower step than the run took clear of every fault: something else
    loaded the machine while it ran (goodput above 100 %, a negative lost time)."""
    return bool(acc.get("clear_step_s")) and acc["step_s"] > DISTURBED * acc["clear_step_s"]


def goal(accs: dict, ended: bool, args) -> dict:
    """The issue's targets: hpct's goodput, its lost time against stock's, and that no fault ended
    hpct's job.  Judged by the run's clear step (``JUDGE``), printed by every sound measure: the
    calibration is one short run minutes earlier, and on 2 cores the same job's calibrations spread
    by 0.126-0.143 s between runs, more than the 3 % the goal is about; the clear step comes from
    thousands of the run's own steps.  A disturbed calibration is not sound."""
    measures = {"the calibrated step": ("goodput", "lost_s"), JUDGE: ("clear_goodput", "clear_lost_s")}
    def sound(a: dict | None, m: str) -> bool:
        return a is not None and a.get(measures[m][0]) is not None and (m == JUDGE or not disturbed(a))
    hpct, stock = accs.get("hpct"), accs.get("stock")
    goodput = {m: hpct[g] for m, (g, _) in measures.items() if sound(hpct, m)}
    lost = {m: (hpct[k], stock[k]) for m, (_, k) in measures.items()
            if sound(hpct, m) and sound(stock, m) and stock[k] > 0}
    ratio = {m: round(a / b, 3) for m, (a, b) in lost.items()}
    parts = [f"goodput {100 * v:.1f} % by {m} ({'met' if v >= GOAL_GOODPUT else 'NOT met'})" for m, v in goodput.items()]
    parts += [f"lost time {v:.2f} of stock's by {m} ({'met' if v <= GOAL_LOST_RATIO else 'NOT met'})"
              for m, v in ratio.items()]
    parts.append("the job ended on a fault (NOT met)" if ended else "no fault ended the job (met)")
    long_enough = args.minutes >= GOAL_MINUTES and args.mtbf <= GOAL_MTBF_S
    met = long_enough and not ended and JUDGE in goodput and JUDGE in ratio and \
        goodput[JUDGE] >= GOAL_GOODPUT and ratio[JUDGE] <= GOAL_LOST_RATIO
    text = "; ".join(parts) + (f"; judged by {JUDGE}: {'met' if met else 'NOT met'}" if long_enough else
                               f" (the goal is for >= {GOAL_MINUTES} minutes at one fault per <= {GOAL_MTBF_S} s: "
                               "this run is shorter or calmer)")
    return {"goodput": goodput, "lost_s": lost, "lost_ratio": ratio, "job_ended": ended, "long_enough": long_enough,
            "judged_by": JUDGE, "met": met, "text": text}
