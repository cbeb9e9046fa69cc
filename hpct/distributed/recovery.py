"""In-process recovery: rebuild the world with a new membership, or follow ``hpct run``'s agent.

``recover()`` aborts every hpct group of this process (bounded, even with an op in flight on
another thread and a stopped peer), destroys torch's world (which resets the group counter),
moves to the next generation and connects the world again from the same port plan, with the
membership the caller gives or the one the node's agent holds.  Connections of another
generation are refused by Gloo, so a straggler from the old membership can never join the new
one.  world.py holds the state and the connect; this module decides which world to connect.
"""

from __future__ import annotations

import datetime

from ..config import Config
from ..errors import ConfigError, FormationError, RendezvousError
from . import agent_link, world


def next_generation() -> int:
    """This recovery's target generation: the one after the generation the world last formed
    in, kept by a failed attempt (so ranks that retry a different number of times meet), or a
    newer one that a peer showed."""
    with world._LOCK:
        current, formed, newest = world._current_generation(), world._state.formed, world._state.newest_seen
    target = current if formed is None or current > formed else formed + 1
    return max(target, newest)


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
    with world._LOCK:
        rank = world._state.rank if rank is None else rank
        plan_ranks = world._state.plan_ranks if plan_ranks is None else plan_ranks
        world_size = world._state.world_size if world_size is None else world_size
        timeout = world._state.timeout if timeout is None else timeout
        cfg = world._config()
    if rank is None or world_size is None:
        raise ConfigError("recover() needs a world to rebuild: call init_process_group first, "
                          "or pass rank= and world_size=", fix="pass rank= and world_size=")
    world.abort_all("recovering")       # the fault path: peers see a reset and fail at once
    world.shutdown_all()
    if ask_agent and cfg.agent_port is not None:
        formed = world._state.formed if world._state.formed is not None else world._current_generation() - 1
        return follow_agent(cfg, world.plan_rank(rank), timeout, formed=formed)
    if generation is None:
        # One target per recovery, kept by a failed attempt: ranks that start recovering
        # seconds apart meet in it.  A peer seen in a newer generation wins.
        generation = next_generation()
    return world.init_process_group(rank, world_size, timeout=timeout, config=cfg, generation=generation,
                              plan_ranks=plan_ranks)


MAX_OVERTAKEN = 32      # newer views one connect follows before it gives up (each is a new fault)


def follow_agent(cfg: Config, place: int, timeout, view: tuple | None = None, formed: int = -1):
    """Connect the world ``hpct run``'s agent holds for ``place``: ``view`` (rank, world size,
    generation, plan_ranks) for a first connect, else the agent's first view newer than
    ``formed`` (recover(): its agent knows who was lost and the generation to meet in).

    A fault before the world forms (the replacement lost, another node dropped before its grace)
    moves the agents' view on while this world connects; the ranks it waits for are then gone or
    stopped.  The connect gives way as soon as the agent shows the newer view, and meets the
    others there instead of failing at the connect deadline.  A peer that leaves the connect (it
    died, or gave the generation up) fails it before the agent may know: the agent is asked for
    the world after this one, as after a failed step, and says the loss or re-forms.
    """
    for _ in range(MAX_OVERTAKEN):
        if view is None:
            view = agent_world(cfg, place, formed)
        rank, world_size, generation, plan_ranks = view
        watch = agent_link.ViewWatch(cfg, place, generation, world.abort_all)
        try:
            with watch:
                return world.init_process_group(rank, world_size, timeout=timeout, config=cfg,
                                                generation=generation, plan_ranks=plan_ranks)
        except Exception as err:
            with world._LOCK:
                newer_peer = world._state.newest_seen > generation     # its agent may not know yet
            if not (watch.overtaken or newer_peer or isinstance(err, FormationError)
                    or agent_link.moved_past(cfg, place, generation)):
                raise
        world.shutdown_all()
        formed, view = generation, None       # the agent answers with the first view newer than this
    raise RendezvousError(f"the view moved on {MAX_OVERTAKEN} times while this world connected",
                          fix="faults come faster than a world forms: see the agents' event logs")


def agent_world(cfg: Config, place: int, formed: int) -> tuple[int, int, int, list[int] | None]:
    """(rank, world size, generation, plan_ranks or None for rank r at place r) of the world that
    ``hpct run``'s agent holds after the one formed in ``formed``, for the worker at plan place
    ``place`` (recover() and grow() ask it)."""
    view = agent_link.new_world(cfg, place, formed)
    plan = view["plan_ranks"] if view["plan_ranks"] != list(range(view["world_size"])) else None
    return view["rank"], view["world_size"], max(view["generation"], next_generation()), plan
