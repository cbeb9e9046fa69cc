"""How the agents of one job agree: hello at start, the view (view.py's rules) pushed at once and
carried by every heartbeat, a node dropped when silent or leaving, and the workers' questions.
``Membership`` is the agent's talk with its peers and its workers over the wire; the view it
feeds is ``View``'s, the workers it answers about are ``NodeAgent``'s (agent.py).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .. import wire
from ..errors import LaunchError
from .view import REFUSED_S, JobEnd, View

__all__ = ["JobEnd", "Membership", "REFUSED_S"]

HEARTBEAT_S = 0.5             # agents ask each other this often
ASK_TIMEOUT_S = 2.0
REFORM_WAIT_S = 1.0           # a worker's re-form first waits this long for a loss another agent reports
SETTLE_S = 1.0                # a peer's leave waits this long: if this agent is signalled too, it is a cancel
FINAL_TRIES = 3               # asks that tell a node this one finished or leaves (the job's last word to it)

SAME_JOB_FIX = ("start every agent of a job with the same --rdzv-id, --nnodes, --nproc-per-node and host list, "
                "and each with its own --node-rank")


class Membership:
    """The agreeing half of a node agent.  Handed what it uses: the ``view`` it feeds, the job's
    ``opts`` (run id, nodes, hosts, node_grace), every agent's address (``addrs``, ``port``), the
    connect deadline of its first hello, this node's ``workers`` (the agent's own dict: a worker's
    report marks it), the event log and ``signalled()`` (the signal that stops this agent, or None).
    """

    def __init__(self, view: View, *, opts, addrs, port: int, connect_timeout: float, workers: dict,
                 events, signalled: Callable[[], int | None]) -> None:
        self.view, self.opts, self.addrs, self.port = view, opts, addrs, port
        self.node, self.connect_timeout, self.workers = view.node, connect_timeout, workers
        self.events, self.signalled = events, signalled
        self.hellos: set[int] = set()            # nodes whose agents said hello to this one
        self.restarted = False                   # a peer knew this node's agent before this one

    def handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "hello":
            return self.hello(req)
        if op == "ping":
            self.view.merge(req.get("generation", -1), req.get("nodes", []), req.get("node"))
            self.view.hear_links(req.get("node"), req.get("links"))
            return {**self.view.snapshot(), "links": self.view.links()}
        if op == "leave":
            with self.view.cond:
                n = req.get("node")
                if req.get("reason") == "done":
                    self.view.finished.add(n)
                elif req.get("reason") == "end" and self.view.end is None:
                    self.view.end = JobEnd(int(req.get("code", 1)), f"the job ended on node {n}: {req.get('why')}",
                                           from_peer=True)
                else:
                    self.view.leaving.setdefault(n, time.monotonic())
                self.view.cond.notify_all()
            return {"ok": True}
        if op == "joined":
            with self.view.cond:
                for w in self.workers.values():
                    if w.proc.pid == req.get("pid") or (w.place == req.get("place")
                                                        and w.generation == req.get("generation")):
                        w.joined, w.formed = True, max(w.formed, int(req.get("generation", -1)))
                        w.re_forming = False
                        if isinstance(req.get("op_timeout"), (int, float)):
                            w.op_timeout = float(req["op_timeout"])
            return {"ok": True}
        if op == "world":
            self.watching(req.get("pid"), re_forming=True)
            return self.answer_world(int(req.get("place", -1)), int(req.get("formed", -1)))
        if op == "peek":
            with self.view.cond:
                self.watching(req.get("pid"))
                return self.view.world_of(int(req.get("place", -1)))
        return {"error": f"unknown request {op!r}"}

    def watching(self, pid, re_forming: bool = False) -> None:
        """A worker that asks about the view follows a newer one itself: note when it last asked,
        and whether it asked for a new world (recover(): its own failed)."""
        with self.view.cond:
            for w in self.workers.values():
                if pid is not None and w.proc.pid == pid:
                    w.watched = time.monotonic()
                    w.re_forming = w.re_forming or re_forming

    def hello(self, req: dict) -> dict:
        o, mine, node = self.opts, self.identity(), req.get("node")
        why = next((f"the agent of node {node} has {key} {req.get(key)!r}, the agent of node {self.node} has "
                    f"{value!r}" for key, value in mine.items() if req.get(key) != value), None)
        if why is None and node == self.node:
            why = f"two agents claim node rank {self.node} (at {o.hosts[self.node]} and another host)"
        if why is not None:
            if self.view.generation == 0 and not self.workers:
                self.refuse(why)       # at start the whole job is refused; a running one refuses the stranger
            return {"error": why}
        with self.view.cond:     # a dropped node's agent heard again is idle: the view may take it back
            self.view.heard(node)
            # An agent says hello once per life: a second hello from a member is a restarted agent.
            again, self.hellos = node in self.hellos and node in self.view.nodes, self.hellos | {node}
        return {"ok": True, "again": again, **self.view.snapshot()}

    def hello_request(self) -> dict:
        return {"op": "hello", "node": self.node, **self.identity()}

    def identity(self) -> dict:
        o = self.opts
        return {"run_id": o.run_id, "nnodes": o.nnodes, "spare_nodes": o.spare_nodes,
                "nproc_per_node": o.nproc_per_node, "hosts": list(o.hosts)}

    def refuse(self, why: str) -> None:
        with self.view.cond:
            if self.view.end is None:
                self.view.end = JobEnd(LaunchError.exit_code, f"refused at start: {why}", fix=SAME_JOB_FIX)
            self.view.cond.notify_all()

    def answer_world(self, place: int, formed: int) -> dict:
        """The world after ``formed``, for a worker whose world failed: the view a loss moved to, or
        the same members one generation on when nobody was lost (a peer stopped past the op
        timeout, or slow).  It waits REFORM_WAIT_S for a loss another agent reports, then asks every
        peer: when all answer and none holds a newer view, nobody was lost.  A peer that does not
        answer may be a lost node: the heartbeat drops it within the grace, else the probe then."""
        start = time.monotonic()
        self.wait_past(formed, start + REFORM_WAIT_S)
        if self.view.generation <= formed and not self.probe(drop=False):
            self.wait_past(formed, start + self.opts.node_grace + 2 * HEARTBEAT_S)
            if self.view.generation <= formed:
                self.probe(drop=True)
        with self.view.cond:
            if self.view.generation <= formed:       # nobody was lost: the same members, re-formed
                self.view.move(formed + 1, self.view.nodes, "re-form asked by a worker")
            return self.view.world_of(place)

    def wait_past(self, formed: int, deadline: float) -> None:
        with self.view.cond:
            while self.view.generation <= formed and time.monotonic() < deadline and self.view.end is None:
                self.view.cond.wait(timeout=0.05)

    def probe(self, drop: bool) -> bool:
        """Ask every peer now and take the views they answer; True when every one answered.  With
        ``drop``, the ones that did not are lost (a worker is waiting and the grace has passed)."""
        silent = []
        for n in self.view.peers():
            try:
                reply = wire.ask(self.addrs[n], self.port, self.view.ping(), ASK_TIMEOUT_S)
                self.view.merge(reply["generation"], reply["nodes"], n)
            except (wire.WireError, KeyError) as err:
                self.view.unanswered(n, err)
                silent.append(n)
        if silent and drop:
            self.view.drop(silent, [], probed=True)
        return not silent

    def greet(self) -> None:
        """Every peer must answer a hello (same job, nodes, workers, hosts) before workers start."""
        deadline = time.monotonic() + self.connect_timeout
        hello = self.hello_request()
        waiting = set(self.view.peers())
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
                    self.view.merge(reply["generation"], reply["nodes"], n)
                    waiting &= set(self.view.peers())
            if self.view.end is not None:
                raise self.view.end
            signum = self.signalled()
            if signum is not None:
                raise JobEnd(128 + signum, f"stopped by signal {signum} before start", False)
            if waiting and time.monotonic() > deadline:
                raise JobEnd(LaunchError.exit_code,
                             f"the agents of nodes {sorted(waiting)} did not answer within "
                             f"{self.connect_timeout:g} s (HPCT_CONNECT_TIMEOUT) at "
                             f"{', '.join(f'{self.addrs[n]}:{self.port}' for n in sorted(waiting))}",
                             fix="start hpct run on every node of the host list, or check that each node "
                                 "reaches the others at HPCT_AGENT_PORT")
            time.sleep(0.05 if waiting else 0)
        self.events.emit("membership", f"the agents of nodes {self.view.nodes} answered (generation "
                         f"{self.view.generation})", nodes=self.view.nodes, generation=self.view.generation)

    def heartbeat(self) -> None:
        # One ask per peer at a time, each on its own thread: a peer that accepts and never answers
        # (a paused process) holds up only its own ask, so the others are still heard within the grace.
        asking: set[int] = set()

        def ask(n: int, ping: dict) -> None:
            try:
                reply, rtt = wire.ask_timed(self.addrs[n], self.port, ping, ASK_TIMEOUT_S)
                with self.view.cond:
                    self.view.link_times.record(n, rtt)
                self.view.merge(reply["generation"], reply["nodes"], n)
                self.view.hear_links(n, reply.get("links"))
            except (wire.WireError, KeyError) as err:
                self.view.unanswered(n, err)
            finally:
                asking.discard(n)

        while self.view.end is None:
            ping = self.view.ping()
            for n in self.view.peers():
                if n not in asking:
                    asking.add(n)
                    threading.Thread(target=ask, args=(n, ping), name=f"hpct-agent-ask-{n}", daemon=True).start()
            now = time.monotonic()
            with self.view.cond:
                silent = self.view.lost_peers(now)
                left = [n for n, t in self.view.leaving.items() if now - t > SETTLE_S]
            self.view.drop(silent, left)
            self.view.take_idle()
            self.view.give_slow_slot(self.view.judge_links())
            time.sleep(HEARTBEAT_S)

    def tell_peers(self, message: dict, to: list[int] | None = None, tries: int = 1) -> None:
        """Send ``message`` to each node of ``to`` (default: the view's others), all at once.  A node
        that gives no answer is asked again, ``tries`` asks in all (a lossy link loses one); one
        whose host refuses is not (nothing listens there).  Bounded: ``tries`` ask timeouts."""
        def tell(n: int) -> None:
            for _ in range(tries):
                try:
                    wire.ask(self.addrs[n], self.port, message, ASK_TIMEOUT_S)
                    return
                except wire.WireError as err:
                    if err.refused:
                        return   # a view: the heartbeat carries it later, or finds the node lost
        threads = [threading.Thread(target=tell, args=(n,), name="hpct-tell", daemon=True)
                   for n in (self.view.peers() if to is None else to)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(tries * (ASK_TIMEOUT_S + 0.5))
