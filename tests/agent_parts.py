"""A node agent's parts as NodeAgent (hpct/launch/agent.py) wires them, in process and without a
network, for the unit tests of the agents' rules (tests/test_launch_membership.py,
tests/test_launch_links.py): the view is real, its pushes to peers are recorded, not sent."""

from __future__ import annotations

import time
from types import SimpleNamespace

from hpct.launch.losses import Losses
from hpct.launch.membership import Membership
from hpct.launch.view import View


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def emit(self, event: str, text: str, **fields) -> None:
        self.seen.append((event, {"message": text, **fields}))


class Agent:
    """Node ``node``'s View, Membership and Losses over ``nnodes`` members and ``spares`` spares, every
    node heard just now; ``pushed`` holds the views it would have told its peers, ``moves`` each
    move's (generation, grow), ``started`` each worker it would have started (local rank, restarts)."""

    def __init__(self, node: int, nnodes: int = 3, spares: int = 1) -> None:
        self.opts = SimpleNamespace(nnodes=nnodes, spare_nodes=spares, all_nodes=nnodes + spares, node_grace=5.0,
                                    slow_link_ms=10.0, nproc_per_node=2, run_id="t",
                                    hosts=[f"h{n}" for n in range(nnodes + spares)], max_restarts=3,
                                    stopped_grace=0.0)
        self.events, self.workers = Recorder(), {}
        self.pushed: list[dict] = []
        self.moves: list[tuple[int, bool]] = []
        self.started: list[tuple[int, int]] = []
        self.view = View(node, self.opts, self.events, push=self.pushed.append,
                         on_moved=lambda generation, grow: self.moves.append((generation, grow)),
                         stopping=lambda: False)
        self.view.seen = {n: time.monotonic() for n in range(nnodes + spares)}
        self.talk = Membership(self.view, opts=self.opts, addrs=self.opts.hosts, port=1, connect_timeout=5.0,
                               workers=self.workers, events=self.events, signalled=lambda: None)
        self.losses = Losses(self.view, workers=self.workers, start=lambda local, restarts: self.started.append(
            (local, restarts)), events=self.events, max_restarts=self.opts.max_restarts,
                             stopped_grace=self.opts.stopped_grace, default_bound_s=5.0)

    def world(self) -> list[int]:
        return self.view.world()[0]
