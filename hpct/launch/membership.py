"""How the agents of one job agree: hello at start, a view (generation, the active nodes in slot
order) moved only forward, pushed at once and carried by every heartbeat, a node dropped when
silent or leaving, idle nodes taken in, and the majority rule.  ``NodeAgent`` (agent.py) is the
one subclass; it owns the workers.

A slot holds a node and ``nproc_per_node`` ranks, in slot order.  An idle node (a spare of
``--spare-nodes``, or a dropped node whose agent said hello again) that has pinged within the
grace is taken in: when a node is dropped, the lowest idle node takes its slot (same ranks, the
world keeps its size); when the world is smaller than ``--nnodes``, the lowest node of the view
appends one (a grow: the members keep their ranks, the newcomer's follow).

A newer generation wins, less the nodes this agent dropped; an equal generation with other
nodes takes the nodes both hold, one generation on.  A side keeps training only while it holds
a strict majority of the last view's nodes, so a network split never leaves two worlds
training; a spare that fills a slot does not count towards that majority.
"""

from __future__ import annotations

import threading
import time

from ..errors import LaunchError
from . import wire

HEARTBEAT_S = 0.5             # agents ask each other this often
ASK_TIMEOUT_S = 2.0
SETTLE_S = 1.0                # a peer's leave waits this long: if this agent is signalled too, it is a cancel


class JobEnd(Exception):
    """The job ends on this node with ``code`` (the message says why; LaunchError's when set)."""

    def __init__(self, code: int, message: str, error: bool = True, fix: str | None = None,
                 from_peer: bool = False) -> None:
        super().__init__(message)
        self.code, self.message, self.error, self.fix = code, message, error, fix
        self.from_peer = from_peer      # another agent ended the job: it has told the others


SAME_JOB_FIX = ("start every agent of a job with the same --rdzv-id, --nnodes, --nproc-per-node and host list, "
                "and each with its own --node-rank")



class Membership:
    """The agreeing half of a node agent; the subclass sets the fields ``__init__`` of NodeAgent
    lists and implements ``_view_moved`` (stop replacements made stale by a newer generation)."""

    def _view_moved(self, generation: int) -> None:
        raise NotImplementedError

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
                    self.end = JobEnd(int(req.get("code", 1)), f"the job ended on node {n}: {req.get('why')}",
                                      from_peer=True)
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
        if op == "peek":
            with self.cond:
                return self._world_of(int(req.get("place", -1)))
        return {"error": f"unknown request {op!r}"}

    def _view(self) -> dict:
        with self.cond:
            return {"generation": self.generation, "nodes": list(self.nodes), "node": self.node}

    def _ping(self) -> dict:
        """This agent's view, as it tells a peer (the answer is the peer's view)."""
        return {"op": "ping", **self._view()}

    def _hello(self, req: dict) -> dict:
        o, mine, node = self.opts, self._identity(), req.get("node")
        why = next((f"the agent of node {node} has {key} {req.get(key)!r}, the agent of node {self.node} has "
                    f"{value!r}" for key, value in mine.items() if req.get(key) != value), None)
        if why is None and node == self.node:
            why = f"two agents claim node rank {self.node} (at {o.hosts[self.node]} and another host)"
        if why is not None:
            if self.generation == 0 and not self.workers:
                self._refuse(why)       # at start the whole job is refused; a running one refuses the stranger
            return {"error": why}
        with self.cond:     # a dropped node's agent heard again is idle: the view may take it back
            self.seen[node] = time.monotonic()
            self.leaving.pop(node, None)
            # An agent says hello once per life: a second hello from a member is a restarted agent.
            again, self.hellos = node in self.hellos and node in self.nodes, self.hellos | {node}
        return {"ok": True, "again": again, **self._view()}

    def _identity(self) -> dict:
        o = self.opts
        return {"run_id": o.run_id, "nnodes": o.nnodes, "spare_nodes": o.spare_nodes,
                "nproc_per_node": o.nproc_per_node, "hosts": list(o.hosts)}

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
            return self._world_of(place)

    def _world_of(self, place: int) -> dict:
        plan, gen = self._world()
        if place not in plan:
            return {"error": f"place {place} is not in the world of generation {gen}"}
        return {"generation": gen, "world_size": len(plan), "rank": plan.index(place), "plan_ranks": plan}

    def _probe(self) -> None:
        """Ask every peer now; the ones that do not answer are lost (a worker is waiting)."""
        silent = []
        for n in self._peers():
            try:
                wire.ask(self.addrs[n], self.port, self._ping(), ASK_TIMEOUT_S)
            except wire.WireError:
                silent.append(n)
        if silent:
            self._drop(silent, [], probed=True)

    def _drop(self, silent: list[int], left: list[int], probed: bool = False) -> None:
        with self.cond:
            silent = [n for n in silent if n in self.nodes]
            left = [n for n in left if n in self.nodes and n not in silent]
            if not (silent or left) or self.signalled is not None or self.end is not None \
                    or self.node not in self.nodes:      # an idle agent follows the members' view
                return
            quiet = "did not answer a probe (a worker was waiting)" if probed else \
                f"silent for {self.opts.node_grace:g} s"
            why = "; ".join([f"node {n} {quiet}" for n in silent] +
                            [f"node {n} left" for n in left])
            self.gone.update({n: time.monotonic() for n in silent + left})
            for n in left:
                self.leaving.pop(n, None)
            idle, nodes = self._idle(), []
            for n in self.nodes:        # the lowest idle node takes a lost node's slot
                if n not in silent + left:
                    nodes.append(n)
                elif idle:
                    nodes.append(idle.pop(0))
                    why += f"; node {nodes[-1]} takes its slot"
            self.events.emit("node-lost", why, nodes=silent + left)
            self._move(self.generation + 1, nodes, why)

    def _idle(self) -> list[int]:
        """Caller holds the lock.  Nodes outside the view that may be taken in, lowest first."""
        now = time.monotonic()
        return [n for n in range(self.opts.all_nodes) if n not in self.nodes and not self._gone(n)
                and n not in self.finished and n not in self.leaving
                and now - self.seen.get(n, -1e9) <= self.opts.node_grace]

    def _gone(self, n: int) -> bool:
        """Dropped by this agent and not heard from since."""
        return n in self.gone and self.seen.get(n, -1e9) <= self.gone[n]

    def _take_idle(self) -> None:
        """The lowest node of the view grows a world smaller than --nnodes by an idle node."""
        with self.cond:
            if self.end is not None or not self.nodes or self.nodes[0] != self.node \
                    or len(self.nodes) >= self.opts.nnodes or any(n in self.nodes for n in self.leaving):
                return
            idle = self._idle()
            if idle:
                self._move(self.generation + 1, self.nodes + idle[:1], f"node {idle[0]} joins (grow)")

    # -- the view ------------------------------------------------------------------------------
    def _move(self, generation: int, nodes: list[int], why: str) -> None:
        """Caller holds the lock.  Take a newer view and push it to every peer."""
        before, kept = len(self.nodes), len(set(nodes) & set(self.nodes))
        self.generation, self.nodes = generation, list(nodes)
        if kept * 2 <= before and kept < before and self.node in self.nodes:
            self.end = JobEnd(LaunchError.exit_code,
                              f"{kept} of the last view's {before} nodes remain here, no majority: "
                              "stopping, so that a split network never trains two worlds",
                              fix="the side holding the majority goes on; check this node's network, then "
                                  "start a new job (or add capacity to the running one with hd.grow)")
        self.events.emit("view", f"generation {generation}, nodes {self.nodes} ({why})",
                         generation=generation, nodes=self.nodes, why=why)
        self.cond.notify_all()
        if self.node in self.nodes:         # an idle agent follows; only members push views
            threading.Thread(target=self._tell_peers, args=(self._ping(),), daemon=True).start()
        self._view_moved(generation)

    def _peers(self) -> list[int]:
        with self.cond:
            return [n for n in self.nodes if n != self.node and n not in self.finished]

    def _contacts(self) -> list[int]:
        """The view's nodes and the idle ones: who hears that this node leaves or finished."""
        with self.cond:
            return sorted(set(self._peers()) | {n for n in self._idle() if n != self.node})

    def _merge(self, generation: int, nodes: list[int], sender) -> None:
        with self.cond:
            if sender is not None:
                self.seen[sender] = time.monotonic()
                if sender not in self.nodes and sender not in nodes:
                    return          # an idle agent's view is only what it heard from the members
            if self.node not in self.nodes and generation > self.generation:
                self._move(generation, list(nodes), "the members' view")
            elif generation > self.generation:
                kept = [n for n in nodes if not self._gone(n)]
                self._move(generation if kept == list(nodes) else generation + 1, kept, "a peer's view")
            elif generation == self.generation and list(nodes) != self.nodes:
                # Both sides compute the same result: the nodes both hold, in the smaller list's order.
                first, other = sorted([list(nodes), self.nodes])
                self._move(generation + 1, [n for n in first if n in other and not self._gone(n)],
                           "views differed")

    def _greet(self) -> None:
        """Every peer must answer a hello (same job, nodes, workers, hosts) before workers start."""
        o, deadline = self.opts, time.monotonic() + self.cfg.connect_timeout
        hello = {"op": "hello", "node": self.node, **self._identity()}
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
                self.restarted = self.restarted or reply.get("again", False)
                if reply.get("generation", 0) > 0:     # a running job: wait only for its members
                    self._merge(reply["generation"], reply["nodes"], n)
                    waiting &= set(self._peers())
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
        self.events.emit("membership", f"the agents of nodes {self.nodes} answered (generation "
                         f"{self.generation})", nodes=self.nodes, generation=self.generation)

    def _heartbeat(self) -> None:
        # One ask per peer at a time, each on its own thread: a peer that accepts and never answers
        # (a paused process) holds up only its own ask, so the others are still heard within the grace.
        asking: set[int] = set()

        def ask(n: int, view: dict) -> None:
            try:
                reply = wire.ask(self.addrs[n], self.port, view, ASK_TIMEOUT_S)
                self._merge(reply["generation"], reply["nodes"], n)
            except (wire.WireError, KeyError):
                pass
            finally:
                asking.discard(n)

        last = time.monotonic()
        while self.end is None:
            view = self._ping()
            for n in self._peers():
                if n not in asking:
                    asking.add(n)
                    threading.Thread(target=ask, args=(n, view), name=f"hpct-agent-ask-{n}", daemon=True).start()
            now = time.monotonic()
            with self.cond:
                if now - last > self.opts.node_grace:
                    # This agent itself stood still (paused, starved): its peers' silence is not
                    # theirs.  They get a fresh grace, and the answers just asked for count.
                    self.seen.update({n: now for n in self.nodes})
                last = now
                silent = [n for n in self.nodes if n != self.node and n not in self.finished
                          and n not in self.leaving and now - self.seen.get(n, now) > self.opts.node_grace]
                left = [n for n, t in self.leaving.items() if now - t > SETTLE_S]
            self._drop(silent, left)
            self._take_idle()
            time.sleep(HEARTBEAT_S)

    def _tell_peers(self, message: dict, to: list[int] | None = None) -> None:
        for n in self._peers() if to is None else to:
            try:
                wire.ask(self.addrs[n], self.port, message, ASK_TIMEOUT_S)
            except wire.WireError:
                pass             # a view: the heartbeat carries it later, or finds the node lost
