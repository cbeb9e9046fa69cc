"""torch's reconfigure API (torch >= 2.14) on the ``hpct`` backend: membership changed in place.

A caller (torchft, torchcomms, a launcher) exchanges every member's handle out of band and
calls ``dist._reconfigure(uuid, handles)`` on each; shrink, grow, merge, split and identity
are all this one call.  hpct forms the new membership the way it forms any group: rootless
and store-free, each member connecting to the others' addresses, here read from the handles.

- **Handle**: what a peer needs to reach this process: the job's identity, host, the port
  every hpct group of the process shares, its place in the port plan, the generation of the
  group when the handle was taken and the process id.  Text: ``hpct1`` + compact JSON.
- **Ranks**: a list assigns them by position; a set is ordered by (place, host, pid), alike on
  every member.
- **Generation**: 1 + the newest generation in the handles.  Every member derives the same one
  and it is newer than each member's current group, so a connection from the old membership
  (same group key, older generation) is refused and a member still on its old group learns
  it is older, never joins.  Handles are therefore taken after the previous reconfigure; one
  older than the group refuses the call (it would reuse a generation).
- **uuid**: names the configuration; a uuid this group has taken is refused ("already used").

The group object stays (torch holds it): its engines are stopped (an op in flight is
aborted) and new ones serve the new membership.  Only the default group reconfigures; a
subgroup is made again with ``new_group`` after it.  ``enable_reconfigure=True`` at
``init_process_group`` makes a group that listens and connects nothing until the first
reconfigure.  docs/elastic.md compares this with ``hd.recover()`` and ``shrink_group``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ... import _gloo
from ...errors import HpctArgumentError
from ..backend.runner import done_work
from ..backend.work import HpctWork
from . import world
from .world_state import state

HANDLE_PREFIX = "hpct1"
MAX_GENERATION = (1 << 31) - 1
STOP_S = 10.0        # bound on stopping the old engines (an op in flight is aborted, not awaited)
FRESH = "take every member's handle with torch.distributed._get_reconfigure_handle() after its last reconfigure"


@dataclass(frozen=True)
class Handle:
    job: str           # the port plan's identity: every member of one job has the same
    host: str
    port: int          # the Gloo port every hpct group of the process shares
    place: int         # the process's place in the port plan (its global rank at start)
    generation: int    # the group's generation when the handle was taken
    pid: int

    def text(self) -> str:
        return HANDLE_PREFIX + json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def parse(cls, text) -> "Handle":
        if not isinstance(text, str) or not text.startswith(HANDLE_PREFIX):
            raise ValueError(f"{str(text)[:60]!r} is not an hpct reconfigure handle")
        try:
            fields = json.loads(text[len(HANDLE_PREFIX):])
            handle = cls(**fields)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{text[:60]!r} is a damaged hpct reconfigure handle ({err})") from None
        if not isinstance(handle.port, int) or not isinstance(handle.generation, int):
            raise ValueError(f"{text[:60]!r} is a damaged hpct reconfigure handle (port, generation)")
        return handle

    def order(self) -> tuple:
        return (self.place, self.host, self.pid)

    def process(self) -> tuple:
        """Which process the handle names (its generation may differ between two handles of it)."""
        return (self.host, self.port, self.pid)


def _job(cfg) -> str:
    """A digest of what every process of one job shares: the plan, the hosts, torchrun's run id
    (a digest keeps a handle short however many hosts the job has)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    text = f"{run_id}@{cfg.gloo_port_base}/{cfg.nproc_per_node}/{','.join(cfg.hosts or ())}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _own(pg) -> Handle:
    cfg = state.config()
    rank = state.membership()[0]
    place = state.plan_rank(rank if rank is not None else pg.rank())
    host, port = pg.context.peers[pg.rank()]
    return Handle(job=_job(cfg), host=host, port=port, place=place, generation=pg.generation, pid=os.getpid())


def handle(pg) -> str:
    """This process's handle for ``pg`` (the default group): text its peers pass to reconfigure."""
    _default_only(pg, "get_reconfigure_handle")
    return _own(pg).text()


def _refuse(problem: str, fix: str):
    raise HpctArgumentError(f"hpct reconfigure refused, nothing changed: {problem}", fix=fix)


def _default_only(pg, what: str) -> None:
    if not dist.is_initialized() or pg is not c10d._get_default_group():
        _refuse(f"{what} on {pg!r}: hpct reconfigures the default group only",
                "reconfigure the default group, then make the subgroup again with new_group")


def members(pg, handles) -> tuple[list[Handle], int]:
    """The new members in rank order and this process's rank among them; refuses bad input."""
    ordered = isinstance(handles, (list, tuple))
    try:
        parsed = [Handle.parse(h) for h in handles]
    except ValueError as err:
        _refuse(str(err), f"pass handles from torch.distributed._get_reconfigure_handle() of hpct groups; {FRESH}")
    if not parsed:
        _refuse("no handles", "pass one handle per member, this process's own included")
    if not ordered:
        parsed.sort(key=Handle.order)
    me = _own(pg)
    seen = {}                     # process -> its index in the handles
    for i, h in enumerate(parsed):
        if h.job != me.job:
            _refuse(f"handle {i} is of another job ({h.job!r}; this one is {me.job!r})",
                    "pass only handles of this job's processes (same HPCT_PORT_BASE, hosts, processes per node)")
        if h.process() in seen:
            _refuse(f"handles {seen[h.process()]} and {i} name the same process ({h.host}:{h.port}, pid {h.pid})",
                    "pass each member's handle once")
        seen[h.process()] = i
    if me.process() not in seen:
        _refuse(f"this process's handle ({me.host}:{me.port}, pid {me.pid}) is not among the {len(parsed)} handles",
                "every member passes the same handles, its own among them; a process that leaves does not call")
    return parsed, seen[me.process()]


def generation_of(parsed: list[Handle]) -> int:
    """The new membership's generation: 1 + the newest in the handles (alike on every member)."""
    return min(max(h.generation for h in parsed) + 1, MAX_GENERATION)


def run(pg, opts) -> HpctWork:
    """Reconfigure ``pg`` (torch's ReconfigureOptions: uuid, handles, timeout); returns a done Work."""
    _default_only(pg, "reconfigure")
    uuid = int(opts.uuid)
    if uuid in pg.used_uuids:
        _refuse(f"uuid {uuid} already used by this group", "pass a fresh uuid on every reconfigure")
    parsed, rank = members(pg, opts.handles)
    gen = generation_of(parsed)
    if gen <= pg.generation:
        _refuse(f"the handles are of generation {gen - 1} or older, but this group is at generation "
                f"{pg.generation}", FRESH)
    timeout = opts.timeout
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None
    if seconds is not None and not seconds > 0:
        _refuse(f"timeout {timeout!r} is not positive", "pass a positive timedelta, or none for HPCT_CONNECT_TIMEOUT")
    pg.used_uuids.add(uuid)
    cfg = state.config()
    op_timeout = pg.context.timeout
    t0 = time.perf_counter()
    # The old context gives up the group's key before the new one takes it; a failed connect
    # leaves the group refusing ops until a later reconfigure.
    with _listener_kept(pg):
        pg.stop_engines(STOP_S)
        ctx = world.connect_context(cfg, name=pg.group_name, group_rank=rank, generation=gen,
                                    peers=[(h.host, h.port) for h in parsed], global_rank=rank,
                                    key=pg.group_key, timeout=op_timeout, connect_timeout=seconds,
                                    deadline_name="the reconfigure's timeout" if seconds else "HPCT_CONNECT_TIMEOUT",
                                    missing_fix="every member the handles name calls reconfigure with the same "
                                                "uuid and handles within the timeout; leave out the ones that are "
                                                "gone and call it again with a fresh uuid")
    places, ranks = [h.place for h in parsed], list(range(len(parsed)))
    pg.serve(ctx, global_ranks=ranks, generation=gen)
    for device_type, factory in world.device_engines():
        pg.attach(factory(cfg, name=pg.group_name, index=pg.group_index, slot=pg.slot, group_rank=rank,
                          global_ranks=ranks, generation=gen, op_timeout=op_timeout, places=places),
                  device_type)
    state.reconfigured(rank, len(parsed), places, gen, time.perf_counter() - t0)
    c10d._world.pg_group_ranks[pg] = {r: r for r in ranks}
    return done_work()


@contextlib.contextmanager
def _listener_kept(pg):
    """Keep the process's listener up while the group's context is swapped: the last context
    on it to close takes the listener down (10-20 ms measured), and the new one would make it
    again.  An unconnected one-member context on a key no live group holds keeps it."""
    free = sorted(set(range(1, _gloo.GROUP_KEYS)) - {getattr(g, "group_key", None) for g in state.live_groups()})
    keeper = None
    if free:
        keeper = _gloo.Context(0, 1, 0, [pg.context.peers[pg.rank()]], timeout=1.0, connect_timeout=1.0,
                               connect=False, lazy=True, group_key=free[-1])
    try:
        yield
    finally:
        if keeper is not None:
            keeper.close()


def install() -> None:
    """Let torch's reconfigure API reach hpct groups (torch >= 2.14; harmless before)."""
    world.HpctProcessGroup.reconfigurer = _Reconfigurer


class _Reconfigurer:
    handle = staticmethod(handle)
    run = staticmethod(run)
