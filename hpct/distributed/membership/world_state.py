"""The one owner of this process's world: its membership, its generations and its live groups.

Every module that starts, recovers, shrinks, grows or reconfigures the world reads and changes it
here, through methods, under one lock (``locked()`` for a caller's own sequence of steps).  The
generations it keeps:

- ``generation()``: the one groups use now (HPCT_GENERATION until a world formed or moved on);
- ``formed``: the one the world last formed in (None before the first);
- ``newest_seen``: the newest one a peer showed (a refused connect: StaleGenerationError);
- ``next_generation()``: a recovery's target, from the three.

``state`` is the process's one instance; world.py builds groups with it, and the modules above
(recovery, follow, elastic, admission, reconfigure) move it on.
"""

from __future__ import annotations

import contextlib
import datetime
import threading

from ...config import Config
from ...errors import ConfigError


class WorldState:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._config: Config | None = None
        self._generation: int | None = None
        self._rank: int | None = None
        self._world_size: int | None = None
        self._timeout: datetime.timedelta | None = None
        self._groups: list = []              # live HpctProcessGroup objects
        self._connecting: list = []          # contexts still connecting (abortable)
        self._last_init_s: float | None = None   # seconds spent in the last world connect
        self._formed: int | None = None      # the generation in which the world last formed
        self._newest_seen = -1               # the newest generation a peer showed
        self._store = None                   # the world's PlaceholderStore (kept alive: world.connect_world)
        self._plan_ranks: list | None = None     # global rank -> its place in the port plan (None: the same);
                                                 # a shrink renumbers ranks, each survivor keeps its address
        self._group_generation: int | None = None   # generation of the next group made (elastic.py), else the world's
        self._group_key: int | None = None          # group key of the next group made (elastic.py), else from its index

    @contextlib.contextmanager
    def locked(self):
        """Hold the state's lock across several steps (it is re-entrant: methods inside take it again)."""
        with self._lock:
            yield self

    # -- configuration ---------------------------------------------------------------------
    def config(self) -> Config:
        """The world's Config: the one it was started with, else read from the environment once."""
        with self._lock:
            if self._config is None:
                self._config = Config.from_mapping()
            return self._config

    def reconfigure_for(self, world_size: int) -> Config:
        """The environment's Config again, now that the world's size is known."""
        with self._lock:
            self._config = Config.from_mapping(world_size=world_size)
            return self._config

    # -- generations -----------------------------------------------------------------------
    def generation(self) -> int:
        """The generation this process's groups use now."""
        with self._lock:
            if self._generation is None:
                self._generation = self.config().generation
            return self._generation

    def generation_or(self, cfg: Config) -> int:
        """The current generation, or ``cfg``'s when none is set yet (nothing is stored)."""
        with self._lock:
            return cfg.generation if self._generation is None else self._generation

    @property
    def formed(self) -> int | None:
        """The generation in which the current world formed (None before its first)."""
        with self._lock:
            return self._formed

    @property
    def newest_seen(self) -> int:
        with self._lock:
            return self._newest_seen

    def saw(self, generation: int) -> None:
        """A peer showed ``generation`` (it refused this process's older one)."""
        with self._lock:
            self._newest_seen = max(self._newest_seen, int(generation))

    def next_generation(self) -> int:
        """A recovery's target generation: the one after the generation the world last formed in,
        kept by a failed attempt (so ranks that retry a different number of times meet), or a
        newer one that a peer showed."""
        with self._lock:
            current, formed, newest = self.generation(), self._formed, self._newest_seen
        target = current if formed is None or current > formed else formed + 1
        return max(target, newest)

    # -- membership ------------------------------------------------------------------------
    def membership(self) -> tuple:
        """(rank, world size, op timeout, plan places or None) of the current world."""
        with self._lock:
            return self._rank, self._world_size, self._timeout, self._plan_ranks

    def plan_rank(self, global_rank: int) -> int:
        """Where global rank ``global_rank`` sits in the port plan (its host and local rank)."""
        with self._lock:
            plan = self._plan_ranks
        return global_rank if plan is None else plan[global_rank]

    def start_places(self, cfg: Config, world_size: int) -> list[int] | None:
        """HPCT_PLAN_PLACES for the first world of a process only (a replacement that ``hpct run``
        starts into a shrunk world); later worlds get their places from recover()."""
        if cfg.plan_places is None or self.formed is not None:
            return None
        if len(cfg.plan_places) != world_size:
            raise ConfigError(f"HPCT_PLAN_PLACES lists {len(cfg.plan_places)} places, but WORLD_SIZE is {world_size}",
                              fix="list one plan place per global rank, or unset HPCT_PLAN_PLACES")
        return list(cfg.plan_places)

    def start(self, cfg: Config, rank: int, world_size: int, *, generation: int | None, timeout,
              plan_ranks: list[int] | None) -> None:
        """A world is about to connect with this configuration and membership; ``generation`` None
        keeps the current one (HPCT_GENERATION's before the first)."""
        with self._lock:
            self._config = cfg
            if generation is not None:
                self._generation = generation
            elif self._generation is None:
                self._generation = cfg.generation
            self._rank, self._world_size, self._timeout = rank, world_size, timeout
            self._plan_ranks = list(plan_ranks) if plan_ranks is not None else None

    def first_places(self, cfg: Config, world_size: int) -> None:
        """torch's own init_process_group("hpct") made this process's first world: its plan places
        come from HPCT_PLAN_PLACES, if set."""
        with self._lock:
            if self._rank is None:
                places = self.start_places(cfg, world_size)
                if places is not None:
                    self._plan_ranks = places

    def renumber(self, rank: int, world_size: int, plan_ranks: list[int], generation: int) -> None:
        """The default group shrank in place (torch's shrink_group): the survivors' new numbering."""
        with self._lock:
            self._rank, self._world_size, self._plan_ranks = rank, world_size, list(plan_ranks)
            self._generation = generation

    def world_formed(self, generation: int, seconds: float, rank: int, world_size: int, timeout) -> None:
        """The world group formed in ``generation`` after ``seconds``; a world started through
        torch's own init_process_group takes its rank and size from it."""
        with self._lock:
            self._last_init_s, self._formed = seconds, generation
            if self._rank is None:
                self._rank, self._world_size, self._timeout = rank, world_size, timeout

    def reconfigured(self, rank: int, world_size: int, plan_ranks: list[int], generation: int,
                     seconds: float) -> None:
        """The default group took a new membership in place (reconfigure.py)."""
        with self._lock:
            self._rank, self._world_size, self._plan_ranks = rank, world_size, list(plan_ranks)
            self._generation = self._formed = generation
            self._last_init_s = seconds

    @property
    def last_connect_seconds(self) -> float | None:
        return self._last_init_s

    def keep_store(self, store) -> None:
        """torch keeps only the C++ side of a Python store: the Python object must stay alive for
        its methods to be found when a Gloo subgroup calls them."""
        self._store = store

    # -- groups ----------------------------------------------------------------------------
    def live_groups(self) -> list:
        with self._lock:
            return list(self._groups)

    def add_group(self, pg) -> None:
        with self._lock:
            self._groups.append(pg)

    def forget(self, pg) -> None:
        with self._lock:
            if pg in self._groups:
                self._groups.remove(pg)

    @contextlib.contextmanager
    def connecting(self, ctx):
        """``ctx`` connects inside: abort_all() reaches it."""
        with self._lock:
            self._connecting.append(ctx)
        try:
            yield ctx
        finally:
            with self._lock:
                if ctx in self._connecting:
                    self._connecting.remove(ctx)

    def connecting_contexts(self) -> list:
        with self._lock:
            return list(self._connecting)

    def next_group(self) -> tuple[int | None, int | None]:
        """(generation, group key) the next group made takes, where elastic.py set them (else None)."""
        with self._lock:
            return self._group_generation, self._group_key

    @contextlib.contextmanager
    def groups_made_at(self, generation: int, key: int | None = None):
        """Groups made inside form at ``generation`` instead of the world's, and with the group
        key ``key`` (a shrunk group's own: it replaces that group on the shared port)."""
        with self._lock:
            self._group_generation, self._group_key = generation, key
        try:
            yield
        finally:
            with self._lock:
                self._group_generation, self._group_key = None, None


state = WorldState()
