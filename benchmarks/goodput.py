#!/usr/bin/env python3
"""Goodput under random faults: one training job under hpct and under stock torchrun, one fault schedule.

examples/ddp.py (``--step-time`` seconds of simulated compute per step) runs on NODES x WORKERS
in network namespaces (one per node, on a bridge), under two systems in the same invocation:

* **hpct**: ``hpct run --standby 1 --fork-server`` (a warm standby per node replaces a lost
  worker in place, and every other worker is forked from the node's fork server, which imported
  torch once; the survivors recover in-process), with ``--spare-nodes 1`` when nodes are lost or links turn
  lossy (the spare takes the first lost node's ranks, or a slow node's; after that the survivors
  shrink while a majority lives, or ride a slow link through);
* **stock**: ``torchrun --max-restarts`` on Gloo, ``--checkpoint-every K``: rank 0 saves the state
  every K steps, a fault restarts every worker and they resume from the last checkpoint.  A lost
  node ends a static torchrun job: the scheduler (this script, at once) starts the job again.

Both get the same seeded schedule (benchmarks/goodput_faults.py, ``--kinds``): SIGKILL of a
worker; SIGSTOP of a worker for ``--stop-s`` (below the op timeout), ``--stop-long-s`` (past
it) or for good (``hang``: its system must kill it); a SIGKILL and another one ``--during-s``
later, inside the first one's recovery; a node lost (its agent and every process under it
SIGKILLed); a lossy link (5 % loss and 20 ms delay on one node's link for ``--lossy-s``).  With
``lossy`` among the kinds the nodes are joined by the tests' userspace switch (hpct/testing/lossy.py,
which can impair one link at a time) instead of a bridge, for both systems.  Reported for each
system:

* goodput: steps that count x the fault-free step time / wall time (launch to the job's end;
  the fault-free step time is measured twice: by a short run of the same job first, and from
  the run's own steps clear of every fault's window; a calibration slower than the clear step
  was disturbed and is left out of the goal);
* lost time (wall minus counted) and its ratio, hpct against stock, by each measure;
* the issue's goal (benchmarks/goodput_report.py: GOAL), printed by each sound measure and
  judged by the run's clear step;
* steps redone (max over ranks), and each fault's time to the next step of every rank;
* how each fault ended, and whether the final parameters equal a fault-free run's bit for bit
  (a stock Gloo run without faults and without simulated compute, made first) where that is
  the documented behaviour: not after a shrink.

    python benchmarks/goodput.py [--config 3x2] [--minutes 3] [--mtbf 20] [--seed 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from hpct.testing.procs import TAG_VAR, descendants, environ, kill_tagged, torch_version

import goodput_faults as gf
import goodput_reference

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ddp.py"   # the job every system runs
SUBNET = "10.238.0"
SYSTEMS = {"hpct": "hpct run --standby 1 --fork-server", "stock": "torchrun --max-restarts, checkpoint every K steps"}
CALIBRATION_STEPS = 100       # 30 timed the step to within 7 % only (goodput_faults.clear_step_s)
CALIBRATION_MAX = 400         # a longer soak times more: 100 steps of one job read 0.142 and 0.156 s
CALIBRATION_SHARE = 1 / 30    # of the soak's --minutes, at --step-time, up to CALIBRATION_MAX steps


def calibration_steps(minutes: float, step_time: float) -> int:
    return max(CALIBRATION_STEPS, min(CALIBRATION_MAX, round(minutes * 60 * CALIBRATION_SHARE / max(step_time, 1e-3))))
MAX_DELAY_S = 60.0     # a fault due while no process holds its rank waits for the next one this long


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Job:
    """One system's run of examples/ddp.py: start, current worker pids, end."""

    def __init__(self, system: str, tmp: Path, ns, args, steps: int, step_time: float,
                 calibration: bool = False) -> None:
        self.system, self.tmp, self.ns, self.args = system, tmp, ns, args
        self.nodes, self.nproc = args.nodes, args.nproc
        self.world = self.nodes * self.nproc
        self.tag = uuid.uuid4().hex
        self.out = tmp / "out"
        self.out.mkdir(parents=True)
        self.script = [str(EXAMPLE), "--steps", str(steps), "--step-time", str(step_time), "--out", str(self.out),
                       "--op-timeout", str(args.op_timeout)]
        self.procs: list[subprocess.Popen] = []
        self.agents = None
        # The calibration runs the job as the soak does, without faults.  Without a fork server it
        # leaves out the standbys and the spare node: each imports torch itself, on this machine in
        # the few steps that are timed.  With one, a node keeps no standby and nothing imports.
        lean = calibration and args.no_fork_server
        self.standby = 0 if lean else 1
        self.spares = int("node" in args.kinds or "lossy" in args.kinds) if system == "hpct" and not lean else 0
        self.lost: set[int] = set()          # nodes whose agent was killed (their exit code is -9)
        self.job_restarts = 0                # stock: the scheduler's restarts of the whole job
        self.returns: dict[int, float] = {}  # lost node -> when the scheduler has it back (--node-return-s)
        self.owed = 0                        # stock: node losses since its last whole-job start

    def start(self) -> None:
        env = {"OMP_NUM_THREADS": "1", TAG_VAR: self.tag}
        if self.system == "hpct":
            from hpct.testing.cluster import Agents
            every = self.nodes + self.spares
            flags = ["--nnodes", str(self.nodes), "--nproc-per-node", str(self.nproc), "--standby", str(self.standby),
                     "--spare-nodes", str(self.spares), "--rdzv-id", "goodput",
                     "--hosts", ",".join(n.address for n in self.ns[:every])]
            # Both ways explicit: the fork server is hpct run's default, --no-fork-server the way out.
            flags += ["--no-fork-server" if self.args.no_fork_server else "--fork-server"]
            env["HPCT_CONNECT_TIMEOUT"] = "30"
            self.agents = Agents(self.tmp, [*flags, *self.script], nodes=every, namespaces=self.ns, env=env)
            self.agents.start()
            self.procs = self.agents.procs
            return
        self.env = {**os.environ, **env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "eth0"}
        self._torchruns()

    def _torchruns(self) -> None:
        ckpt = ["--backend", "gloo"]
        if self.args.checkpoint_every:
            ckpt += ["--checkpoint", str(self.tmp / "ckpt.pt"), "--checkpoint-every", str(self.args.checkpoint_every)]
        self.procs = []
        for n in range(self.nodes):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.nproc),
                    "--max-restarts", "1000", "--nnodes", str(self.nodes), "--node-rank", str(n),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.ns[0].address}:{29400 + self.job_restarts}",
                    "--rdzv-id", f"{self.tag[:12]}-{self.job_restarts}", "--rdzv-conf", f"is_host={int(n == 0)}",
                    "--local-addr", self.ns[n].address, *self.script, *ckpt]
            with open(self.tmp / f"torchrun-{n}.log", "a") as log:
                self.procs.append(self.ns[n].popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                   cwd=str(self.tmp), start_new_session=True))

    def node_of(self, place: int) -> int:
        """The node whose agent (or torchrun) runs the worker at ``place`` (hpct's spare: the last)."""
        return place // self.nproc

    def lose_node(self, node: int) -> list[int]:
        """SIGKILL a node's agent and every process under it.  Stock's scheduler starts the
        whole job again from its checkpoint (a static torchrun job cannot take a node back) once
        the node is back; hpct goes on without it, and gets it back after --node-return-s."""
        agent = self.procs[node].pid
        victims = [agent, *descendants([agent])]
        for pid in victims:
            _signal(pid, signal.SIGKILL)
        self.lost.add(node)
        if self.system == "stock":
            for p in self.procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.wait(timeout=30)
            kill_tagged(TAG_VAR, self.tag)
            self.owed += 1
        if self.args.node_return_s > 0 or self.system == "stock":
            self.returns[node] = time.time() + self.args.node_return_s
        self.tick()
        return victims

    def tick(self) -> None:
        """Bring back the lost nodes that are due (``--node-return-s``: the scheduler's new node).
        hpct's agent starts again in the node's namespace: it rejoins as a replacement within the
        grace, or idle, to be grown back to or kept as a spare.  Stock's static job waits for its
        nodes, then the scheduler starts the whole job again from its checkpoint."""
        now = time.time()
        for node in [n for n, when in self.returns.items() if when <= now]:
            del self.returns[node]
            self.lost.discard(node)
            if self.system == "hpct":
                self.agents.restart(node)
        if self.system == "stock" and self.owed and not self.lost:
            self.owed = 0
            self.job_restarts += 1
            self._torchruns()

    def target(self, rank: int, pids: dict[int, int], members: list[int]) -> int:
        """The place a scheduled fault at ``rank`` hits: that place, unless no member node holds
        it now (its node was lost, or came back idle), then one of the places that still work,
        drawn by ``rank`` (hpct's spare, or a returned node, holds some)."""
        if rank in members:
            return rank
        live = [p for p in members if pids.get(p, -1) > 0 and _alive(pids[p])]
        return live[rank % len(live)] if live else rank

    def members(self) -> list[int]:
        """The places expected to be training now: the newest view's (hpct) or every rank
        (stock), less the nodes this soak killed and the job has not replaced yet."""
        nodes = range(self.nodes)
        if self.system == "hpct":
            views = [e for n in range(self.nodes + self.spares) for e in self.agents.events(n, "view")]
            nodes = max(views, key=lambda e: e["generation"])["nodes"] if views else nodes
        return [n * self.nproc + l for n in nodes if n not in self.lost for l in range(self.nproc)]

    def pids(self) -> dict[int, int]:
        """Each place's current worker (-1 where none is known now); a place is a rank at the
        start, and hpct's spare brings places of its own."""
        if self.system == "hpct":
            starts = [e for n in range(self.nodes + self.spares) for e in self.agents.events(n, "start")]
            return gf.holders(starts, self.world, _alive)
        best: dict[int, tuple[int, int]] = {}
        for pid in descendants([p.pid for p in self.procs]):
            e = environ(pid)
            if e.get(TAG_VAR) == self.tag and "RANK" in e and "TORCHELASTIC_RESTART_COUNT" in e and _alive(pid):
                key = (int(e["TORCHELASTIC_RESTART_COUNT"]), pid)
                best[int(e["RANK"])] = max(best.get(int(e["RANK"]), key), key)
        return {r: best[r][1] if r in best else -1 for r in range(self.world)}

    def running(self) -> bool:
        return bool(self.returns) or any(p.poll() is None for p in self.procs)

    def codes(self) -> list[int | None]:
        return [p.poll() for n, p in enumerate(self.procs) if n not in self.lost]

    def logs_tail(self) -> str:
        files = sorted(self.tmp.glob("agent-*.err")) + sorted(self.tmp.glob("torchrun-*.log"))
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}" for f in files)

    def stop(self) -> None:
        if self.agents is not None:
            self.agents.stop()
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        kill_tagged(TAG_VAR, self.tag)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _first_step(job: Job, deadline: float) -> float:
    """time.time() when every rank has completed a step (the schedule's zero)."""
    from hpct.testing.cluster import progress
    while min(progress(job.out, r) for r in range(job.world)) < 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{job.system}: not every rank completed a step in time\n{job.logs_tail()}")
        if not job.running():
            raise RuntimeError(f"{job.system}: a launcher exited before the first step\n{job.logs_tail()}")
        time.sleep(0.02)
    return time.time()


def run(system: str, ns, args, steps: int, step_time: float, faults: list[gf.Fault], net=None,
        calibration: bool = False) -> dict:
    """One job to its end, the faults applied on schedule; its step logs, records and faults.
    ``net``: the lossy network (hpct/testing/lossy.py) whose links the ``lossy`` faults impair;
    ``calibration``: without faults, and without a fork server also without standbys and spare (Job)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"hpct-goodput-{system}-"))
    job = Job(system, tmp, ns, args, steps, step_time, calibration)
    injected: list[dict] = []
    started = time.time()
    deadline = time.monotonic() + args.timeout
    conts: list[tuple[float, int]] = []
    impaired: dict[int, float] = {}        # node -> when its link heals
    try:
        job.start()
        zero = _first_step(job, deadline)
        todo = list(faults)
        while job.running():
            job.tick()
            now = time.time()
            for when, pid in [c for c in conts if c[0] <= now]:
                _signal(pid, signal.SIGCONT)
                conts.remove((when, pid))
            for node in [n for n, until in impaired.items() if until <= now]:
                net.impair(node)
                del impaired[node]
            if todo and now >= zero + todo[0].at_s:
                f = todo[0]
                pids, members = job.pids(), job.members()
                place = job.target(f.rank, pids, members)
                victim = pids.get(place, -1)
                if victim > 0 and not _alive(victim):
                    victim = -1
                if victim < 0 and now < zero + f.at_s + MAX_DELAY_S:
                    time.sleep(0.01)        # the rank is between processes (a restart): hit the next one
                    continue
                todo.pop(0)
                f = gf.Fault(f.at_s, f.kind, place, job.target(f.other, pids, members) if f.other >= 0 else -1)
                if victim > 0 and f.kind in ("node", "lossy"):
                    node = job.node_of(f.rank)
                    ranks = [r for r in pids if job.node_of(r) == node]
                    t = time.time()
                    if f.kind == "node":
                        job.lose_node(node)
                        what = f"node {node} lost"
                    else:
                        net.impair(node, loss=gf.LOSSY_LOSS, delay_ms=gf.LOSSY_DELAY_MS)
                        impaired[node] = t + args.lossy_s
                        what = f"node {node}'s link lossy for {args.lossy_s:g} s"
                    injected.append({**f.__dict__, "t": t, "pid": victim, "pids": pids, "members": members,
                                     "node": node, "ranks": ranks, "delayed_s": round(t - zero - f.at_s, 3)})
                    print(f"  {system}: t+{t - zero:6.1f} s {what} (ranks {ranks})", file=sys.stderr, flush=True)
                elif victim > 0:
                    sig = signal.SIGSTOP if f.kind.startswith("stop") or f.kind == "hang" else signal.SIGKILL
                    t = time.time()
                    if _signal(victim, sig):
                        injected.append({**f.__dict__, "t": t, "pid": victim, "pids": pids, "members": members,
                                         "delayed_s": round(t - zero - f.at_s, 3)})
                        print(f"  {system}: t+{t - zero:6.1f} s {f.kind} rank {f.rank} (pid {victim})",
                              file=sys.stderr, flush=True)
                        if f.kind.startswith("stop"):
                            conts.append((t + (args.stop_s if f.kind == "stop" else args.stop_long_s), victim))
                        if f.kind == "during":
                            time.sleep(args.during_s)
                            second = job.pids().get(f.other, -1)
                            if second > 0 and _signal(second, signal.SIGKILL):
                                injected[-1]["other_pid"] = second
            if time.monotonic() > deadline:
                raise TimeoutError(f"{system}: the job ran past --timeout {args.timeout:g} s\n{job.logs_tail()}")
            time.sleep(0.01)
        ended = time.time()
        codes = job.codes()
        error = None if all(c == 0 for c in codes) else f"{system}: launchers exited {codes}\n{job.logs_tail()}"
    except (TimeoutError, RuntimeError, OSError) as err:
        ended, error = time.time(), str(err)
    finally:
        for _, pid in conts:
            _signal(pid, signal.SIGCONT)
        for node in impaired:
            net.impair(node)
        job.stop()
    logs = gf.step_log(job.out, job.world)
    records = [json.loads(p.read_text()) for p in job.out.glob("rank*-pid*.json")]
    digests = sorted({r["digest"] for r in records})
    first = min((rows[0][1] for rows in logs.values() if rows), default=ended)
    last = max((rows[-1][1] for rows in logs.values() if rows), default=ended)
    return {"system": system, "folder": str(tmp), "error": error, "wall_s": ended - started,
            "startup_s": round(first - started, 2), "shutdown_s": round(ended - last, 2),
            "job_restarts": job.job_restarts,
            "logs": logs, "digests": digests, "injected": injected, "tmp": tmp,
            "unexplained_moves": gf.unexplained_moves(tmp, injected, args.lossy_s) if system == "hpct" else [],
            "final_world": min((r["world_size"] for r in records), default=None)}


def _reference(system: str, reduction: str, ns, args) -> dict:
    """The fault-free run's digest for ``reduction``: from the cache, else run (``system``, no
    faults, no simulated compute) and kept when clean."""
    ref_key = goodput_reference.key(EXAMPLE, torch_version(), args.nodes, args.nproc, args.steps, reduction)
    cached = None if args.fresh_reference else goodput_reference.load(ref_key)
    if cached:
        print(f"goodput: the fault-free digest of these {args.steps} steps ({reduction} order) from "
              f"{goodput_reference.folder() / ref_key}.json (--fresh-reference runs it again)",
              file=sys.stderr, flush=True)
        return goodput_reference.cached_result(cached, system)
    result = run(system, ns, args, args.steps, 0.0, [])
    goodput_reference.store(ref_key, result)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="3x2", help="NODESxWORKERS, one network namespace per node")
    ap.add_argument("--minutes", type=float, default=3.0, help="fault-free training time of the job")
    ap.add_argument("--mtbf", type=float, default=20.0, help="mean seconds between faults, whole job")
    ap.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: random, printed)")
    ap.add_argument("--kinds", default="kill,stop,stop-long,during", help=f"comma list of {', '.join(gf.KINDS)}")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of hpct, stock")
    ap.add_argument("--step-time", type=float, default=0.1, help="seconds of simulated compute per step")
    ap.add_argument("--checkpoint-every", type=int, default=20, help="stock: steps between checkpoints")
    ap.add_argument("--stop-s", type=float, default=1.0, help="how long a SIGSTOPped worker stays stopped")
    ap.add_argument("--stop-long-s", type=float, default=15.0, help="a long SIGSTOP (past --op-timeout)")
    ap.add_argument("--op-timeout", type=float, default=10.0, help="examples/ddp.py's collective timeout")
    ap.add_argument("--node-return-s", type=float, default=0.0,
                    help="seconds until the scheduler has a lost node back: hpct's agent starts again there, "
                         "stock's job restarts when all its nodes are back (0: stock at once, hpct never)")
    ap.add_argument("--lossy-s", type=float, default=60.0, help="how long a lossy link stays lossy")
    ap.add_argument("--during-s", type=float, default=0.3, help="the second kill's delay in a 'during' fault")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per job (default: 3x --minutes + 120)")
    ap.add_argument("--keep", action="store_true", help="keep every job's folder (failed jobs' always)")
    ap.add_argument("--no-fork-server", action="store_true", help="hpct: start each worker as an interpreter of "
                    "its own (hpct run without --fork-server)")
    ap.add_argument("--steps", type=int, default=None,
                    help="the job's steps (default: as many as --minutes holds at the calibrated step time); "
                         "the same steps, seed and job reuse the cached fault-free digest")
    ap.add_argument("--fresh-reference", action="store_true",
                    help="run the fault-free reference job even when its digest is cached (benchmarks/goodput_reference.py)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    from goodput_report import check_args, report
    check_args(args, ap)
    from hpct.testing.netns import netns_network, unavailable_reason
    if why := unavailable_reason():
        print(f"goodput: {why}", file=sys.stderr)
        return 1
    print(f"goodput: seed {args.seed} (rerun with --seed {args.seed})", file=sys.stderr, flush=True)
    results = {}
    lossy = "lossy" in args.kinds
    if lossy:
        from hpct.testing.lossy import lossy_network
        network = lossy_network(args.nodes + 1, name_prefix="hpct-bgood", subnet=SUBNET,
                                max_seconds=5 * args.timeout + 600)
    else:
        network = netns_network(args.nodes + 1, name_prefix="hpct-bgood", subnet=SUBNET)
    with network as net:        # + 1 node: hpct's spare
        ns = net.nodes if lossy else net
        timed = calibration_steps(args.minutes, args.step_time)
        for system in args.systems:
            results[f"{system}-calibration"] = run(system, ns, args, timed, args.step_time, [], calibration=True)
        # past its warm-up: the first 5 of 100 steps, 20 of 400
        step_s = {s: gf.fault_free_step_s(results[f"{s}-calibration"]["logs"], skip=max(5, timed // 20))
                  if results[f"{s}-calibration"]["error"] is None else None for s in args.systems}
        known = [v for v in step_s.values() if v]
        job_steps, args.steps = args.steps, timed
        if not known:
            print(report(results, step_s, [], args)[1])
            return 1
        horizon = args.minutes * 60
        # the same job for both systems: --minutes of fault-free steps, unless --steps says how many
        args.steps = job_steps or max(CALIBRATION_STEPS, round(horizon / known[0]))
        print(f"goodput: {args.steps} steps (rerun the same job with --seed {args.seed} --steps {args.steps})",
              file=sys.stderr, flush=True)
        # each system against a fault-free run of its reduction order (goodput_reference.order)
        world, ran = args.nodes * args.nproc, {}
        for system in args.systems:
            reduction = goodput_reference.order(system, world)
            if reduction not in ran:
                ran[reduction] = _reference("stock" if reduction == "gloo" else system, reduction, ns, args)
            results[f"reference-{system}"] = ran[reduction]
        faults = gf.schedule(args.seed, args.mtbf, horizon * 0.9, args.nodes * args.nproc, args.kinds)
        for system in args.systems:
            results[system] = run(system, ns, args, args.steps, args.step_time, faults, net if lossy else None)
    doc, text, ok = report(results, step_s, faults, args)
    print(text)
    for r in results.values():
        if r["error"] is None and not args.keep and ok and r["tmp"] is not None:
            import shutil
            shutil.rmtree(r["tmp"], ignore_errors=True)
    if args.json:
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps({**doc, "torch": torch_version(), "cpus": os.cpu_count()}, indent=1) + "\n")
        os.replace(tmp, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
