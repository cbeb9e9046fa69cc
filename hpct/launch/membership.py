"""How the agents of one job agree: hello at start, the view (view.py's rules) pushed at once and
carried by every heartbeat, a node dropped when silent or leaving, and the workers' questions.
``NodeAgent`` (agent.py) is the one subclass; it owns the workers.

A peer is silent once an ask to it failed and nothing was heard from it for the grace: judged
from failed asks, so an agent that itself stood still does not find every peer silent on resume.
A peer whose host refused every ask for REFUSED_S is lost sooner: nothing listens at its agent
port, so its agent is gone (killed, crashed), while a paused or starved agent is still accepted
by its kernel and keeps the grace.
"""

from __future__ import annotations

import threading
import time

from ..errors import LaunchError
from .. import wire
from .view import JobEnd, View

__all__ = ["JobEnd", "Membership"]

HEARTBEAT_S = 0.5             # agents ask each other this often
ASK_TIMEOUT_S = 2.0
REFORM_WAIT_S = 1.0           # a worker's re-form first waits this long for a loss another agent reports
SETTLE_S = 1.0                # a peer's leave waits this long: if this agent is signalled too, it is a cancel
REFUSED_S = 1.5               # a peer refusing every ask this long is lost (three heartbeats: not a restart's gap)
FINAL_TRIES = 3               # asks that tell a node this one finished or leaves (the job's last word to it)

SAME_JOB_FIX = ("start every agent of a job with the same --rdzv-id, --nnodes, --nproc-per-node and host list, "
                "and each with its own --node-rank")


class Membership(View):
    """The agreeing half of a node agent; the subclass sets the fields ``__init__`` of NodeAgent
    lists and implements ``_view_moved`` (stop replacements made stale by a newer generation)."""

    def _view_moved(self, generation: int, grow: bool) -> None:
        raise NotImplementedError

    def handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "hello":
            return self._hello(req)
        if op == "ping":
            self._merge(req.get("generation", -1), req.get("nodes", []), req.get("node"))
            self._hear_links(req.get("node"), req.get("links"))
            return {**self._view(), "links": self._links()}
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
                        w.joined, w.formed = True, max(w.formed, int(req.get("generation", -1)))
                        w.re_forming = False
                        if isinstance(req.get("op_timeout"), (int, float)):
                            w.op_timeout = float(req["op_timeout"])
            return {"ok": True}
        if op == "world":
            self._watching(req.get("pid"), re_forming=True)
            return self._answer_world(int(req.get("place", -1)), int(req.get("formed", -1)))
        if op == "peek":
            with self.cond:
                self._watching(req.get("pid"))
                return self._world_of(int(req.get("place", -1)))
        return {"error": f"unknown request {op!r}"}

    def _watching(self, pid, re_forming: bool = False) -> None:
        """A worker that asks about the view follows a newer one itself: note when it last asked,
        and whether it asked for a new world (recover(): its own failed)."""
        with self.cond:
            for w in self.workers.values():
                if pid is not None and w.proc.pid == pid:
                    w.watched = time.monotonic()
                    w.re_forming = w.re_forming or re_forming

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
            self.failing.pop(node, None)
            self.refused.pop(node, None)
            # An agent says hello once per life: a second hello from a member is a restarted agent.
            again, self.hellos = node in self.hellos and node in self.nodes, self.hellos | {node}
        return {"ok": True, "again": again, **self._view()}

    def _hello_request(self) -> dict:
        return {"op": "hello", "node": self.node, **self._identity()}

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
        """The world after ``formed``, for a worker whose world failed: the view a loss moved to, or
        the same members one generation on when nobody was lost (a peer stopped past the op
        timeout, or slow).  It waits REFORM_WAIT_S for a loss another agent reports, then asks every
        peer: when all answer and none holds a newer view, nobody was lost.  A peer that does not
        answer may be a lost node: the heartbeat drops it within the grace, else the probe then."""
        start = time.monotonic()
        self._wait_past(formed, start + REFORM_WAIT_S)
        if self.generation <= formed and not self._probe(drop=False):
            self._wait_past(formed, start + self.opts.node_grace + 2 * HEARTBEAT_S)
            if self.generation <= formed:
                self._probe(drop=True)
        with self.cond:
            if self.generation <= formed:       # nobody was lost: the same members, re-formed
                self._move(formed + 1, self.nodes, "re-form asked by a worker")
            return self._world_of(place)

    def _wait_past(self, formed: int, deadline: float) -> None:
        with self.cond:
            while self.generation <= formed and time.monotonic() < deadline and self.end is None:
                self.cond.wait(timeout=0.05)

    def _world_of(self, place: int) -> dict:
        plan, gen = self._world()
        if place not in plan:
            return {"error": f"place {place} is not in the world of generation {gen}"}
        return {"generation": gen, "world_size": len(plan), "rank": plan.index(place), "plan_ranks": plan}

    def _probe(self, drop: bool) -> bool:
        """Ask every peer now and take the views they answer; True when every one answered.  With
        ``drop``, the ones that did not are lost (a worker is waiting and the grace has passed)."""
        silent = []
        for n in self._peers():
            try:
                reply = wire.ask(self.addrs[n], self.port, self._ping(), ASK_TIMEOUT_S)
                self._merge(reply["generation"], reply["nodes"], n)
            except (wire.WireError, KeyError) as err:
                self._unanswered(n, err)
                silent.append(n)
        if silent and drop:
            self._drop(silent, [], probed=True)
        return not silent

    def _greet(self) -> None:
        """Every peer must answer a hello (same job, nodes, workers, hosts) before workers start."""
        deadline = time.monotonic() + self.cfg.connect_timeout
        hello = self._hello_request()
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
                reply, rtt = wire.ask_timed(self.addrs[n], self.port, view, ASK_TIMEOUT_S)
                with self.cond:
                    self.link_times.record(n, rtt)
                self._merge(reply["generation"], reply["nodes"], n)
                self._hear_links(n, reply.get("links"))
            except (wire.WireError, KeyError) as err:
                self._unanswered(n, err)
            finally:
                asking.discard(n)

        while self.end is None:
            view = self._ping()
            for n in self._peers():
                if n not in asking:
                    asking.add(n)
                    threading.Thread(target=ask, args=(n, view), name=f"hpct-agent-ask-{n}", daemon=True).start()
            now = time.monotonic()
            with self.cond:
                silent = self._lost_peers(now)
                left = [n for n, t in self.leaving.items() if now - t > SETTLE_S]
            self._drop(silent, left)
            self._take_idle()
            self._give_slow_slot(self._judge_links())
            time.sleep(HEARTBEAT_S)

    def _unanswered(self, n: int, err: Exception) -> None:
        """An ask to ``n`` failed: note since when, and since when every ask was refused."""
        now = time.monotonic()
        with self.cond:
            self.failing.setdefault(n, now)
            if getattr(err, "refused", False):
                self.refused.setdefault(n, now)
            else:                       # no answer at all: a host gone, or a pause; the grace's case
                self.refused.pop(n, None)

    def _lost_peers(self, now: float) -> list[int]:
        """Caller holds the lock.  The members to drop: silent for the grace (asked and not answered
        nor heard from; judged from failed asks, not from the last answer's age, or an agent that
        itself stood still would find every peer silent when it resumes), or refusing every ask
        for REFUSED_S (or the grace, if shorter)."""
        return [n for n in self.nodes if n != self.node and n not in self.finished and n not in self.leaving
                and (self._silent(n, now, self.opts.node_grace) or self._refusing(n, now))]

    def _refused_s(self) -> float:
        """How long a peer refusing every ask is given: REFUSED_S, or the grace if shorter."""
        return min(REFUSED_S, self.opts.node_grace)

    def _refusing(self, n: int, now: float) -> bool:
        """Caller holds the lock.  Every ask to ``n`` was refused for _refused_s()."""
        return now - self.refused.get(n, now) >= self._refused_s()

    def _silence(self, n: int, probed: bool) -> tuple[str, bool]:
        """Caller holds the lock.  Why ``n`` is dropped, as the node-lost event says it, and whether
        for refusing (a node silent for the grace whose refusals began only lately is not)."""
        if probed:
            return "did not answer a probe (a worker was waiting)", False
        if self._refusing(n, time.monotonic()):
            return (f"refused every ask for {self._refused_s():g} s (nothing listens at "
                    "its agent port: its agent is gone)"), True
        return f"silent for {self.opts.node_grace:g} s", False

    def _silent(self, n: int, now: float, limit: float) -> bool:
        """Caller holds the lock.  An ask to ``n`` failed and nothing was heard from it for ``limit``."""
        return now - self.failing.get(n, now) > limit and now - self.seen.get(n, now) > limit

    def _others_finished(self) -> bool:
        """Every other node of the view finished (this node may still be running newcomers)."""
        with self.cond:
            others = [n for n in self.nodes if n != self.node]
            return bool(others) and all(n in self.finished for n in others)

    def _tell_peers(self, message: dict, to: list[int] | None = None, tries: int = 1) -> None:
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
                   for n in (self._peers() if to is None else to)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(tries * (ASK_TIMEOUT_S + 0.5))
