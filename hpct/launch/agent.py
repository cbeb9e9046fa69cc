"""One node's agent: starts its workers, replaces a lost one in place, and answers its workers'
``hd.recover()``.  Three collaborators, each handed what it uses: the view of the job and its
rules (view.py's ``View``), the talk with the other agents and the workers (membership.py's
``Membership``), and what a worker's end or silence makes it do (losses.py's ``Losses``).

No agent is special.  Each listens at ``hosts[node]:HPCT_AGENT_PORT``.  A lost worker (ended
by a signal) moves the job's view one generation on and its replacement starts in that
generation with the same rank; the survivors ask the agent and re-form in it.  A worker's own
failure (a non-zero exit after its world formed) is retried ``--max-restarts`` times for that
rank; one that never formed a world at the first start ends the job at once.

A node outside the view (a spare, or a node that was dropped and whose agent came back) is
idle: it keeps ``nproc_per_node`` warm standbys and starts its workers, at the view's
generation, when the view takes it in.  A node that finds itself dropped while alive stops its
workers and becomes idle, so the members can take it back.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

from .. import wire
from ..config import VARIABLES, Config
from ..errors import LaunchError
from .events import EventLog
from .forkserver import ForkServer
from .health import stranded
from .losses import Losses
from .membership import ASK_TIMEOUT_S, FINAL_TRIES, Membership
from .options import STOP_GRACE_S, RunOptions
from .pool import Pool, Worker, standbys_due
from .procs import stop
from .view import JobEnd, View

POLL_S = 0.02                 # worker exits are noticed within this
FORK_READY_S = 120.0          # a fork server not warm by then (torch not importable?): workers start cold


class NodeAgent:
    def __init__(self, opts: RunOptions, env: dict[str, str]) -> None:
        self.opts, self.node = opts, opts.node_rank
        self.cfg = Config.from_mapping({k: v for k, v in env.items() if k in _CONFIG_NAMES - _PER_WORKER} |
                                       dict(opts.port_env) | {"N_PROC_PER_NODE": str(opts.nproc_per_node)})
        self.port = self.cfg.agent_port or self.cfg.default_agent_port
        # Names (Slurm's node001, a pod's DNS name) resolve once: every process then uses addresses.
        self.addrs = tuple(_resolve(h) for h in opts.hosts)
        self.events = EventLog(self.node, opts.json_log)
        self.active = False                      # this node's workers hold its slot
        self.took_slot = 0.0                     # when they started (monotonic)
        self.finished_here = False               # a worker of this node exited 0: its world is over
        self.left_view = False                   # the view lost this node while its workers ran
        self.workers: dict[int, Worker] = {}     # local rank -> its worker (Membership and Losses share it)
        self.signalled: int | None = None
        self.view = View(self.node, opts, self.events, push=lambda message: self.membership.tell_peers(message),
                         on_moved=self._view_moved, stopping=lambda: self.signalled is not None)
        self.membership = Membership(self.view, opts=opts, addrs=self.addrs, port=self.port,
                                     connect_timeout=self.cfg.connect_timeout, workers=self.workers,
                                     events=self.events, signalled=lambda: self.signalled)
        self.losses = Losses(self.view, workers=self.workers, start=self._start, events=self.events,
                             max_restarts=opts.max_restarts, stopped_grace=opts.stopped_grace,
                             default_bound_s=self.cfg.connect_timeout)
        self.base_env = self._base_env(env)
        self.pool = Pool(opts.command, opts.python_script, opts.log_dir / f"node{self.node}", opts.standby,
                         self.base_env, on_ready=lambda pid: self.events.emit("standby", f"pid {pid} ready",
                                                                              pid=pid),
                         on_failed=lambda pid, text, **f: self.events.emit("standby-failed", f"pid {pid} {text}",
                                                                           pid=pid, **f))

    # -- the workers' environment: torchrun's variables, then hpct's --------------------------
    def _base_env(self, env: dict[str, str]) -> dict[str, str]:
        o = self.opts
        base = {k: v for k, v in env.items() if not k.startswith("HPCT_")}
        base.update({"LOCAL_WORLD_SIZE": str(o.nproc_per_node), "GROUP_RANK": str(self.node),
                     "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": o.run_id,
                     "TORCHELASTIC_MAX_RESTARTS": str(o.max_restarts), "MASTER_ADDR": self.addrs[0],
                     "MASTER_PORT": str(self.port + 1), "HPCT_USE_ROOTLESS": "1",
                     "HPCT_HOSTS": ",".join(self.addrs), "N_PROC_PER_NODE": str(o.nproc_per_node),
                     "HPCT_AGENT_PORT": str(self.port), **dict(o.port_env)})
        base.update({k: env[k] for k in _CONFIG_NAMES - _PER_WORKER if k.startswith("HPCT_") and k in env})
        if o.nproc_per_node > 1:
            base.setdefault("OMP_NUM_THREADS", "1")      # torchrun's default too
        return base

    def _start(self, local_rank: int, restarts: int = 0, world: tuple[list[int], int] | None = None) -> None:
        place = self.node * self.opts.nproc_per_node + local_rank
        plan, gen = world or self.view.world()
        if place not in plan:
            raise JobEnd(1, f"place {place} is not in the world of generation {gen}")
        rank = plan.index(place)
        env = dict(self.base_env, RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(len(plan)),
                   ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(len(plan)), HPCT_GENERATION=str(gen),
                   TORCHELASTIC_RESTART_COUNT=str(restarts))
        if plan != list(range(len(plan))):     # a shrunk world: each survivor kept its address
            env["HPCT_PLAN_PLACES"] = ",".join(map(str, plan))
        w = self.pool.start(place, local_rank, rank, gen, env, warm_ok=gen > 0)
        self.workers[local_rank] = w
        self.events.emit("start", f"rank {rank} pid {w.proc.pid} generation {gen} ({w.why}), log {w.log}",
                         rank=rank, place=place, pid=w.proc.pid, generation=gen, warm=w.warm, why=w.why, log=str(w.log))
        if gen > 0:
            self.pool.fill()

    # -- the agent's life ----------------------------------------------------------------------
    def run(self) -> int:
        o = self.opts
        try:
            server = wire.Server(self.addrs[self.node], self.port, self.membership.handle)
        except OSError as err:
            raise LaunchError(f"node {self.node}'s agent cannot listen at {o.hosts[self.node]}:{self.port}: "
                              f"{err.strerror or err}",
                              fix="another agent already holds this node rank here (give each agent its own "
                                  "--node-rank), the host is not this machine, or set HPCT_AGENT_PORT "
                                  "to a free port on every node") from None
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.events.emit("agent", f"node {self.node} of {o.nnodes} at {o.hosts[self.node]}:{self.port}, "
                             f"job {o.run_id!r}, hosts from {o.host_source}, logs in {o.log_dir}",
                             port=self.port, pid=os.getpid(), hosts=list(o.hosts), run_id=o.run_id)
            if o.fork_server:           # it imports torch while the agents find each other
                self.pool.forks = ForkServer(self.pool.log_dir / "fork-server.log", self.base_env)
            for flag in o.unused:
                self.events.emit("unused", f"{flag} is not used: agents find each other from the host list "
                                 "and the port plan", flag=flag)
            self.membership.greet()
            view = self.view
            with view.cond:
                if self.node in view.nodes and (view.generation > 0 or self.membership.restarted):
                    # This node's agent restarted before the others dropped it: its slot is
                    # empty, so its workers start again as replacements, one generation on.
                    view.move(view.generation + 1, view.nodes, f"node {self.node}'s agent came back")
            if self.node not in view.nodes:
                self._idle_wait()
                self.pool.fill()         # a member's standbys wait for its workers' world (_watch)
            threading.Thread(target=self.membership.heartbeat, name="hpct-agent-heartbeat", daemon=True).start()
            code = self._watch()
        except JobEnd as end:
            code = self._finish(end)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            server.close()
            self.events.close()
        return code

    def _on_signal(self, signum, frame) -> None:
        self.signalled = signum

    def _view_moved(self, generation: int, grow: bool) -> None:
        """The view moved (its lock is held)."""
        if self.active and self.node not in self.view.nodes:
            self.left_view = True        # even if taken back at once: its workers' world is gone
        self.losses.view_moved(generation, grow)

    def _idle_wait(self) -> None:
        """Outside the view: keep a warm standby for every local rank until taken in (with a fork
        server, the slot's workers are forked from it instead)."""
        o = self.opts
        view = self.view
        self.events.emit("idle", f"node {self.node} is outside the view (generation {view.generation}, nodes "
                         f"{view.nodes}): it waits to take a lost node's slot or to join by grow",
                         generation=view.generation, nodes=view.nodes)
        if o.python_script and self.pool.forks is None:     # a fork server starts a slot's workers as fast
            self.pool.size = max(o.standby, o.nproc_per_node)

    def _take_slot(self) -> None:
        # The world this node was admitted to.  Its first workers start in it even if the view moves
        # while they wait for the fork server below, as spawned ones started at once would have:
        # an original member's first workers are then still generation 0's, which hold the seeded
        # state (a script takes a process started above generation 0 for a replacement, without
        # state), and they follow the view to its newer world as they connect.
        with self.view.cond:
            admitted = self.view.world()
        forks = self.pool.forks
        if forks is not None and not forks.ready.is_set():
            t0 = time.monotonic()      # its one import of torch, against one per worker
            while not forks.ready.wait(0.1) and forks.alive() and time.monotonic() - t0 < FORK_READY_S \
                    and self.signalled is None and self.view.end is None:
                pass
            ready = forks.ready.is_set()
            self.events.emit("fork-server", f"pid {forks.proc.pid} " + (
                f"ready after {time.monotonic() - t0:.1f} s more" if ready else
                f"not ready within {FORK_READY_S:g} s: workers start cold (its log {forks.log})"),
                pid=forks.proc.pid, ready=ready)
        with self.view.cond:
            member = self.node in self.view.nodes
        if not member:                  # the view gave the slot away meanwhile (a slow node's, say)
            self._idle_wait()
            self.membership.tell_peers(self.membership.hello_request())
            self.pool.fill()
            return
        gen = admitted[1]
        self.events.emit("admitted", f"node {self.node} holds a slot of generation {gen}: its workers start",
                         generation=gen)
        self.active, self.pool.size, self.took_slot = True, self.opts.standby, time.monotonic()
        for local in range(self.opts.nproc_per_node):
            self._start(local, world=admitted)

    def _step_down(self) -> None:
        with self.view.cond:
            gen, self.view.gone, self.left_view = self.view.generation, {}, False
        self.events.emit("dropped", f"node {self.node} is not in the view of generation {gen}: its workers "
                         "stop and it says hello again, to be taken back", generation=gen)
        self.active = False
        workers = list(self.workers.values())
        self.workers.clear()
        stop([w.proc for w in workers], STOP_GRACE_S)
        self.membership.tell_peers(self.membership.hello_request())
        self._idle_wait()
        self.pool.fill()

    def _idle_over(self) -> bool:
        """An idle node ends with the job: every member finished, or none answers any more."""
        if self.view.others_finished():
            return True
        limit = self.opts.node_grace + 4 * ASK_TIMEOUT_S
        with self.view.cond:
            members, now = [n for n in self.view.nodes if n != self.node], time.monotonic()
            quiet = all(self.view.silent(n, now, limit) for n in members)
        if quiet:
            raise JobEnd(LaunchError.exit_code, f"no node of the view {members} answered this idle node "
                         f"for {limit:g} s", fix="the job ended or this node lost its "
                         "network: check the members' event logs")
        return False

    def _watch(self) -> int:
        while True:
            if self.signalled is not None:
                raise JobEnd(128 + self.signalled, f"stopped by signal {self.signalled}: workers stopped, "
                             "the other nodes are told this node leaves", False)
            if self.view.end is not None:
                raise self.view.end
            with self.view.cond:
                member = self.node in self.view.nodes
            if member and not self.active:
                self._take_slot()
            elif (self.left_view or not member) and self.active:
                self._step_down()
            if not self.active:
                if self._idle_over():
                    self.events.emit("done", "the job's members finished; this node was not needed", code=0)
                    return 0
                time.sleep(POLL_S)
                continue
            lost, others_done = [], self.view.others_finished()
            for local, w in list(self.workers.items()):
                if (others_done or self.finished_here) and (when := stranded(w)):
                    # Killed after the job's last collective, or in its final barrier when the barrier
                    # let some ranks through: the others' world can never form again.
                    who = "the job's other nodes" if others_done else "a worker of this node"
                    stop([w.proc], STOP_GRACE_S)
                    self.events.emit("exit", f"rank {w.rank} pid {w.proc.pid} stopped: {who} finished {when}",
                                     rank=w.rank, code=0)
                    del self.workers[local]
                    continue
                code = w.proc.poll()
                if code is None:
                    continue
                if code == 0:
                    self.events.emit("exit", f"rank {w.rank} pid {w.proc.pid} finished", rank=w.rank, code=0)
                    self.finished_here = True
                    del self.workers[local]
                    continue
                with self.view.cond:
                    stale = not w.joined and w.generation < self.view.generation
                if stale:
                    self.losses.restart_stale(local, w, code)
                    continue
                lost.append((local, w, code))
            if lost:
                self.losses.replace(lost)
            self.losses.reap_no_shows()
            if standbys_due(self.workers.values(), self.took_slot, time.monotonic()):
                self.pool.fill()              # standbys that died are reported and replaced (backoff)
            if not self.workers:
                self.membership.tell_peers({"op": "leave", "node": self.node, "reason": "done"},
                                           self.view.contacts(), FINAL_TRIES)
                self.events.emit("done", "every worker of this node finished", code=0)
                return 0
            time.sleep(POLL_S)

    def _finish(self, end: JobEnd) -> int:
        if self.view.end is None or self.view.end is end:
            reason = "signal" if self.signalled is not None else "end"
            self.view.end = end
            if reason == "signal" or not end.from_peer:
                self.membership.tell_peers({"op": "leave", "node": self.node, "reason": reason, "code": end.code,
                                            "why": end.message.splitlines()[0]}, self.view.contacts(), FINAL_TRIES)
        self.events.emit("end", end.message, code=end.code)
        stop([w.proc for w in self.workers.values()], STOP_GRACE_S)
        self.pool.close()
        if end.error and end.code == LaunchError.exit_code:
            raise LaunchError(end.message, fix=end.fix or "see the agents' event logs (--json) on every node")
        return end.code


def _resolve(host: str) -> str:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as err:
        raise LaunchError(f"host {host!r} of the host list does not resolve: {err}",
                          fix="list addresses, or names this node's resolver knows (/etc/hosts, DNS)") from None
    ipv4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
    return ipv4[0] if ipv4 else infos[0][4][0]


# Set per worker by the agent, or replaced by the agent's own host list.
_PER_WORKER = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "N_PROC_PER_NODE",
                         "HPCT_HOSTS", "HPCT_HOSTFILE", "HPCT_GENERATION", "HPCT_PLAN_PLACES"})
_CONFIG_NAMES = frozenset(v.name for v in VARIABLES)
