#!/usr/bin/env python3
"""Worker loss under a launcher: SIGKILL of one worker -> the first step completed by every rank after it.

examples/ddp.py (``--step-time`` seconds of simulated compute per step) runs under three
launchers, in the same invocation, and the last rank is SIGKILLed once it has completed
``--kill-step`` steps (it writes ``OUT/progress-<rank>`` after each step), or, with
``--kill-after-first-step S``, S seconds after every rank has completed its first step (a fault
in the job's first seconds, before a standby could be warm):

* ``hpct run``: the node's agent forks a replacement from the node's fork server (its default:
  torch imported once per node), the survivors recover in-process at the next generation and
  nobody else restarts;
* ``hpct run --no-fork-server`` (``--launchers hpct-spawn``): the same, the replacement a cold
  Python that imports torch itself;
* ``hpct run --no-fork-server --standby 1``: the replacement is a warm standby (torch imported),
  once one is warm (a node starts its standbys after its workers' world formed);
* ``hpct run``, a node lost (``--launchers hpct-node``, N >= 3: a majority must survive): the
  last node's agent and workers are SIGKILLed together; the survivors' agents drop it after
  ``--node-grace`` seconds of silence and their workers shrink in-process.  Reported: the first
  step of the shrunk world after the kill, the grace it includes, and the time after the drop;
* ``hpct run --spare-nodes 1``, a node lost (``--launchers hpct-spare``, N >= 3 active nodes and
  one more namespace for the spare): the same kill; the spare's agent takes the lost node's slot
  and its workers (from warm standbys it keeps) join the survivors' world at the same size and
  ranks.  Reported as for ``hpct-node``: the first step of the repaired world after the kill;
* ``torchrun --max-restarts 1`` (``python -m torch.distributed.run``) on stock Gloo: every worker
  is stopped and started again, and the script (no checkpoint) starts again at step 0.  It runs
  with torch's own ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the agent-shared store (the
  default) the restarted workers read the dead workers' Gloo addresses and fail
  (pytorch/pytorch#135712, so in torch 2.13 too).

Reported per run, from the records examples/ddp.py writes (``--out``; one ``time.time()``
clock, the kill time taken right before ``os.kill``):

* recovery: for each rank the first step completed after the kill, the max over ranks, minus
  the kill time;
* steps lost: steps that had completed before the kill and were done again (max over ranks;
  0 for an in-place recovery, about ``--kill-step`` for torchrun's restart);
* restarted: the ranks whose finishing process is not the one that ran before the kill.

Configurations are NODESxWORKERS: 1xW on loopback, NxW (N > 1) in N network namespaces on one
bridge (subnet 10.237.0; root), torchrun then with a c10d rendezvous hosted by node 0
(``--rdzv-conf is_host=1`` there) and ``--local-addr`` set to each namespace's address.
Every process a run starts carries a tag in its environment and is SIGKILLed at its end.

    python benchmarks/launch.py [--config 1x4,2x2] [--kill-step 20] [--repeat 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import shutil
import uuid
from pathlib import Path

from hpct.testing.procs import TAG_VAR, descendants, environ, kill_tagged, torch_version

from tables import table

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "ddp.py"
SUBNET = "10.237.0"
LAUNCHERS = {
    "hpct": "hpct run",
    "hpct-spawn": "hpct run --no-fork-server",
    "hpct-standby": "hpct run --no-fork-server --standby 1",
    "torchrun": "torchrun --max-restarts 1",
    "hpct-node": "hpct run, a node lost",
    "hpct-spare": "hpct run --spare-nodes 1, a node lost",
}
DEFAULT_LAUNCHERS = "hpct,hpct-standby,torchrun"
NODE_LOSS = ("hpct-node", "hpct-spare")  # not a worker loss: no torchrun ratio (a static torchrun job ends)
GOAL = "hpct run (its default), worker loss -> next step >= 10x faster than torchrun's restart and under 1 s"
EARLY_GOAL = "a worker killed {s:g} s after the job's first completed step: every rank on its next step within 1 s"
EARLY_GOAL_S = 1.0


def _wait_progress(out: Path, rank: int, step: int, deadline: float, alive, what: str) -> None:
    from hpct.testing.cluster import progress
    while progress(out, rank) < step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: rank {rank} did not complete {step} steps in time")
        if not alive():
            raise RuntimeError(f"{what}: a launcher exited before rank {rank} completed {step} steps")
        time.sleep(0.005)


def _wait_first_steps(out: Path, world: int, delay: float, deadline: float, alive, what: str) -> None:
    """Wait until every rank has completed its first step (the job's first completed step), then
    ``delay`` seconds more."""
    from hpct.testing.cluster import progress
    while not all(progress(out, r) >= 1 for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: the job's first step was not completed in time")
        if not alive():
            raise RuntimeError(f"{what}: a launcher exited before the job's first step")
        time.sleep(0.005)
    time.sleep(delay)


def _kill(out: Path, world: int, pid: int, *others: int) -> tuple[float, dict[int, int]]:
    """SIGKILL ``pid`` (and ``others`` that are still there); returns the kill time (time.time(),
    taken right before os.kill) and every rank's completed steps read just before."""
    from hpct.testing.cluster import progress
    before = {r: progress(out, r) for r in range(world)}
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    for other in others:
        try:
            os.kill(other, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return t_kill, before


# ---- analysis --------------------------------------------------------------------------------

def analyse(out: Path, world: int, t_kill: float, before: dict[int, int], pids: dict[int, int]) -> dict:
    from hpct.testing.cluster import records
    recs = records(out)
    by_rank: dict[int, list[dict]] = {}
    for r in recs:
        by_rank.setdefault(r["rank"], []).append(r)
    if sorted(by_rank) != list(range(world)):
        raise RuntimeError(f"records of ranks {sorted(by_rank)}, expected 0..{world - 1}")
    first_after, lost, restarted = {}, {}, []
    for rank, rs in sorted(by_rank.items()):
        steps = [(s, t) for r in rs for s, t in r["steps"]]
        after = sorted((t, s) for s, t in steps if t > t_kill)
        if not after:
            raise RuntimeError(f"rank {rank} completed no step after the kill")
        done_before = max([before.get(rank, 0)] + [s + 1 for s, t in steps if t <= t_kill])
        first_after[rank] = after[0]
        lost[rank] = max(0, done_before - after[0][1])
        if any(r["pid"] != pids[rank] for r in rs):
            restarted.append(rank)
    return {"recovery_s": round(max(t for t, _ in first_after.values()) - t_kill, 4),
            "steps_lost": max(lost.values()),
            "restarted": restarted,
            "first_step_after": {str(r): s for r, (_, s) in first_after.items()},
            "done_before": {str(r): n for r, n in before.items()}}


# ---- one run ---------------------------------------------------------------------------------

def run_hpct(tmp: Path, nodes: int, nproc: int, standby: int, args, ns, tag: str, node_loss: bool = False,
             spares: int = 0, fork_server: bool = True) -> dict:
    from hpct.testing.cluster import Agents
    from hpct.ports import free_port_block
    world, victim = nodes * nproc, nodes * nproc - 1
    if node_loss and nodes < 3:
        raise ValueError(f"a node loss needs 3 nodes or more (a majority of the last view survives), not {nodes}")
    out = tmp / "out"
    out.mkdir()
    script = [str(EXAMPLE), "--steps", str(args.steps), "--step-time", str(args.step_time), "--out", str(out)]
    flags = ["--nnodes", str(nodes), "--nproc-per-node", str(nproc), "--standby", str(standby), "--rdzv-id", "bench",
             "--node-grace", str(args.node_grace), "--spare-nodes", str(spares)]
    flags += [] if fork_server else ["--no-fork-server"]
    if ns:
        flags += ["--hosts", ",".join(n.address for n in ns[:nodes + spares])]
    else:
        flags += ["--port-base", str(free_port_block(2 * 8 * nproc + 2))]
    env = {"OMP_NUM_THREADS": "1", TAG_VAR: tag, "HPCT_CONNECT_TIMEOUT": str(int(args.timeout))}
    deadline = time.monotonic() + args.timeout
    what = f"hpct{'' if fork_server else ' --no-fork-server'}{' --standby ' + str(standby) if standby else ''} " \
           f"{nodes}x{nproc}"
    with Agents(tmp, [*flags, *script], nodes=nodes + spares, namespaces=ns, env=env) as agents:
        try:
            agents.start()
            alive = lambda: all(p.poll() is None for p in agents.procs)   # noqa: E731
            from hpct.testing.cluster import progress
            early = args.kill_after_first_step is not None
            for n in range(nodes + spares):
                # A spare keeps one standby per local rank; with a fork server, none (its workers are forked).
                ready = 0 if fork_server or early else nproc if n >= nodes else standby
                while len(agents.events(n, "standby")) < ready:
                    if agents.procs[n].poll() is not None:  # a short job ends before its standbys are warm
                        raise RuntimeError(f"{what}: rank {victim} finished its {progress(out, victim)} steps before "
                                           "the standbys were warm, too late to measure a recovery: give more "
                                           "--steps or a longer --step-time")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{what}: node {n} had no {ready} standbys warm within --timeout "
                                           f"{args.timeout:g} s:\n{agents.output(n)[-3000:]}")
                    time.sleep(0.02)
            if early:
                _wait_first_steps(out, world, args.kill_after_first_step, deadline, alive, what)
            else:
                _wait_progress(out, victim, args.kill_step, deadline, alive, what)
            if (at := progress(out, victim)) >= args.steps - 2:
                # standbys start once the world formed and warm for seconds: the job must outlast that
                raise RuntimeError(f"{what}: rank {victim} was at step {at} of {args.steps} once the standbys were "
                                   "warm, too late to measure a recovery: give more --steps or a longer --step-time")
            pids = {r: agents.worker_pid(r // nproc, r) for r in range(world)}
            if node_loss:
                agent = agents.procs[nodes - 1].pid          # the node goes: its agent and all under it
                t_kill, before = _kill(out, world, agent, *descendants([agent]))
                codes = [agents.procs[n].wait(timeout=max(1.0, deadline - time.monotonic()))
                         for n in range(nodes + spares) if n != nodes - 1]
                if codes != [0] * (nodes + spares - 1):
                    raise RuntimeError(f"{what}, node {nodes - 1} lost: the survivors' agents exited {codes}")
            else:
                t_kill, before = _kill(out, world, pids[victim])
                codes = agents.wait(max(1.0, deadline - time.monotonic()))
                if codes != [0] * nodes:
                    raise RuntimeError(f"{what}: agents exited {codes}")
        except (TimeoutError, RuntimeError, OSError) as err:
            tails = "\n".join(agents.output(n)[-1500:] for n in range(nodes) if agents.err_path(n).exists())
            raise RuntimeError(f"{err}\n{tails}") from None
    if node_loss:
        # The survivors keep their ranks; the lost node's go, or move to the spare (same world).
        alive = world if spares else (nodes - 1) * nproc
        res = analyse(out, alive, t_kill, {r: n for r, n in before.items() if r < alive},
                      {r: p for r, p in pids.items() if r < alive})
        from datetime import datetime
        lost = [e for n in range(nodes - 1) for e in agents.events(n, "node-lost")]
        if not lost:
            raise RuntimeError(f"{what}: the survivors' agents logged no node-lost event")
        first = min(lost, key=lambda e: datetime.fromisoformat(e["time"]))
        res["node_grace_s"] = args.node_grace
        res["dropped_s"] = round(datetime.fromisoformat(first["time"]).timestamp() - t_kill, 4)
        res["how"] = first["message"]
        if spares:
            taken = agents.events(nodes, "start")
            res["spare_warm"] = [bool(e.get("warm")) for e in taken]
            res["spare_started"] = [_how(e) for e in taken]
        return res
    res = analyse(out, world, t_kill, before, pids)
    replacements = [e for n in range(nodes) for e in agents.events(n, "start") if e["generation"] > 0]
    res["warm"] = [bool(e.get("warm")) for e in replacements]
    res["started"] = [_how(e) for e in replacements]
    return res


def _how(start: dict) -> str:
    """How hpct run started a process: forked, warm (a standby) or cold (its start event's why)."""
    return start["why"].split(":")[0]


def run_torchrun(tmp: Path, nodes: int, nproc: int, args, ns, tag: str) -> dict:
    world, victim = nodes * nproc, nodes * nproc - 1
    out = tmp / "out"
    out.mkdir()
    script = [str(EXAMPLE), "--steps", str(args.steps), "--step-time", str(args.step_time),
              "--backend", "gloo", "--out", str(out)]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torch's own opt-out of the agent-shared store, whose
    # keys outlive a restart (the restarted workers read the dead ones' Gloo addresses and fail;
    # pytorch/pytorch#135712, still so in torch 2.13 with --max-restarts).
    env = {**os.environ, "OMP_NUM_THREADS": "1", TAG_VAR: tag, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "GLOO_SOCKET_IFNAME": "eth0" if ns else "lo"}
    procs, logs = [], []
    what = f"torchrun {nodes}x{nproc}"
    deadline = time.monotonic() + args.timeout
    try:
        for n in range(nodes):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                    "--max-restarts", "1"]
            if ns:
                port = 29400 + (args.run_index % 500)
                argv += ["--nnodes", str(nodes), "--node-rank", str(n), "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", f"{ns[0].address}:{port}", "--rdzv-id", f"bench{args.run_index}",
                         "--rdzv-conf", f"is_host={int(n == 0)}", "--local-addr", ns[n].address]
            else:
                argv += ["--standalone"]
            log = tmp / f"torchrun-{n}.log"
            logs.append(log)
            with open(log, "w") as f:
                kw = dict(env=env, stdout=f, stderr=subprocess.STDOUT, cwd=str(tmp), start_new_session=True)
                procs.append(ns[n].popen([*argv, *script], **kw) if ns else
                             subprocess.Popen([*argv, *script], **kw))
        alive = lambda: all(p.poll() is None for p in procs)   # noqa: E731
        if args.kill_after_first_step is not None:
            _wait_first_steps(out, world, args.kill_after_first_step, deadline, alive, what)
        else:
            _wait_progress(out, victim, args.kill_step, deadline, alive, what)
        pids: dict[int, int] = {}
        for pid in descendants([p.pid for p in procs]):
            e = environ(pid)
            if e.get(TAG_VAR) == tag and e.get("TORCHELASTIC_RESTART_COUNT") == "0" and "RANK" in e:
                pids[int(e["RANK"])] = pid
        if sorted(pids) != list(range(world)):
            raise RuntimeError(f"{what}: found workers of ranks {sorted(pids)} only")
        t_kill, before = _kill(out, world, pids[victim])
        for n, p in enumerate(procs):
            try:
                code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{what}: torchrun {n} still running at the deadline") from None
            if code != 0:
                raise RuntimeError(f"{what}: torchrun {n} exited {code}")
    except (TimeoutError, RuntimeError, OSError) as err:
        tails = "\n".join(log.read_text()[-1500:] for log in logs if log.exists())
        raise RuntimeError(f"{err}\n{tails}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
    return analyse(out, world, t_kill, before, pids)


def run_once(launcher: str, nodes: int, nproc: int, args, ns) -> dict:
    tag = uuid.uuid4().hex
    tmp = Path(tempfile.mkdtemp(prefix=f"hpct-bench-launch-{launcher}-"))
    args.run_index += 1
    t0 = time.monotonic()
    run = {"launcher": launcher, "config": f"{nodes}x{nproc}", "error": None}
    try:
        if launcher == "torchrun":
            run.update(run_torchrun(tmp, nodes, nproc, args, ns, tag))
        elif launcher in NODE_LOSS:
            run.update(run_hpct(tmp, nodes, nproc, 0, args, ns, tag, node_loss=True,
                                spares=int(launcher == "hpct-spare")))
        else:
            run.update(run_hpct(tmp, nodes, nproc, int(launcher == "hpct-standby"), args, ns, tag,
                                fork_server=launcher == "hpct"))
    except (TimeoutError, RuntimeError, OSError, KeyError, ValueError) as err:
        run["error"] = str(err).strip()
    finally:
        kill_tagged(TAG_VAR, tag)
        if run["error"] is None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            run["folder"] = str(tmp)
            if run["error"]:
                run["error"] += f"\n(logs kept in {tmp})"
    run["wall_s"] = round(time.monotonic() - t0, 1)
    shown = {k: run.get(k) for k in ("launcher", "config", "recovery_s", "steps_lost", "restarted", "wall_s",
                                     "folder") if k in run}
    print(f"  {shown}" + (f"\n  error: {run['error']}" if run["error"] else ""), file=sys.stderr, flush=True)
    return run


# ---- report ----------------------------------------------------------------------------------

def summarise(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["error"] is None]
    if not ok:
        return {"recovery_s": None, "steps_lost": None, "restarted": None, "completed": 0}
    return {"recovery_s": round(statistics.median(r["recovery_s"] for r in ok), 4),
            "steps_lost": statistics.median(r["steps_lost"] for r in ok),
            "restarted": max(len(r["restarted"]) for r in ok), "completed": len(ok),
            "started": "/".join(sorted({how for r in ok for how in r.get("started", [])})) or "-"}


def render(configs: list[dict], args) -> str:
    rows, goals = [], []
    early = args.kill_after_first_step is not None
    num = lambda v, f: "-" if v is None else format(v, f)   # noqa: E731
    for c in configs:
        stock = c["median"].get("torchrun", {}).get("recovery_s")
        for launcher, s in c["median"].items():
            ratio = c["ratio"].get(launcher)
            rows.append([c["config"], LAUNCHERS[launcher], num(s["recovery_s"], ".3f"),
                         num(s["steps_lost"], "g"), num(s["restarted"], "d"), s.get("started", "-"),
                         "-" if ratio is None else f"{ratio:.1f}x", f"{s['completed']}/{args.repeat}"])
        if set(c["median"]) <= set(NODE_LOSS):
            continue                          # the goal is a worker loss's; a node loss has none
        goals.append(_goal(c, stock, early))
    when = (f"{args.kill_after_first_step:g} s after every rank's first completed step" if early
            else f"after step {args.kill_step}")
    title = (f"Worker loss: SIGKILL of the last rank {when} -> first step completed by "
             f"every rank after it, max over ranks (examples/ddp.py, --steps {args.steps}, --step-time "
             f"{args.step_time:g}; {os.cpu_count()} CPUs, torch {torch_version()}, median of {args.repeat})")
    head = ["config", "launcher", "recovery (s)", "steps lost", "ranks restarted", "replacement", "torchrun/this",
            "runs ok"]
    note = ("torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (its restart fails with the shared store: "
            "pytorch/pytorch#135712)")
    for c in configs:
        for r in c["runs"]:
            if r["launcher"] in NODE_LOSS and r.get("error") is None:
                world = "the spare's repaired world" if r["launcher"] == "hpct-spare" else "the shrunk world"
                note += (f"\n{c['config']}, {LAUNCHERS[r['launcher']]} (--node-grace {r['node_grace_s']:g}): the last "
                         f"node's agent and workers SIGKILLed; the survivors' agents dropped it {r['dropped_s']:.3f} s "
                         f"after the kill ({r['how']}); {world}'s first step {r['recovery_s']:.3f} s after the kill "
                         f"({r['recovery_s'] - r['dropped_s']:.3f} s after the drop)")
    goal = EARLY_GOAL.format(s=args.kill_after_first_step) if early else GOAL
    return "\n".join([title, "", table(head, rows), "", note, "", f"goal: {goal}", *goals])


def _goal(c: dict, stock: float | None, early: bool) -> str:
    """The goal's verdict for one configuration, judged on hpct run's default (the "hpct" runs)."""
    warm = c["median"].get("hpct", {}).get("recovery_s")
    if warm is None or stock is None:
        return f"  {c['config']}: not measured (needs hpct and torchrun runs that completed)"
    met = warm < EARLY_GOAL_S if early else stock / warm >= 10 and warm < 1.0
    return (f"  {c['config']}: {warm:.3f} s, {stock / warm:.1f}x faster than torchrun's restart "
            f"({stock:.3f} s): {'met' if met else 'NOT met'}")


def _config(text: str) -> tuple[int, int]:
    try:
        nodes, nproc = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--config: {text!r} is not NODESxWORKERS such as 1x4 or 2x2") from None
    if nodes < 1 or nproc < 1 or nodes * nproc < 2:
        raise SystemExit(f"--config {text}: at least 2 workers in all")
    return nodes, nproc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="1x4", help="comma list of NODESxWORKERS (N > 1: network namespaces)")
    ap.add_argument("--launchers", default=DEFAULT_LAUNCHERS, help=f"comma list of {', '.join(LAUNCHERS)}")
    ap.add_argument("--node-grace", type=float, default=1.0,
                    help="hpct run --node-grace: seconds of silence that make a node lost (hpct-node runs)")
    ap.add_argument("--kill-step", type=int, default=20, help="the last rank is killed after this many steps")
    ap.add_argument("--kill-after-first-step", type=float, default=None, metavar="S",
                    help="kill the last rank S seconds after every rank completed its first step instead "
                    "(a fault in the job's first seconds: no standby is waited for)")
    ap.add_argument("--steps", type=int, default=None, help="steps of the run (default: kill step + 150: "
                    "hpct's standbys start once the world formed and must be warm before the kill; with "
                    "--kill-after-first-step, 60)")
    ap.add_argument("--step-time", type=float, default=0.05, help="seconds of simulated compute per step")
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration and launcher (median)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per run, start to end")
    ap.add_argument("--keep", action="store_true", help="keep every run's folder (logs, records); failed runs' always")
    ap.add_argument("--json", help="also write every run and the medians to this file")
    args = ap.parse_args(argv)
    if args.kill_after_first_step is not None and args.kill_after_first_step < 0:
        raise SystemExit(f"--kill-after-first-step {args.kill_after_first_step:g} is negative")
    default_steps = 60 if args.kill_after_first_step is not None else args.kill_step + 150
    args.steps = args.steps if args.steps is not None else default_steps
    args.run_index = 0
    configs = [_config(c) for c in args.config.split(",") if c]
    launchers = [x for x in args.launchers.split(",") if x]
    if unknown := [x for x in launchers if x not in LAUNCHERS]:
        raise SystemExit(f"--launchers: unknown {', '.join(unknown)} (known: {', '.join(LAUNCHERS)})")
    if not 1 <= args.kill_step < args.steps:
        raise SystemExit(f"--kill-step {args.kill_step} must be at least 1 and below --steps {args.steps}")
    started = time.monotonic()
    results = []
    for nodes, nproc in configs:
        name = f"{nodes}x{nproc}"
        runs: list[dict] = []
        if nodes == 1:
            for launcher in launchers:
                runs += [run_once(launcher, nodes, nproc, args, None) for _ in range(args.repeat)]
        else:
            from hpct.testing.netns import netns_network, unavailable_reason
            why = unavailable_reason()
            if why:
                runs = [{"launcher": x, "config": name, "error": why} for x in launchers]
                print(f"  {name}: {why}", file=sys.stderr)
            else:
                spare = int("hpct-spare" in launchers)   # one more namespace, for the spare node
                with netns_network(nodes + spare, name_prefix="hpct-blaunch", subnet=SUBNET) as ns:
                    for launcher in launchers:
                        runs += [run_once(launcher, nodes, nproc, args, ns) for _ in range(args.repeat)]
        median = {x: summarise([r for r in runs if r["launcher"] == x]) for x in launchers}
        stock = median.get("torchrun", {}).get("recovery_s")
        ratio = {x: (round(stock / s["recovery_s"], 2) if stock and s["recovery_s"] and x not in NODE_LOSS else None)
                 for x, s in median.items()}
        results.append({"config": name, "nodes": nodes, "workers_per_node": nproc, "runs": runs,
                        "median": median, "ratio": ratio})
    print(render(results, args))
    print(f"total benchmark time {time.monotonic() - started:.1f} s")
    if args.json:
        goal = GOAL if args.kill_after_first_step is None else EARLY_GOAL.format(s=args.kill_after_first_step)
        doc = {"schema": 1, "benchmark": "launch", "goal": goal, "kill_after_first_step": args.kill_after_first_step,
               "machine": {"cpus": os.cpu_count(), "torch": torch_version(), "date": time.strftime("%Y-%m-%d")},
               "kill_step": args.kill_step, "steps": args.steps, "step_time": args.step_time,
               "repeat": args.repeat, "configs": results}
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, args.json)
    return 0 if all(r["error"] is None for c in results for r in c["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
