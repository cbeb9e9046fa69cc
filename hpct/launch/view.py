"""The view one node's agent holds of the job: a generation and the active nodes in slot order,
the rules that move it, and which peers it has heard from (membership.py has the requests and
the loops that feed it; agent.py and losses.py act on its moves).

A slot holds a node and ``nproc_per_node`` ranks, in slot order.  An idle node (a spare of
``--spare-nodes``, or a dropped node whose agent said hello again) that has pinged within the
grace is taken in: when a node is dropped, the lowest idle node takes its slot (same ranks, the
world keeps its size); when the world is smaller than ``--nnodes``, the lowest node of the view
appends one (a grow: the members keep their ranks, the newcomer's follow).  A member whose links
stand out as slow (links.py) gives its slot to an idle node whose links do not, the same way.

A newer generation wins, less the nodes this agent dropped; of two views of one generation both
sides choose the smaller node list (one generation on), and a member left out follows it, idle.
A side keeps training only while it holds a strict majority of the last view's nodes, so a
network split never leaves two worlds training; a spare that fills a slot does not count
towards that majority.

A peer is silent once an ask to it failed and nothing was heard from it for the grace: judged
from failed asks, so an agent that itself stood still does not find every peer silent on resume.
A peer whose host refused every ask for REFUSED_S is lost sooner: nothing listens at its agent
port, so its agent is gone (killed, crashed), while a paused or starved agent is still accepted
by its kernel and keeps the grace.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..errors import LaunchError
from . import links
from .links import LinkTimes

REFUSED_S = 1.5               # a peer refusing every ask this long is lost (three heartbeats: not a restart's gap)


class JobEnd(Exception):
    """The job ends on this node with ``code`` (the message says why; LaunchError's when set)."""

    def __init__(self, code: int, message: str, error: bool = True, fix: str | None = None,
                 from_peer: bool = False) -> None:
        super().__init__(message)
        self.code, self.message, self.error, self.fix = code, message, error, fix
        self.from_peer = from_peer      # another agent ended the job: it has told the others


class View:
    """The job's view as this node's agent holds it, and every peer's liveness as it has seen it.

    Handed what it uses: its own ``node``, the job's shape in ``opts`` (nnodes, all_nodes,
    node_grace, slow_link_ms, nproc_per_node), the event log, ``push(message)`` (tells the view's
    peers; a move sends its ping there), ``on_moved(generation, grow)`` (called after every move,
    the lock held) and ``stopping()`` (this agent was signalled: it drops nobody).  ``cond`` is
    the one lock of the view's fields; a method whose doc says "caller holds the lock" expects it.
    """

    def __init__(self, node: int, opts, events, *, push: Callable[[dict], None],
                 on_moved: Callable[[int, bool], None], stopping: Callable[[], bool]) -> None:
        self.node, self.opts, self.events = node, opts, events
        self.push, self.on_moved, self.stopping = push, on_moved, stopping
        self.cond = threading.Condition()
        self.generation, self.nodes = 0, list(range(opts.nnodes))
        self.finished: set[int] = set()
        self.gone: dict[int, float] = {}         # node -> when this agent dropped it
        self.seen = {n: time.monotonic() for n in self.nodes}
        self.failing: dict[int, float] = {}      # node -> its first unanswered ask since an answer
        self.refused: dict[int, float] = {}      # node -> its first refused ask, every ask since refused
        self.leaving: dict[int, float] = {}
        self.link_times = LinkTimes()            # this agent's answered asks per peer (links.py)
        self.heard_links: dict[int, tuple[float, dict[int, float]]] = {}   # node -> (when, its links)
        self.slow: dict[int, float] = {}         # node -> since when its links stand out
        self.end: JobEnd | None = None           # why the job ends on this node, once it does

    def world(self) -> tuple[list[int], int]:
        """(every rank's plan place, generation) of the view's world: its nodes' places in slot order."""
        p = self.opts.nproc_per_node
        return [n * p + l for n in self.nodes for l in range(p)], self.generation

    def world_of(self, place: int) -> dict:
        """The view's world as a worker at plan place ``place`` asks for it (its rank in it), or an error."""
        plan, gen = self.world()
        if place not in plan:
            return {"error": f"place {place} is not in the world of generation {gen}"}
        return {"generation": gen, "world_size": len(plan), "rank": plan.index(place), "plan_ranks": plan}

    def heard(self, n: int) -> None:
        """Caller holds the lock.  Node ``n``'s agent said hello: it is alive, and not leaving."""
        self.seen[n] = time.monotonic()
        self.leaving.pop(n, None)
        self.failing.pop(n, None)
        self.refused.pop(n, None)

    def snapshot(self) -> dict:
        with self.cond:
            return {"generation": self.generation, "nodes": list(self.nodes), "node": self.node}

    def ping(self) -> dict:
        """This agent's view and its links, as it tells a peer (the answer is the peer's)."""
        return {"op": "ping", **self.snapshot(), "links": self.links()}

    def links(self) -> dict[int, float]:
        """The median time of this agent's answered asks, per peer it asks (links.py)."""
        with self.cond:
            return self.link_times.medians(self.peers())

    def hear_links(self, sender, raw) -> None:
        if isinstance(sender, int) and sender != self.node:
            with self.cond:
                self.heard_links[sender] = (time.monotonic(), links.parse(raw))

    def judge_links(self) -> dict[int, tuple[float, float]]:
        """The nodes whose links stand out now, from every report heard within the grace and this
        agent's own; ``self.slow`` keeps since when each has."""
        now = time.monotonic()
        with self.cond:
            reports = {n: row for n, (t, row) in self.heard_links.items() if now - t <= self.opts.node_grace}
            reports[self.node] = self.links()
            slow = links.slow_nodes(reports, self.opts.slow_link_ms)
            self.slow = {n: self.slow.get(n, now) for n in slow}
            return slow

    def give_slow_slot(self, slow: dict[int, tuple[float, float]]) -> None:
        """The lowest node of the view whose own links are not slow gives a member whose links
        stood out for SLOW_HOLD_S to an idle node whose links do not.  The member's workers stop
        when it sees the view (as a node that found itself dropped) and the idle node's start in
        its slot from warm standbys.  Without an idle node the job rides the slow link through:
        slowness alone never shrinks the world (a shrink changes its size, its data shards and its
        sums).  The slow node never moves the view itself: only members push a view, so a view
        without it would reach nobody, while its own workers stopped (the 30-minute soak: node 1,
        the view's lowest, did so twice, and the others waited for its workers until the job ended)."""
        with self.cond:
            movers = [n for n in self.nodes if n not in slow]
            if self.end is not None or not movers or movers[0] != self.node \
                    or any(n in self.nodes for n in self.leaving):
                return
            now = time.monotonic()
            held = [n for n in self.nodes if n in slow and now - self.slow[n] >= links.SLOW_HOLD_S]
            idle = self.idle()
            if not held or not idle:
                return
            node, spare = held[0], idle[0]
            own, others = slow[node]
            why = (f"node {node}'s links are slow: an ask takes {own:g} ms against {others:g} ms between the "
                   f"others (--slow-link-ms {self.opts.slow_link_ms:g}); node {spare} takes its slot")
            self.events.emit("slow-node", why, node=node, link_ms=own, others_ms=others, spare=spare)
            self.move(self.generation + 1, [spare if n == node else n for n in self.nodes], why, present=(node,))

    def drop(self, silent: list[int], left: list[int], probed: bool = False) -> None:
        with self.cond:
            silent = [n for n in silent if n in self.nodes]
            left = [n for n in left if n in self.nodes and n not in silent]
            if not (silent or left) or self.stopping() or self.end is not None \
                    or self.node not in self.nodes:      # an idle agent follows the members' view
                return
            silence = {n: self.silence(n, probed) for n in silent}      # (why, for refusing)
            why = "; ".join([f"node {n} {silence[n][0]}" for n in silent] +
                            [f"node {n} left" for n in left])
            refused = [n for n in silent if silence[n][1]]
            self.gone.update({n: time.monotonic() for n in silent + left})
            for n in silent + left:
                self.leaving.pop(n, None)
                self.failing.pop(n, None)
                self.refused.pop(n, None)
            idle, nodes = self.idle(), []
            for n in self.nodes:        # the lowest idle node takes a lost node's slot
                if n not in silent + left:
                    nodes.append(n)
                elif idle:
                    nodes.append(idle.pop(0))
                    why += f"; node {nodes[-1]} takes its slot"
            self.events.emit("node-lost", why, nodes=silent + left, refused=refused)
            self.move(self.generation + 1, nodes, why)

    def idle(self) -> list[int]:
        """Caller holds the lock.  Nodes outside the view that may be taken in, lowest first: heard
        within the grace, and since the last ask to them that failed.  (A node another agent dropped
        for refusing, 1.5 s after its last answer, was heard within the grace: without the second
        rule the lowest member grew it back at once, and the view flapped every heartbeat.)"""
        now = time.monotonic()
        return [n for n in range(self.opts.all_nodes) if n not in self.nodes and not self.is_gone(n)
                and n not in self.finished and n not in self.leaving and n not in self.slow
                and n not in self.failing and now - self.seen.get(n, -1e9) <= self.opts.node_grace]

    def is_gone(self, n: int) -> bool:
        """Dropped by this agent and not heard from since."""
        return n in self.gone and self.seen.get(n, -1e9) <= self.gone[n]

    def take_idle(self) -> None:
        """The lowest node of the view grows a world smaller than --nnodes by an idle node."""
        with self.cond:
            if self.end is not None or not self.nodes or self.nodes[0] != self.node \
                    or len(self.nodes) >= self.opts.nnodes or any(n in self.nodes for n in self.leaving):
                return
            idle = self.idle()
            if idle:
                self.move(self.generation + 1, self.nodes + idle[:1], f"node {idle[0]} joins (grow)")

    # -- the view ------------------------------------------------------------------------------
    def move(self, generation: int, nodes: list[int], why: str, present: tuple[int, ...] = ()) -> None:
        """Caller holds the lock.  Take a newer view and push it to every peer.  ``present``: nodes
        of the last view that leave this one alive and answering (a slow node whose slot is given
        away): this side still holds them, so they count for its majority."""
        member = self.node in self.nodes
        before, kept = len(self.nodes), len((set(nodes) | set(present)) & set(self.nodes))
        # A grow appends nodes and breaks no member's world: they take it at a step boundary.
        grow = len(nodes) > before and list(nodes[:before]) == self.nodes
        self.generation, self.nodes = generation, list(nodes)
        # Only a member of the last view has a side to count: an idle node taken in follows the
        # members' choice (a spare taking one of two slots would otherwise stop the job).
        if kept * 2 <= before and kept < before and member and self.node in self.nodes:
            self.end = JobEnd(LaunchError.exit_code,
                              f"{kept} of the last view's {before} nodes remain here, no majority: "
                              "stopping, so that a split network never trains two worlds",
                              fix="the side holding the majority goes on; check this node's network, then "
                                  "start a new job (or add capacity to the running one with hd.grow)")
        self.events.emit("view", f"generation {generation}, nodes {self.nodes} ({why})",
                         generation=generation, nodes=self.nodes, why=why)
        self.cond.notify_all()
        if self.node in self.nodes:         # an idle agent follows; only members push views
            threading.Thread(target=self.push, args=(self.ping(),), daemon=True).start()
        self.on_moved(generation, grow)

    def peers(self) -> list[int]:
        with self.cond:
            return [n for n in self.nodes if n != self.node and n not in self.finished]

    def contacts(self) -> list[int]:
        """Who hears that this node leaves or finished: the view's nodes, and every node outside it
        that waits for the job (heard from, not dropped, finished or leaving since): an idle one,
        and one that idle() leaves out because its slot was given away as slow or its asks fail.
        A node left out takes the members' silence at the end for a lost network, and fails (the
        goodput soak's node behind a lossy link did, 13 s after the job finished)."""
        with self.cond:
            waiting = {n for n in range(self.opts.all_nodes) if n not in self.nodes and n != self.node
                       and n in self.seen and not self.is_gone(n) and n not in self.finished
                       and n not in self.leaving}
            return sorted(set(self.peers()) | waiting)

    def merge(self, generation: int, nodes: list[int], sender) -> None:
        nodes = list(nodes)
        with self.cond:
            if sender is not None:
                self.seen[sender] = time.monotonic()
                self.failing.pop(sender, None)
                self.refused.pop(sender, None)
                if sender not in nodes:
                    return          # an idle agent's view: only the members' views count
            if generation < self.generation or (generation == self.generation and nodes == self.nodes):
                return
            why = "a peer's view"
            if generation == self.generation and self.node in self.nodes:
                # Two views of one generation: both sides choose the same one, the smaller list.
                nodes, why = min(nodes, self.nodes), "views differed"
                if nodes == self.nodes:
                    return
            if self.node not in nodes or self.node not in self.nodes:
                self.move(generation, nodes, "the members' view")   # idle, or leaving: followed as it is
                return
            kept = [n for n in nodes if not self.is_gone(n)]
            self.move(generation if kept == nodes and why == "a peer's view" else generation + 1, kept, why)

    def unanswered(self, n: int, err: Exception) -> None:
        """An ask to ``n`` failed: note since when, and since when every ask was refused."""
        now = time.monotonic()
        with self.cond:
            self.failing.setdefault(n, now)
            if getattr(err, "refused", False):
                self.refused.setdefault(n, now)
            else:                       # no answer at all: a host gone, or a pause; the grace's case
                self.refused.pop(n, None)

    def lost_peers(self, now: float) -> list[int]:
        """Caller holds the lock.  The members to drop: silent for the grace (asked and not answered
        nor heard from; judged from failed asks, not from the last answer's age, or an agent that
        itself stood still would find every peer silent when it resumes), or refusing every ask
        for REFUSED_S (or the grace, if shorter)."""
        return [n for n in self.nodes if n != self.node and n not in self.finished and n not in self.leaving
                and (self.silent(n, now, self.opts.node_grace) or self.refusing(n, now))]

    def refused_s(self) -> float:
        """How long a peer refusing every ask is given: REFUSED_S, or the grace if shorter."""
        return min(REFUSED_S, self.opts.node_grace)

    def refusing(self, n: int, now: float) -> bool:
        """Caller holds the lock.  Every ask to ``n`` was refused for _refused_s()."""
        return now - self.refused.get(n, now) >= self.refused_s()

    def silence(self, n: int, probed: bool) -> tuple[str, bool]:
        """Caller holds the lock.  Why ``n`` is dropped, as the node-lost event says it, and whether
        for refusing (a node silent for the grace whose refusals began only lately is not)."""
        if probed:
            return "did not answer a probe (a worker was waiting)", False
        if self.refusing(n, time.monotonic()):
            return (f"refused every ask for {self.refused_s():g} s (nothing listens at "
                    "its agent port: its agent is gone)"), True
        return f"silent for {self.opts.node_grace:g} s", False

    def silent(self, n: int, now: float, limit: float) -> bool:
        """Caller holds the lock.  An ask to ``n`` failed and nothing was heard from it for ``limit``."""
        return now - self.failing.get(n, now) > limit and now - self.seen.get(n, now) > limit

    def others_finished(self) -> bool:
        """Every other node of the view finished (this node may still be running newcomers)."""
        with self.cond:
            others = [n for n in self.nodes if n != self.node]
            return bool(others) and all(n in self.finished for n in others)
