"""The view one node's agent holds of the job: a generation and the active nodes in slot order,
and the rules that move it (membership.py has the requests and the loops that feed them).

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
"""

from __future__ import annotations

import threading
import time

from ..errors import LaunchError
from . import links


class JobEnd(Exception):
    """The job ends on this node with ``code`` (the message says why; LaunchError's when set)."""

    def __init__(self, code: int, message: str, error: bool = True, fix: str | None = None,
                 from_peer: bool = False) -> None:
        super().__init__(message)
        self.code, self.message, self.error, self.fix = code, message, error, fix
        self.from_peer = from_peer      # another agent ended the job: it has told the others


class View:
    """The view half of a node agent (``Membership`` feeds it; ``NodeAgent`` owns the fields)."""

    def _view(self) -> dict:
        with self.cond:
            return {"generation": self.generation, "nodes": list(self.nodes), "node": self.node}

    def _ping(self) -> dict:
        """This agent's view and its links, as it tells a peer (the answer is the peer's)."""
        return {"op": "ping", **self._view(), "links": self._links()}

    def _links(self) -> dict[int, float]:
        """The median time of this agent's answered asks, per peer it asks (links.py)."""
        with self.cond:
            return self.link_times.medians(self._peers())

    def _hear_links(self, sender, raw) -> None:
        if isinstance(sender, int) and sender != self.node:
            with self.cond:
                self.heard_links[sender] = (time.monotonic(), links.parse(raw))

    def _judge_links(self) -> dict[int, tuple[float, float]]:
        """The nodes whose links stand out now, from every report heard within the grace and this
        agent's own; ``self.slow`` keeps since when each has."""
        now = time.monotonic()
        with self.cond:
            reports = {n: row for n, (t, row) in self.heard_links.items() if now - t <= self.opts.node_grace}
            reports[self.node] = self._links()
            slow = links.slow_nodes(reports, self.opts.slow_link_ms)
            self.slow = {n: self.slow.get(n, now) for n in slow}
            return slow

    def _give_slow_slot(self, slow: dict[int, tuple[float, float]]) -> None:
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
            idle = self._idle()
            if not held or not idle:
                return
            node, spare = held[0], idle[0]
            own, others = slow[node]
            why = (f"node {node}'s links are slow: an ask takes {own:g} ms against {others:g} ms between the "
                   f"others (--slow-link-ms {self.opts.slow_link_ms:g}); node {spare} takes its slot")
            self.events.emit("slow-node", why, node=node, link_ms=own, others_ms=others, spare=spare)
            self._move(self.generation + 1, [spare if n == node else n for n in self.nodes], why, present=(node,))

    def _drop(self, silent: list[int], left: list[int], probed: bool = False) -> None:
        with self.cond:
            silent = [n for n in silent if n in self.nodes]
            left = [n for n in left if n in self.nodes and n not in silent]
            if not (silent or left) or self.signalled is not None or self.end is not None \
                    or self.node not in self.nodes:      # an idle agent follows the members' view
                return
            silence = {n: self._silence(n, probed) for n in silent}      # (why, for refusing)
            why = "; ".join([f"node {n} {silence[n][0]}" for n in silent] +
                            [f"node {n} left" for n in left])
            refused = [n for n in silent if silence[n][1]]
            self.gone.update({n: time.monotonic() for n in silent + left})
            for n in silent + left:
                self.leaving.pop(n, None)
                self.failing.pop(n, None)
                self.refused.pop(n, None)
            idle, nodes = self._idle(), []
            for n in self.nodes:        # the lowest idle node takes a lost node's slot
                if n not in silent + left:
                    nodes.append(n)
                elif idle:
                    nodes.append(idle.pop(0))
                    why += f"; node {nodes[-1]} takes its slot"
            self.events.emit("node-lost", why, nodes=silent + left, refused=refused)
            self._move(self.generation + 1, nodes, why)

    def _idle(self) -> list[int]:
        """Caller holds the lock.  Nodes outside the view that may be taken in, lowest first: heard
        within the grace, and since the last ask to them that failed.  (A node another agent dropped
        for refusing, 1.5 s after its last answer, was heard within the grace: without the second
        rule the lowest member grew it back at once, and the view flapped every heartbeat.)"""
        now = time.monotonic()
        return [n for n in range(self.opts.all_nodes) if n not in self.nodes and not self._gone(n)
                and n not in self.finished and n not in self.leaving and n not in self.slow
                and n not in self.failing and now - self.seen.get(n, -1e9) <= self.opts.node_grace]

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
    def _move(self, generation: int, nodes: list[int], why: str, present: tuple[int, ...] = ()) -> None:
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
            threading.Thread(target=self._tell_peers, args=(self._ping(),), daemon=True).start()
        self._view_moved(generation, grow)

    def _peers(self) -> list[int]:
        with self.cond:
            return [n for n in self.nodes if n != self.node and n not in self.finished]

    def _contacts(self) -> list[int]:
        """Who hears that this node leaves or finished: the view's nodes, and every node outside it
        that waits for the job (heard from, not dropped, finished or leaving since): an idle one,
        and one that _idle() leaves out because its slot was given away as slow or its asks fail.
        A node left out takes the members' silence at the end for a lost network, and fails (the
        goodput soak's node behind a lossy link did, 13 s after the job finished)."""
        with self.cond:
            waiting = {n for n in range(self.opts.all_nodes) if n not in self.nodes and n != self.node
                       and n in self.seen and not self._gone(n) and n not in self.finished
                       and n not in self.leaving}
            return sorted(set(self._peers()) | waiting)

    def _merge(self, generation: int, nodes: list[int], sender) -> None:
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
                self._move(generation, nodes, "the members' view")   # idle, or leaving: followed as it is
                return
            kept = [n for n in nodes if not self._gone(n)]
            self._move(generation if kept == nodes and why == "a peer's view" else generation + 1, kept, why)
