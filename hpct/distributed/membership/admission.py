"""Grow: admit new ranks into a running job at a step boundary, at the next generation.

The members and the joiners meet as a recovery does, from the port plan alone: no store, no
server.  At a step boundary the training loop chooses, every member calls
``hd.grow(new_world_size)``; it closes the member's groups gracefully (nothing is in flight at
a step boundary) and connects the larger world at the next generation.  Each joiner starts
with ``RANK`` = its new rank, ``WORLD_SIZE`` = the new size and ``HPCT_GENERATION`` = the
members' next generation (``hd.generation() + 1`` on a member; an agent passes it on), calls
``hd.init_process_group()`` and then takes the state from a member::

    # member, at the step boundary                # joiner
    hd.grow(4)                                     hd.init_process_group()
    src = hd.healthy_source(True)                  src = hd.healthy_source(False)
    hd.broadcast_state(model, opt, src=src)        hd.broadcast_state(model, opt, src=src)

Where joiners live: new rank r sits at place ``plan_ranks[r]`` of the port plan (its host
``hosts[place // P]``, its local rank ``place % P``).  By default joiners take the places after
the highest one in use, so a world that never shrank places rank r at r.  The host list may grow
with the job: pass ``hosts=`` (or rewrite HPCT_HOSTFILE, which grow re-reads).  A joiner of a
shrunk world must be given the same ``plan_ranks`` (``hd.init_process_group(plan_ranks=...)``).

Under ``hpct run`` the agents decide the grow (a spare, or a node that came back, fills a
world smaller than ``--nnodes``) and start the joiners; the members see it with
``membership_changed()``, a collective they call at step boundaries (it asks about once a
second), and ``grow()`` without a size then takes the agents' world::

    if hd.membership_changed():      # every member, same step
        hd.grow()
        ...re-synchronise the state as above...
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from ...config import Config
from ...errors import ConfigError, HpctArgumentError, PortPlanError, RendezvousError
from ...ports import host_of
from . import agent_link, follow, world
from .world_state import state


def _config(hosts) -> Config:
    env = dict(os.environ)
    if hosts is not None:
        env.pop("HPCT_HOSTFILE", None)
        env["HPCT_HOSTS"] = ",".join(hosts)
    return Config.from_mapping(env)


def _places(plan, size: int) -> list[int]:
    """Every rank's plan place in the current world (rank r at place r unless it shrank)."""
    return list(plan) if plan is not None else list(range(size))


def plan_for(world_size: int, current: list[int], plan_ranks=None) -> list[int]:
    """Plan places of the grown world: the members keep theirs, joiners take the given ones or
    those after the highest place in use."""
    if plan_ranks is None:
        top = max(current) + 1 if current else 0
        return list(current) + list(range(top, top + world_size - len(current)))
    plan = [int(p) for p in plan_ranks]
    if len(plan) != world_size or plan[:len(current)] != list(current) or len(set(plan)) != len(plan) \
            or min(plan) < 0:
        raise HpctArgumentError(
            f"grow: plan_ranks={plan_ranks} must list {world_size} distinct places, starting with the "
            f"members' own {list(current)}",
            fix="omit plan_ranks (joiners take the next free places) or keep the members' places first")
    return plan


CHECK_PERIOD_S = 1.0     # membership_changed() asks the agents about this often, however short a step
MAX_SKIPPED = 100_000    # calls answered without asking, at most, between two asks


class _Cadence:
    """Which calls of membership_changed() ask the agent and all-reduce: the same ones on every
    member.  Asking every call cost a 0.13 s step of the goodput soak a local request and a
    one-element all-reduce across 4 nodes; a grow is seconds in the making anyway.  The
    members call at the same step boundaries, so their counts of calls since their world formed
    are equal; each ask's all-reduce also takes the longest time any member saw since the last
    ask, so every member derives the same number of calls to answer False without asking."""

    def __init__(self) -> None:
        self.world: tuple | None = None     # (generation formed in, size): a new world asks at once
        self.skip = 0                       # calls to answer without asking, after the last ask
        self.calls = 0                      # calls since the last ask
        self.asked = 0.0                    # time.monotonic() of the last ask, 0.0: none yet

    def due(self, world_key: tuple) -> bool:
        if world_key != self.world:
            self.world, self.skip, self.calls, self.asked = world_key, 0, 0, 0.0
        self.calls += 1
        return self.calls > self.skip

    def since(self, now: float) -> float:
        return now - self.asked if self.asked else 0.0

    def asked_at(self, now: float, longest_s: float) -> None:
        """``longest_s``: the all-reduced time since the last ask, alike on every member."""
        per_period = CHECK_PERIOD_S * self.calls / longest_s if longest_s > 0 else 1.0
        self.skip = max(0, min(MAX_SKIPPED, int(per_period) - 1))
        self.calls, self.asked = 0, now


_cadence = _Cadence()


def membership_changed() -> bool:
    """Whether the job's ``hpct run`` agents hold a world other than this one (a grow).

    A collective over the world: every member calls it at the same step boundaries and gets the
    same answer.  It asks the node's agent and all-reduces the answer about once per
    CHECK_PERIOD_S; the calls in between are False without a collective (alike on every
    member, _Cadence).  False at once when this process was not started by ``hpct run``.
    """
    cfg = state.config()
    rank, size, _, plan = state.membership()
    if cfg.agent_port is None or rank is None or not _cadence.due((state.formed, size)):
        return False
    now = time.monotonic()
    try:
        newest = agent_link.peek(cfg, state.plan_rank(rank))["plan_ranks"]
    except RendezvousError:
        newest = None           # this node left the view: the members' new world goes on without it
    flag = torch.tensor([float(newest != _places(plan, size)), _cadence.since(now)], dtype=torch.float64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    _cadence.asked_at(now, float(flag[1]))
    return bool(flag[0] > 0)


def grow(world_size: int | None = None, *, hosts: list[str] | None = None, plan_ranks: list[int] | None = None):
    """Every member calls this at the same step boundary; returns the new world group.

    Without arguments under ``hpct run``: the world the agents grew to (``membership_changed()``).
    """
    rank, size, timeout, plan = state.membership()
    if rank is None or size is None:
        raise ConfigError("grow() needs a running world: call init_process_group first",
                          fix="start the job with hd.init_process_group() before growing it")
    cfg = state.config()
    if (world_size, hosts, plan_ranks) == (None, None, None) and cfg.agent_port is not None:
        place = state.plan_rank(rank)
        view = follow.agent_world(cfg, place, state.generation())
        world.shutdown_all()      # a step boundary: every group is idle and closes gracefully
        # A fault while the grown world connects (a newcomer lost) moves the view on: the
        # connect follows it, as recover()'s does, instead of failing the members.
        return follow.follow_agent(cfg, place, timeout, view)
    if not isinstance(world_size, int) or world_size <= size:
        raise HpctArgumentError(f"grow: world_size={world_size!r} must be an integer above the current "
                                f"world size {size}, nothing changed",
                                fix="pass the size after admitting the joiners (shrink() makes it smaller)")
    current = _places(plan, size)
    places = plan_for(world_size, current, plan_ranks)
    cfg = _config(hosts)
    for r in range(size, world_size):
        try:
            host_of(cfg.hosts, places[r], cfg.nproc_per_node)
        except PortPlanError as err:
            raise ConfigError(f"grow: joiner rank {r} (plan place {places[r]}) has no address in the plan, "
                              f"nothing changed: {err.problem}",
                              fix="pass hosts= with every node the grown job uses (or extend HPCT_HOSTFILE), "
                                  "or raise N_PROC_PER_NODE") from None
    world.shutdown_all()          # a step boundary: every group is idle and closes gracefully
    identity = places == list(range(world_size))
    return world.connect_world(rank, world_size, timeout=timeout, config=cfg,
                               generation=state.next_generation(),
                               plan_ranks=None if identity else places)
