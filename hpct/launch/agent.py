"""One node's agent: starts its workers, replaces a lost one in place, agrees the job's membership
and generation with the other agents, and answers its workers' ``hd.recover()``.

No agent is special.  Each listens at ``hosts[node]:HPCT_AGENT_PORT`` and holds a *view*: the
generation and the active nodes.  A view changes only by growing its generation; agents push a
change to every peer at once and carry their view on every heartbeat, and a view with a newer
generation wins (an equal generation with other nodes takes the nodes both hold, one
generation on).  A lost worker (ended by a signal) moves the view one generation on and its
replacement starts in that generation with the same rank; the survivors ask the agent and
re-form in it.  A silent node (``--node-grace``) is dropped, and the survivors shrink, only
while a strict majority of the last view's nodes remain: the other side stops, so a network
split never leaves two worlds training.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

from ..config import VARIABLES, Config
from ..errors import LaunchError
from . import wire
from .events import EventLog
from .options import STOP_GRACE_S, RunOptions
from .workers import Pool, Worker, stop, tail

POLL_S = 0.02                 # worker exits are noticed within this
HEARTBEAT_S = 0.5             # agents ask each other this often
ASK_TIMEOUT_S = 2.0
SETTLE_S = 1.0                # a peer's leave waits this long: if this agent is signalled too, it is a cancel


class JobEnd(Exception):
    """The job ends on this node with ``code`` (the message says why; LaunchError's when set)."""

    def __init__(self, code: int, message: str, error: bool = True, fix: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.error, self.fix = code, message, error, fix


SAME_JOB_FIX = ("start every agent of a job with the same --rdzv-id, --nnodes, --nproc-per-node and host list, "
                "and each with its own --node-rank")


class NodeAgent:
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
        self.seen = {n: time.monotonic() for n in self.nodes}
        self.leaving: dict[int, float] = {}
        self.workers: dict[int, Worker] = {}
        self.restarts: dict[int, int] = {}
        self.end: JobEnd | None = None
        self.signalled: int | None = None
        self.base_env = self._base_env(env)
        self.pool = Pool(opts.command, opts.python_script, opts.log_dir / f"node{self.node}", opts.standby,
                         self.base_env, on_ready=lambda pid: self.events.emit("standby", f"pid {pid} ready",
                                                                              pid=pid))

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

    def _start(self, local_rank: int, restarts: int = 0) -> None:
        place = self.node * self.opts.nproc_per_node + local_rank
        plan, gen = self._world()
        if place not in plan:
            raise JobEnd(1, f"place {place} is not in the world of generation {gen}")
        rank = plan.index(place)
        if plan != list(range(len(plan))) and gen > 0:
            raise JobEnd(1, f"rank {rank} (place {place}) was lost after the world shrank: starting a "
                            "replacement into a shrunk world is not supported yet")
        env = dict(self.base_env, RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(len(plan)),
                   ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(len(plan)), HPCT_GENERATION=str(gen),
                   TORCHELASTIC_RESTART_COUNT=str(restarts))
        w = self.pool.start(place, local_rank, rank, gen, env, warm_ok=gen > 0)
        self.workers[local_rank] = w
        self.events.emit("start", f"rank {rank} pid {w.proc.pid} generation {gen}"
                         f"{' (standby)' if w.warm else ''}, log {w.log}", rank=rank, pid=w.proc.pid,
                         generation=gen, warm=w.warm, log=str(w.log))
        if gen > 0:
            self.pool.fill()

    # -- requests from workers and peers ------------------------------------------------------
    def handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "hello":
            return self._hello(req)
        if op == "ping":
            self._merge(req.get("generation", -1), req.get("nodes", []), req.get("node"))
            return self._view()
        if op == "leave":
            with self.cond:
                n = req.get("node")
                if req.get("reason") == "done":
                    self.finished.add(n)
                elif req.get("reason") == "end" and self.end is None:
                    self.end = JobEnd(int(req.get("code", 1)), f"the job ended on node {n}: {req.get('why')}")
                else:
                    self.leaving.setdefault(n, time.monotonic())
                self.cond.notify_all()
            return {"ok": True}
        if op == "joined":
            with self.cond:
                for w in self.workers.values():
                    if w.proc.pid == req.get("pid") or (w.place == req.get("place")
                                                        and w.generation == req.get("generation")):
                        w.joined = True
            return {"ok": True}
        if op == "world":
            return self._answer_world(int(req.get("place", -1)), int(req.get("formed", -1)))
        return {"error": f"unknown request {op!r}"}

    def _view(self) -> dict:
        with self.cond:
            return {"generation": self.generation, "nodes": list(self.nodes), "node": self.node}

    def _hello(self, req: dict) -> dict:
        o, mine = self.opts, {"run_id": self.opts.run_id, "nnodes": self.opts.nnodes,
                              "nproc_per_node": self.opts.nproc_per_node, "hosts": list(self.opts.hosts)}
        for key, value in mine.items():
            if req.get(key) != value:
                why = (f"the agent of node {req.get('node')} has {key} {req.get(key)!r}, the agent of node "
                       f"{self.node} has {value!r}")
                self._refuse(why)
                return {"error": why}
        with self.cond:
            dropped = req.get("node") not in self.nodes
        if dropped:
            return {"error": f"node {req.get('node')} was dropped from this job at generation {self.generation}; "
                             "hpct run does not take a node back yet"}
        if req.get("node") == self.node:
            why = f"two agents claim node rank {self.node} (at {o.hosts[self.node]} and another host)"
            self._refuse(why)
            return {"error": why}
        self.seen[req.get("node")] = time.monotonic()
        return {"ok": True, **self._view()}

    def _refuse(self, why: str) -> None:
        with self.cond:
            if self.end is None:
                self.end = JobEnd(LaunchError.exit_code, f"refused at start: {why}", fix=SAME_JOB_FIX)
            self.cond.notify_all()

    def _answer_world(self, place: int, formed: int) -> dict:
        deadline = time.monotonic() + self.opts.node_grace + 2 * HEARTBEAT_S
        with self.cond:
            while self.generation <= formed and time.monotonic() < deadline and self.end is None:
                self.cond.wait(timeout=0.05)
        if self.generation <= formed:
            self._probe()
        with self.cond:
            if self.generation <= formed:       # nobody was lost: the same members, re-formed
                self._move(formed + 1, self.nodes, "re-form asked by a worker")
            plan, gen = self._world()
        if place not in plan:
            return {"error": f"place {place} is not in the world of generation {gen}"}
        return {"generation": gen, "world_size": len(plan), "rank": plan.index(place), "plan_ranks": plan}

    def _probe(self) -> None:
        """Ask every peer now; the ones that do not answer are lost (a worker is waiting)."""
        silent = []
        for n in self._peers():
            try:
                wire.ask(self.addrs[n], self.port, {"op": "ping", **self._view()}, ASK_TIMEOUT_S)
            except wire.WireError:
                silent.append(n)
        if silent:
            self._drop(silent, [])

    def _drop(self, silent: list[int], left: list[int]) -> None:
        with self.cond:
            silent = [n for n in silent if n in self.nodes]
            left = [n for n in left if n in self.nodes and n not in silent]
            if not (silent or left) or self.signalled is not None or self.end is not None:
                return
            why = "; ".join([f"node {n} silent for {self.opts.node_grace:g} s" for n in silent] +
                            [f"node {n} left" for n in left])
            self.events.emit("node-lost", why, nodes=silent + left)
            self._move(self.generation + 1, [n for n in self.nodes if n not in silent + left], why)

    # -- the view ------------------------------------------------------------------------------
    def _move(self, generation: int, nodes: list[int], why: str) -> None:
        """Caller holds the lock.  Take a newer view and push it to every peer."""
        before = len(self.nodes)
        self.generation, self.nodes = generation, sorted(nodes)
        if len(self.nodes) * 2 <= before and len(self.nodes) < before:
            self.end = JobEnd(LaunchError.exit_code,
                              f"{len(self.nodes)} of the last view's {before} nodes remain here, no majority: "
                              "stopping, so that a split network never trains two worlds",
                              fix="the side holding the majority goes on; check this node's network, then "
                                  "start a new job (or add capacity to the running one with hd.grow)")
        self.events.emit("view", f"generation {generation}, nodes {self.nodes} ({why})",
                         generation=generation, nodes=self.nodes, why=why)
        self.cond.notify_all()
        view = {"op": "ping", "generation": generation, "nodes": self.nodes, "node": self.node}
        threading.Thread(target=self._push, args=(view,), daemon=True).start()
        for w in self.workers.values():      # a replacement that has not joined yet would be stale
            if w.generation < generation and w.generation > 0 and not w.joined and w.proc.poll() is None:
                stop([w.proc], 0.0)

    def _push(self, view: dict) -> None:
        for n in self._peers():
            try:
                wire.ask(self.addrs[n], self.port, view, ASK_TIMEOUT_S)
            except wire.WireError:
                pass             # the heartbeat carries it later, or finds the node lost

    def _peers(self) -> list[int]:
        with self.cond:
            return [n for n in self.nodes if n != self.node and n not in self.finished]

    def _merge(self, generation: int, nodes: list[int], sender) -> None:
        with self.cond:
            if sender is not None:
                self.seen[sender] = time.monotonic()
            if generation > self.generation:
                kept = [n for n in sorted(nodes) if n in self.nodes]
                self._move(generation if kept == sorted(nodes) else generation + 1, kept, "a peer's view")
            elif generation == self.generation and sorted(nodes) != self.nodes:
                self._move(generation + 1, [n for n in self.nodes if n in nodes], "views differed")

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
            for flag in o.unused:
                self.events.emit("unused", f"{flag} is not used: agents find each other from the host list "
                                 "and the port plan", flag=flag)
            self._greet()
            self.pool.fill()
            for local in range(o.nproc_per_node):
                self._start(local)
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

    def _greet(self) -> None:
        """Every peer must answer a hello (same job, nodes, workers, hosts) before workers start."""
        o, deadline = self.opts, time.monotonic() + self.cfg.connect_timeout
        hello = {"op": "hello", "node": self.node, "run_id": o.run_id, "nnodes": o.nnodes,
                 "nproc_per_node": o.nproc_per_node, "hosts": list(o.hosts)}
        waiting = set(self._peers())
        while waiting:
            for n in sorted(waiting):
                try:
                    reply = wire.ask(self.addrs[n], self.port, hello, ASK_TIMEOUT_S)
                except wire.WireError:
                    continue
                if "error" in reply:
                    raise JobEnd(LaunchError.exit_code, f"refused at start: {reply['error']}", fix=SAME_JOB_FIX)
                waiting.discard(n)
            if self.end is not None:
                raise self.end
            if self.signalled is not None:
                raise JobEnd(128 + self.signalled, f"stopped by signal {self.signalled} before start", False)
            if waiting and time.monotonic() > deadline:
                raise JobEnd(LaunchError.exit_code,
                             f"the agents of nodes {sorted(waiting)} did not answer within "
                             f"{self.cfg.connect_timeout:g} s (HPCT_CONNECT_TIMEOUT) at "
                             f"{', '.join(f'{self.addrs[n]}:{self.port}' for n in sorted(waiting))}",
                             fix="start hpct run on every node of the host list, or check that each node "
                                 "reaches the others at HPCT_AGENT_PORT")
            time.sleep(0.05 if waiting else 0)
        self.events.emit("membership", f"all {o.nnodes} agents answered", nodes=self.nodes)

    def _heartbeat(self) -> None:
        while self.end is None:
            view = {"op": "ping", **self._view()}
            for n in self._peers():
                try:
                    reply = wire.ask(self.addrs[n], self.port, view, ASK_TIMEOUT_S)
                    self._merge(reply["generation"], reply["nodes"], n)
                except (wire.WireError, KeyError):
                    pass
            now = time.monotonic()
            with self.cond:
                silent = [n for n in self.nodes if n != self.node and n not in self.finished
                          and n not in self.leaving and now - self.seen.get(n, now) > self.opts.node_grace]
                left = [n for n, t in self.leaving.items() if now - t > SETTLE_S]
            self._drop(silent, left)
            time.sleep(HEARTBEAT_S)

    def _watch(self) -> int:
        while True:
            if self.signalled is not None:
                raise JobEnd(128 + self.signalled, f"stopped by signal {self.signalled}: workers stopped, "
                             "the other nodes are told this node leaves", False)
            if self.end is not None:
                raise self.end
            lost = []
            for local, w in list(self.workers.items()):
                code = w.proc.poll()
                if code is None:
                    continue
                if code == 0:
                    self.events.emit("exit", f"rank {w.rank} pid {w.proc.pid} finished", rank=w.rank, code=0)
                    del self.workers[local]
                    continue
                lost.append((local, w, code))
            if lost:
                self._replace(lost)
            if not self.workers:
                self._tell_peers({"op": "leave", "node": self.node, "reason": "done"})
                self.events.emit("done", "every worker of this node finished", code=0)
                return 0
            time.sleep(POLL_S)

    def _replace(self, lost: list) -> None:
        for local, w, code in lost:
            how = f"killed by signal {-code}" if code < 0 else f"exited with {code}"
            self.events.emit("worker-lost", f"rank {w.rank} pid {w.proc.pid} {how}", rank=w.rank,
                             pid=w.proc.pid, code=code, generation=w.generation, joined=w.joined)
            if code > 0:
                if not w.joined and w.generation == 0:
                    raise JobEnd(code, f"rank {w.rank} could not start (exit {code}); its log {w.log}:\n"
                                       f"{tail(w.log)}")
                self.restarts[local] = self.restarts.get(local, 0) + 1
                if self.restarts[local] > self.opts.max_restarts:
                    raise JobEnd(code, f"rank {w.rank} failed {self.restarts[local]} times (--max-restarts "
                                       f"{self.opts.max_restarts}); last exit {code}, its log {w.log}:\n"
                                       f"{tail(w.log)}")
        with self.cond:
            self._move(self.generation + 1, self.nodes, f"{len(lost)} worker(s) lost on node {self.node}")
        for local, w, code in lost:
            self._start(local, self.restarts.get(local, 0))

    def _tell_peers(self, message: dict) -> None:
        for n in self._peers():
            try:
                wire.ask(self.addrs[n], self.port, message, ASK_TIMEOUT_S)
            except wire.WireError:
                pass

    def _finish(self, end: JobEnd) -> int:
        if self.end is None or self.end is end:
            reason = "signal" if self.signalled is not None else "end"
            self.end = end
            if reason == "signal" or not end.message.startswith("the job ended on node"):
                self._tell_peers({"op": "leave", "node": self.node, "reason": reason, "code": end.code,
                                  "why": end.message.splitlines()[0]})
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
                         "HPCT_HOSTS", "HPCT_HOSTFILE", "HPCT_GENERATION"})
_CONFIG_NAMES = frozenset(v.name for v in VARIABLES)
