"""The goodput soak's fault schedule and its accounting (benchmarks/goodput.py runs the jobs).

A schedule is drawn from a seed: fault times at exponential gaps of mean ``--mtbf`` seconds
(the whole job's mean time between faults), each with a kind and a target rank.  Both systems
get the same schedule, measured from their first step.

The accounting reads what examples/ddp.py writes with ``--out``: ``steps-<place>.log``, one
line per completed step (step, time.time(), pid), appended by every process that ever held
the place (a killed one's steps stay), and the finishing processes' records with their digest.
A place is a slot of the port plan: rank r's at the start, and it stays with its node when a
shrink renumbers the ranks; a spare node's workers log at the spare's own places.  A fault
scheduled at a place whose node is gone hits one of the places still working instead.
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

KINDS = {
    "kill": "SIGKILL of a worker",
    "stop": "SIGSTOP of a worker, SIGCONT after --stop-s (below every grace)",
    "stop-long": "SIGSTOP of a worker, SIGCONT after --stop-long-s (past the op timeout, --op-timeout)",
    "hang": "SIGSTOP of a worker for good (a hang that never ends: its system must kill it)",
    "during": "SIGKILL of a worker, and of another one --during-s later (a fault during the recovery)",
    "node": "SIGKILL of the agent of a worker's node and of every process under it",
    "lossy": "5 % loss and 20 ms delay on a worker's node's link for --lossy-s (the tests' userspace switch)",
}
LOSSY_LOSS, LOSSY_DELAY_MS = 0.05, 20.0     # issue 42's lossy link: a flaky cable or an overloaded switch port


@dataclass(frozen=True)
class Fault:
    at_s: float        # seconds after the job's first step
    kind: str
    rank: int
    other: int         # the second victim of "during" (else -1)


def schedule(seed: int, mtbf_s: float, horizon_s: float, world: int, kinds: list[str]) -> list[Fault]:
    """Faults in [mtbf/2, horizon): exponential gaps, kinds and ranks drawn uniformly."""
    rng = random.Random(seed)
    faults, t = [], mtbf_s / 2
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            return faults
        kind = rng.choice(kinds)
        rank = rng.randrange(world)
        other = rng.choice([r for r in range(world) if r != rank]) if kind == "during" else -1
        faults.append(Fault(round(t, 3), kind, rank, other))


def step_log(out: Path, world: int) -> dict[int, list[tuple[int, float, int]]]:
    """Every completed step at every place of the port plan: (step, time, pid), in time order.

    A place is a rank at the start and a node's slot after: a spare's workers log at the spare's
    places, and a shrink, which renumbers ranks, moves no log."""
    logs = {}
    places = set(range(world)) | {int(p.stem.split("-")[1]) for p in out.glob("steps-*.log")}
    for rank in sorted(places):
        lines = (out / f"steps-{rank}.log").read_text().splitlines() if (out / f"steps-{rank}.log").exists() else []
        rows = []
        for line in lines:
            parts = line.split()
            if len(parts) == 3:          # a line cut by a kill is not a step
                rows.append((int(parts[0]), float(parts[1]), int(parts[2])))
        logs[rank] = sorted(rows, key=lambda r: r[1])
    return logs


def fault_free_step_s(logs: dict[int, list[tuple[int, float, int]]], skip: int = 5) -> float:
    """The mean step time of a run without faults, past its first ``skip`` steps (warm-up)."""
    per_rank = []
    for rows in logs.values():
        rows = rows[skip:]
        if len(rows) >= 2:
            per_rank.append((rows[-1][1] - rows[0][1]) / (len(rows) - 1))
    if not per_rank:
        raise RuntimeError("the fault-free run completed too few steps to time one")
    return statistics.fmean(per_rank)


CLEAR_S = 10.0    # after a fault's every rank stepped again, steps are not yet steady: standbys refill


def clear_step_s(logs, injected: list[dict], lossy_s: float, node_return_s: float,
                 skip: int = 5) -> tuple[float | None, int]:
    """(the mean step time of the run's own clear stretches, how many steps it is from).

    The calibration is short and runs minutes before the soak: at 30 steps its mean moved by 7 %
    between runs of one job (0.1286-0.1381 s), which moves a 30-minute soak's goodput by as much
    as all its faults.  This measures the same job under the same conditions instead.  A step
    is the last rank's last completion of it (a redone step counts where it counted); its
    interval is clear when it overlaps no fault's window: from 1 s before the fault to
    CLEAR_S after every rank stepped again, or after the lossy minute, or after a lost node's
    return (its agent starts again and warms its standbys).  Steps that a fault slowed outside
    its window stay in, so the estimate leans to the slow side, never to hpct's."""
    done: dict[int, float] = {}
    for rows in logs.values():
        last = {s: t for s, t, _ in rows}            # rows are in time order
        for s, t in last.items():
            done[s] = max(done.get(s, t), t)
    ends = {"lossy": lossy_s, "node": node_return_s}
    windows = [(f["t"] - 1.0, float("inf") if f.get("next_step_s") is None else
                f["t"] + max(f["next_step_s"], ends.get(f["kind"], 0.0)) + CLEAR_S) for f in injected]
    steps = sorted(done)[skip:]
    gaps = [done[b] - done[a] for a, b in zip(steps, steps[1:])
            if b == a + 1 and not any(lo < done[b] and done[a] < hi for lo, hi in windows)]
    return (statistics.fmean(gaps) if gaps else None), len(gaps)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def account(logs, injected: list[dict], steps: int, step_s: float, wall_s: float) -> dict:
    """Goodput, steps redone and each fault's time to the next step of every rank.

    ``injected``: the faults as applied ({"t": time.time(), "kind", "rank", "pid", ...}).
    """
    redone = {r: len(rows) - len({s for s, _, _ in rows}) for r, rows in logs.items()}
    # A rank killed between its optimizer step and its log line leaves that step out of its own
    # log only; a step no rank logged was never completed.
    done = {s for rows in logs.values() for s, _, _ in rows}
    missing = sorted(set(range(steps)) - done)
    gaps = []
    for f in injected:
        # a rank a shrink took out has no next step; the job's end leaves none to every rank
        # the places training at the fault: a spare's first step is not every rank's next
        members = _members(f, logs) - _lost_with_node(f)
        # A node's loss leaves only survivors to count, and the step they had in flight (the lost
        # ranks' part of its all-reduce already sent) still logs: a 30-minute soak read 0.02 s for
        # one.  No loss of a node is repaired within IN_FLIGHT_S (hpct's takes REFUSED_S at least).
        since = f["t"] + (IN_FLIGHT_S if f["kind"] == "node" else 0.0)
        nexts = [n for n in (min((t for _, t, _ in rows if t > since), default=None)
                             for r, rows in logs.items() if r in members) if n is not None]
        if not nexts:
            f["next_step_s"] = None          # the job ended before every rank stepped again
            continue
        f["next_step_s"] = round(max(nexts) - f["t"], 4)
        gaps.append(f["next_step_s"])
    counted_s = steps * step_s
    return {
        "goodput": round(counted_s / wall_s, 4) if wall_s > 0 else None,
        "wall_s": round(wall_s, 2),
        "counted_s": round(counted_s, 2),
        "lost_s": round(wall_s - counted_s, 2),
        "step_s": round(step_s, 5),
        "steps_redone": max(redone.values(), default=0),
        "steps_missing": missing,
        "next_step_s": ({"median": round(statistics.median(gaps), 3), "p95": round(percentile(gaps, 0.95), 3),
                         "max": round(max(gaps), 3)} if gaps else None),
    }


def holders(starts: list[dict], world: int, alive) -> dict[int, int]:
    """Each place's current worker from hpct's ``start`` events: the one started last, or -1 where
    none is (never started, or the last one died and its node's grow or replacement has not
    started the next: a fault there found a node being taken back, whose new processes are not
    its doing; taking the dead one's pid told a lossy link as "unexplained")."""
    latest: dict[int, tuple[str, int]] = {}
    for e in starts:
        latest[e["place"]] = max(latest.get(e["place"], (e["time"], e["pid"])), (e["time"], e["pid"]))
    return {r: latest[r][1] if r in latest and alive(latest[r][1]) else -1
            for r in sorted(set(range(world)) | set(latest))}


def hit_ranks(fault: dict) -> set[int]:
    return set(fault.get("ranks") or [fault["rank"]]) | ({fault["other"]} if fault["other"] >= 0 else set())


def outcome(fault: dict, logs, until: float = float("inf"), carried: frozenset = frozenset()) -> str:
    """How a fault ended: which ranks are held by another process than at the fault
    (``fault["pids"]``), against the ranks it hit.  A rank's holder is the process of its last
    step before ``until`` (the next fault): a step already in flight at the kill may still
    complete on a survivor that its system restarts right after.  A fault whose next fault came
    before every rank stepped again is told as overlapped: the next one's account covers both,
    so the ranks the overlapped ones hit (``carried``) may change in this one's window too."""
    hit = hit_ranks(fault)
    members = _members(fault, logs)
    left = _left_slow_node(fault, logs, members, until)
    lost = _lost_with_node(fault) | left
    # the survivors re-formed after the fault, or after a slow node's places last stepped
    left_rows = [(s, t) for r in left for s, t, _ in logs[r] if t < until]
    since = max([fault["t"]] + [t for _, t in left_rows])
    nexts = {r: min((s for s, t, _ in rows if t > since), default=None) for r, rows in logs.items()}
    resumed = min((s for r, s in nexts.items() if s is not None and r in members - lost), default=None)
    # the slow node's places left after the last step they logged, whichever of that step's lines
    # came last: a survivor on the loaded cores may log it after them, and a worker stopped
    # between its step and its log line leaves one more step unlogged
    if resumed is not None and left_rows:
        resumed = max(resumed, max(s for s, _ in left_rows) + 1)
    # a spare's places (or a returned node's): outside the world at the fault, stepping from the
    # step the survivors re-formed at (after the one in flight at the fault; a later grow's is later)
    fresh = {r for r, s in nexts.items() if r not in members and s is not None and resumed is not None
             and s <= resumed + 1}
    logs = {r: rows for r, rows in logs.items() if r in members}
    gone = {r for r, rows in logs.items() if not any(t > fault["t"] for _, t, _ in rows)}
    if any(t > fault["t"] + IN_FLIGHT_S and pid == fault["pids"][r] for r, rows in logs.items() if r not in lost
           for _, t, pid in rows):
        gone |= lost           # the survivors went on in their processes: the lost node's places left them
    if gone and gone == hit and len(gone) < len(logs):
        return "a spare node took its ranks" if len(fresh) == len(hit) else "shrunk: its ranks left the world"
    holder = {}
    for r, rows in logs.items():
        after = [(t, pid) for _, t, pid in rows if t > fault["t"]]
        if r in gone and r not in hit and len(gone) < len(logs):
            continue                                    # a place another fault took out meanwhile
        if not after:
            return "after the job's end"
        # the holder before the next fault: a step the old process had in flight at the fault
        # says nothing (a slow restart may not step again before the next fault at all)
        settled = [pid for t, pid in after if t < until and (t > fault["t"] + IN_FLIGHT_S or pid != fault["pids"][r])]
        if not settled and until != float("inf"):
            return "overlapped by the next fault"      # not every rank stepped again before it came
        holder[r] = settled[-1] if settled else after[0][1]
    changed = {r for r, pid in holder.items() if fault["pids"][r] != pid}
    # no process held these at the fault: a restart was under way (stock's, started node by node)
    starting = {r for r in holder if fault["pids"][r] < 0}
    if changed | starting == set(holder) and changed - starting:
        return "every worker restarted"
    changed -= starting | (carried - hit)    # and an earlier, overlapped fault's victims, replaced meanwhile
    if fault["kind"].startswith("stop"):
        return "rode through" if not changed else "replaced in place" if changed == hit else \
            f"unexplained: ranks {sorted(changed)} have new processes"
    if fault["kind"] == "lossy":        # nothing was lost: a slow node's link is ridden through
        return "rode through" if not changed else "a spare node took its ranks" if changed == hit else \
            f"unexplained: ranks {sorted(changed)} have new processes, {sorted(hit)} were on the lossy link"
    if changed == hit:
        return "a spare node took its ranks" if fault["kind"] == "node" else "replaced in place"
    return f"unexplained: ranks {sorted(changed)} have new processes, {sorted(hit)} were hit"


IN_FLIGHT_S = 1.0      # a step in flight at a kill logs within this (a step is 0.1-0.3 s)


def _lost_with_node(fault: dict) -> set[int]:
    """A lost node's places: gone with it, even where a step in flight at the kill still logged,
    or the node came back later and logs there again (--node-return-s)."""
    return set(fault.get("ranks") or []) if fault["kind"] == "node" else set()


def _left_slow_node(fault: dict, logs, members: set[int], until: float) -> set[int]:
    """A lossy fault's places that stopped stepping while the others went on, before ``until``:
    hpct gave the slow node's slot to a spare (docs/launch.md), after a few slow steps."""
    if fault["kind"] != "lossy":
        return set()
    hit = hit_ranks(fault) & members
    # before ``until`` only: the slow node may take a slot again later (a lost node's), and its
    # places' later steps made the 30-minute soak tell a slot given away as ridden through
    last = {r: max((t for _, t, _ in logs.get(r, ()) if t < until), default=float("-inf")) for r in members}
    others = [last[r] for r in members - hit]
    if not others:
        return set()
    horizon = min(until, max(others))
    return {r for r in hit if last[r] < horizon - IN_FLIGHT_S}


def _members(fault: dict, logs) -> set[int]:
    """The places training at the fault: as the soak saw them (the view, less the nodes it had
    killed), else every place that had stepped before it."""
    if "members" in fault:
        return set(fault["members"])
    return {r for r, rows in logs.items() if rows and rows[0][1] <= fault["t"]} or \
        {r for r in fault["pids"] if r in logs}


JUDGE_S = 10.0     # a lossy link's slot move comes within this of the link's end (hold, window)


def unexplained_moves(folder: Path, injected: list[dict], lossy_s: float) -> list[str]:
    """The agents' ``slow-node`` moves (their event logs in ``folder``) with no lossy link in
    force: a slot given away in a healthy job costs a repair and is a defect (a busy agent's
    late answers once read as a slow link)."""
    windows = [(f["t"], f["t"] + lossy_s + JUDGE_S) for f in injected if f["kind"] == "lossy"]
    moves = []
    for log in sorted(folder.glob("events-*.jsonl")):
        for line in log.read_text().splitlines():
            try:
                e = json.loads(line)
                if e.get("event") != "slow-node":
                    continue
                t = datetime.fromisoformat(e["time"]).timestamp()
            except (ValueError, KeyError, TypeError):
                continue
            if not any(lo <= t <= hi for lo, hi in windows):
                moves.append(f"{e['time']}: {e.get('message', '')}")
    return moves


def as_dicts(faults: list[Fault]) -> list[dict]:
    return [asdict(f) for f in faults]
