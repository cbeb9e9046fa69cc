"""Following ``hpct run``'s agent: connect the world its view holds, and give way when the view moves on.

A worker that ``hpct run`` started (HPCT_AGENT_PORT set) does not choose its world: its node's
agent holds the job's view (who is in, the generation to meet in, every rank's place in the
plan), and ``follow_agent`` connects that world.  A fault before the world forms moves the view
on while the world connects; the connect then gives way and meets the others in the newer one.
recovery.py decides when to follow (a first world, a recovery, a grow); world.py connects.
"""

from __future__ import annotations

from ...config import Config
from ...errors import FormationError, RendezvousError
from . import agent_link, world
from .world_state import state

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
                return world.connect_world(rank, world_size, timeout=timeout, config=cfg,
                                           generation=generation, plan_ranks=plan_ranks)
        except Exception as err:
            newer_peer = state.newest_seen > generation     # its agent may not know yet
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
    return view["rank"], view["world_size"], max(view["generation"], state.next_generation()), plan
