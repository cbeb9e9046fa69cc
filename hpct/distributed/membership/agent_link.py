"""A worker's questions to its node's ``hpct run`` agent (HPCT_AGENT_PORT set: the agent started it).

The agent is at this worker's own node's address in the host list.  ``new_world`` is what
``recover()`` asks after a failure: the generation to re-form in, the world size, this
worker's rank and every rank's plan place (the agent replaced a lost worker, or dropped a lost
node).  ``ViewWatch`` asks again while a world connects, a worker's first or a recovery's: a
fault before it forms (the replacement or another node lost) moves the view on, and the connect
must give way to it.
``peek`` is the same question without waiting or moving anything: the world of the agent's
newest generation (``membership_changed()`` asks it at step boundaries, to see a
grow).  ``report_joined`` tells the agent that this worker's world formed, so a later non-zero
exit counts against ``--max-restarts`` instead of ending the job as a worker that cannot start,
and its op timeout: how long the agent waits for it at a re-form before taking it for hung.
"""

from __future__ import annotations

import os
import threading

from ... import wire
from ...config import Config
from ...errors import RendezvousError
from ...ports import host_of


def _address(cfg: Config, place: int) -> tuple[str, int]:
    return host_of(cfg.hosts, place, cfg.nproc_per_node), cfg.agent_port


def new_world(cfg: Config, place: int, formed: int) -> dict:
    """{generation, world_size, rank, plan_ranks} after the world formed in ``formed`` failed."""
    return _ask(cfg, place, {"op": "world", "place": place, "formed": formed, "pid": os.getpid()}, "recover()")


def peek(cfg: Config, place: int) -> dict:
    """{generation, world_size, rank, plan_ranks} of the agent's newest view, at once."""
    return _ask(cfg, place, _peek(place), "membership_changed()")


def _peek(place: int) -> dict:
    # The pid tells the agent that this worker watches its view: a connect it overtakes then
    # follows, and the agent need not stop it (agent.py's _view_moved).
    return {"op": "peek", "place": place, "pid": os.getpid()}


def _ask(cfg: Config, place: int, request: dict, who: str, timeout: float | None = None,
         refusal_ok: bool = False) -> dict:
    host, port = _address(cfg, place)
    try:
        reply = wire.ask(host, port, request, cfg.connect_timeout if timeout is None else timeout)
    except wire.WireError as err:
        raise RendezvousError(f"{who}: this node's hpct run agent did not answer: {err}",
                              fix="check that the agent is alive (its event log); HPCT_AGENT_PORT must be "
                                  "the port it listens on") from None
    if "error" in reply and not refusal_ok:
        raise RendezvousError(f"{who}: the agent at {host}:{port} refused: {reply['error']}",
                              fix="this worker is not in the job's new world: exit, the agent decides")
    return reply


def report_joined(cfg: Config, place: int, generation: int, op_timeout_s: float) -> None:
    # The op timeout bounds how long the agent waits for this worker to come to a re-form
    # before it takes it for hung (hpct/launch/health.py's no_shows).
    host, port = _address(cfg, place)
    try:
        wire.ask(host, port, {"op": "joined", "place": place, "generation": generation, "pid": os.getpid(),
                              "op_timeout": op_timeout_s}, 2.0)
    except wire.WireError:
        pass            # no agent to tell (it is going away): nothing depends on the answer


WATCH_S = 0.1          # how often a connecting worker asks its agent whether the view moved on
PEEK_TIMEOUT_S = 1.0   # the agent is on this node: an answer slower than this is no answer


def moved_past(cfg: Config, place: int, generation: int) -> bool:
    """Whether the agent's view is newer than ``generation`` or no longer holds ``place``
    (False when the agent does not answer at once: the connect's own deadline still holds)."""
    try:
        reply = _ask(cfg, place, _peek(place), "the view watch", PEEK_TIMEOUT_S, refusal_ok=True)
    except RendezvousError:
        return False
    return "error" in reply or int(reply["generation"]) > generation


class ViewWatch:
    """While a worker connects the world of ``generation`` (its first or a recovery's), calls
    ``abort`` once the agent's view moves past it: the connect then fails at once instead of at
    its deadline, waiting for ranks that the newer view stopped or lost, and the worker asks for
    the newer world."""

    def __init__(self, cfg: Config, place: int, generation: int, abort) -> None:
        self.cfg, self.place, self.generation, self.abort = cfg, place, generation, abort
        self.overtaken = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpct-view-watch", daemon=True)

    def __enter__(self) -> "ViewWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=PEEK_TIMEOUT_S + WATCH_S)

    def _run(self) -> None:
        while not self._done.wait(WATCH_S):
            # Once overtaken, abort on every tick: a connect that had not registered yet when
            # the first abort came is caught by the next one, not by its deadline.
            if self.overtaken or moved_past(self.cfg, self.place, self.generation):
                self.overtaken = True
                if not self._done.is_set():
                    self.abort(f"the agent's view moved past generation {self.generation}")
