"""Which world to connect: the first (``init_process_group``) and the next after a failure (``recover``).

``recover()`` aborts every hpct group of this process (bounded, even with an op in flight on
another thread and a stopped peer), destroys torch's world (which resets the group counter),
moves to the next generation and connects the world again from the same port plan, with the
membership the caller gives or the one the node's agent holds.  Connections of another
generation are refused by Gloo, so a straggler from the old membership can never join the new
one.  Under ``hpct run`` both calls follow the agent first (follow.py), then connect
(world.py); world_state.py holds the membership and the generations.
"""

from __future__ import annotations

import datetime

from ...config import Config
from ...errors import ConfigError
from . import world
from .follow import follow_agent
from .world_state import state


def init_process_group(rank: int | None = None, world_size: int | None = None, *,
                       timeout: datetime.timedelta | float | None = None,
                       config: Config | None = None, generation: int | None = None,
                       plan_ranks: list[int] | None = None):
    """Start the default group rootlessly from the configuration; returns the world group.

    rank/world_size default to RANK/WORLD_SIZE; timeout (seconds or timedelta) is the op
    timeout; the connect deadline is HPCT_CONNECT_TIMEOUT; generation defaults to
    HPCT_GENERATION (or the current one after a recovery); plan_ranks[r] is global rank r's
    place in the port plan (default: r itself; a shrunk world passes its survivors').
    """
    cfg = config or Config.from_mapping()
    if cfg.agent_port is not None and (rank, world_size, generation, plan_ranks) == (None,) * 4:
        # Started by `hpct run`: a fault before this world forms moves the agents' view on, and
        # this connect follows it (as recover() does) instead of waiting for ranks it stopped.
        rank, world_size, plan_ranks = world.members(cfg, rank, world_size, plan_ranks)
        place = plan_ranks[rank] if plan_ranks is not None else rank
        return follow_agent(cfg, place, timeout, (rank, world_size, state.generation_or(cfg), plan_ranks))
    return world.connect_world(rank, world_size, timeout=timeout, config=cfg, generation=generation,
                               plan_ranks=plan_ranks)


def recover(world_size: int | None = None, rank: int | None = None, *, generation: int | None = None,
            timeout: datetime.timedelta | float | None = None, plan_ranks: list[int] | None = None):
    """Rebuild the world in this process with a new membership; returns the new world group.

    Aborts and releases every hpct group (bounded), resets torch's group counter, moves to
    ``generation`` and connects the world again from the same port plan.  The default
    generation is this recovery's target: the one after the generation the world last formed
    in, kept by a failed attempt (so ranks that retry a different number of times meet), or a
    newer one that a peer showed (a refused attempt raises RendezvousError naming it).  ``world_size``/``rank`` default to the current ones: survivors keep their
    ranks and a replacement takes the failed rank (it starts with HPCT_GENERATION set to the
    new generation).  Groups made with ``new_group`` must be made again, in the same order.
    ``plan_ranks`` (default: the current world's) places each new global rank in the plan
    (elastic.py's shrink passes the survivors').
    Under ``hpct run`` (HPCT_AGENT_PORT set) a call without arguments asks the node's agent for
    all four: the world it replaced a worker into, or shrank to after losing a node.
    Raises RendezvousError when a member is missing at the connect deadline.
    """
    ask_agent = (world_size, rank, generation, plan_ranks) == (None, None, None, None)
    with state.locked():
        current_rank, current_size, current_timeout, current_plan = state.membership()
        cfg = state.config()
    rank = current_rank if rank is None else rank
    plan_ranks = current_plan if plan_ranks is None else plan_ranks
    world_size = current_size if world_size is None else world_size
    timeout = current_timeout if timeout is None else timeout
    if rank is None or world_size is None:
        raise ConfigError("recover() needs a world to rebuild: call init_process_group first, "
                          "or pass rank= and world_size=", fix="pass rank= and world_size=")
    world.abort_all("recovering")       # the fault path: peers see a reset and fail at once
    world.shutdown_all()
    if ask_agent and cfg.agent_port is not None:
        formed = state.formed if state.formed is not None else state.generation() - 1
        return follow_agent(cfg, state.plan_rank(rank), timeout, formed=formed)
    if generation is None:
        # One target per recovery, kept by a failed attempt: ranks that start recovering
        # seconds apart meet in it.  A peer seen in a newer generation wins.
        generation = state.next_generation()
    return world.connect_world(rank, world_size, timeout=timeout, config=cfg, generation=generation,
                               plan_ranks=plan_ranks)
