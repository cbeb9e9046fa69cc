"""One node's agent: starts its workers, replaces a lost one in place, and answers its workers'
``hd.recover()``; agreeing with the other agents is membership.py's half, and what a worker's
end or silence makes it do is losses.py's.

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

from ..config import VARIABLES, Config
from ..errors import LaunchError
from .. import wire
from .events import EventLog
from .forkserver import ForkServer
from .links import LinkTimes
from .losses import Losses
from .membership import ASK_TIMEOUT_S, FINAL_TRIES, JobEnd, Membership
from .options import STOP_GRACE_S, RunOptions
from .health import stranded
from .pool import Pool, Worker, standbys_due
from .procs import stop

POLL_S = 0.02                 # worker exits are noticed within this
FOLLOWS_S = 1.0               # a worker that asked about the view this recently follows a newer one itself
FORK_READY_S = 120.0          # a fork server not warm by then (torch not importable?): workers start cold


class NodeAgent(Losses, Membership):
    def __init__(self, opts: RunOptions, env: dict[str, str]) -> None:
        self.opts, self.node = opts, opts.node_rank
        self.cfg = Config.from_mapping({k: v for k, v in env.items() if k in _CONFIG_NAMES - _PER_WORKER} |
                                       dict(opts.port_env) | {"N_PROC_PER_NODE": str(opts.nproc_per_node)})
        self.port = self.cfg.agent_port or self.cfg.default_agent_port
        # Names (Slurm's node001, a pod's DNS name) resolve once: every process then uses addresses.
        self.addrs = tuple(_resolve(h) for h in opts.hosts)
        self.events = EventLog(self.node, opts.json_log)
        self.cond = threading.Condition()
        self.generation, self.nodes = 0, list(range(opts.nnodes))
        self.finished: set[int] = set()
        self.gone: dict[int, float] = {}         # node -> when this agent dropped it
        self.active = False                      # this node's workers hold its slot
        self.took_slot = 0.0                     # when they started (monotonic)
        self.finished_here = False               # a worker of this node exited 0: its world is over
        self.left_view = False                   # the view lost this node while its workers ran
        self.hellos: set[int] = set()            # nodes whose agents said hello to this one
        self.restarted = False                   # a peer knew this node's agent before this one
        self.seen = {n: time.monotonic() for n in self.nodes}
        self.failing: dict[int, float] = {}      # node -> its first unanswered ask since an answer
        self.refused: dict[int, float] = {}      # node -> its first refused ask, every ask since refused
        self.leaving: dict[int, float] = {}
        self.workers: dict[int, Worker] = {}
        self.restarts: dict[int, int] = {}
        self.broke_at: float | None = None       # the last view move that broke the members' world
        self.stopped_checked = 0.0               # when the workers' states were last read (losses.py)
        self.link_times = LinkTimes()            # this agent's answered asks per peer (links.py)
        self.heard_links: dict[int, tuple[float, dict[int, float]]] = {}   # node -> (when, its links)
        self.slow: dict[int, float] = {}         # node -> since when its links stand out
        self.end: JobEnd | None = None
        self.signalled: int | None = None
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

    def _world(self) -> tuple[list[int], int]:
        p = self.opts.nproc_per_node
        return [n * p + l for n in self.nodes for l in range(p)], self.generation

    def _start(self, local_rank: int, restarts: int = 0, world: tuple[list[int], int] | None = None) -> None:
        place = self.node * self.opts.nproc_per_node + local_rank
        plan, gen = world or self._world()
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
            server = wire.Server(self.addrs[self.node], self.port, self.handle)
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
            self._greet()
            with self.cond:
                if self.node in self.nodes and (self.generation > 0 or self.restarted):
                    # This node's agent restarted before the others dropped it: its slot is
                    # empty, so its workers start again as replacements, one generation on.
                    self._move(self.generation + 1, self.nodes, f"node {self.node}'s agent came back")
            if self.node not in self.nodes:
                self._idle_wait()
                self.pool.fill()         # a member's standbys wait for its workers' world (_watch)
            threading.Thread(target=self._heartbeat, name="hpct-agent-heartbeat", daemon=True).start()
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
        if self.active and self.node not in self.nodes:
            self.left_view = True        # even if taken back at once: its workers' world is gone
        now = time.monotonic()
        if not grow:
            self.broke_at = now
        for w in self.workers.values():      # a replacement that has not joined yet would be stale
            if (0 < w.generation < generation and not w.joined and w.proc.poll() is None
                    and now - w.watched > FOLLOWS_S):
                stop([w.proc], 0.0)

    def _idle_wait(self) -> None:
        """Outside the view: keep a warm standby for every local rank until taken in (with a fork
        server, the slot's workers are forked from it instead)."""
        o = self.opts
        self.events.emit("idle", f"node {self.node} is outside the view (generation {self.generation}, nodes "
                         f"{self.nodes}): it waits to take a lost node's slot or to join by grow",
                         generation=self.generation, nodes=self.nodes)
        if o.python_script and self.pool.forks is None:     # a fork server starts a slot's workers as fast
            self.pool.size = max(o.standby, o.nproc_per_node)

    def _take_slot(self) -> None:
        # The world this node was admitted to.  Its first workers start in it even if the view moves
        # while they wait for the fork server below, as spawned ones started at once would have:
        # an original member's first workers are then still generation 0's, which hold the seeded
        # state (a script takes a process started above generation 0 for a replacement, without
        # state), and they follow the view to its newer world as they connect.
        with self.cond:
            admitted = self._world()
        forks = self.pool.forks
        if forks is not None and not forks.ready.is_set():
            t0 = time.monotonic()      # its one import of torch, against one per worker
            while not forks.ready.wait(0.1) and forks.alive() and time.monotonic() - t0 < FORK_READY_S \
                    and self.signalled is None and self.end is None:
                pass
            ready = forks.ready.is_set()
            self.events.emit("fork-server", f"pid {forks.proc.pid} " + (
                f"ready after {time.monotonic() - t0:.1f} s more" if ready else
                f"not ready within {FORK_READY_S:g} s: workers start cold (its log {forks.log})"),
                pid=forks.proc.pid, ready=ready)
        with self.cond:
            member = self.node in self.nodes
        if not member:                  # the view gave the slot away meanwhile (a slow node's, say)
            self._idle_wait()
            self._tell_peers(self._hello_request())
            self.pool.fill()
            return
        gen = admitted[1]
        self.events.emit("admitted", f"node {self.node} holds a slot of generation {gen}: its workers start",
                         generation=gen)
        self.active, self.pool.size, self.took_slot = True, self.opts.standby, time.monotonic()
        for local in range(self.opts.nproc_per_node):
            self._start(local, world=admitted)

    def _step_down(self) -> None:
        with self.cond:
            gen, self.gone, self.left_view = self.generation, {}, False
        self.events.emit("dropped", f"node {self.node} is not in the view of generation {gen}: its workers "
                         "stop and it says hello again, to be taken back", generation=gen)
        self.active = False
        workers, self.workers = list(self.workers.values()), {}
        stop([w.proc for w in workers], STOP_GRACE_S)
        self._tell_peers(self._hello_request())
        self._idle_wait()
        self.pool.fill()

    def _idle_over(self) -> bool:
        """An idle node ends with the job: every member finished, or none answers any more."""
        if self._others_finished():
            return True
        limit = self.opts.node_grace + 4 * ASK_TIMEOUT_S
        with self.cond:
            members, now = [n for n in self.nodes if n != self.node], time.monotonic()
            quiet = all(self._silent(n, now, limit) for n in members)
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
            if self.end is not None:
                raise self.end
            with self.cond:
                member = self.node in self.nodes
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
            lost, others_done = [], self._others_finished()
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
                with self.cond:
                    stale = not w.joined and w.generation < self.generation
                if stale:
                    self._restart_stale(local, w, code)
                    continue
                lost.append((local, w, code))
            if lost:
                self._replace(lost)
            self._reap_no_shows()
            if standbys_due(self.workers.values(), self.took_slot, time.monotonic()):
                self.pool.fill()              # standbys that died are reported and replaced (backoff)
            if not self.workers:
                self._tell_peers({"op": "leave", "node": self.node, "reason": "done"}, self._contacts(),
                                 FINAL_TRIES)
                self.events.emit("done", "every worker of this node finished", code=0)
                return 0
            time.sleep(POLL_S)

    def _finish(self, end: JobEnd) -> int:
        if self.end is None or self.end is end:
            reason = "signal" if self.signalled is not None else "end"
            self.end = end
            if reason == "signal" or not end.from_peer:
                self._tell_peers({"op": "leave", "node": self.node, "reason": reason, "code": end.code,
                                  "why": end.message.splitlines()[0]}, self._contacts(), FINAL_TRIES)
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
