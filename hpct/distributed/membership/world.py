"""Rootless start-up and group creation for the ``hpct`` backend: the c10d creator, the world's connect.

Start-up: every process derives every peer's (host, port) from the configuration and the
port plan (DESIGN.md) and connects the full mesh directly; no TCPStore is created, nothing
listens on MASTER_PORT and rank 0 may start last.  Torch still wants a store object, so a
process-local ``HashStore`` stands in; it is never shared.

Groups: every hpct group of a process listens on the same port, ``B + l`` (patch 0018: one
listener per process routes each connection by the group key in its handshake), so any
number of groups may be alive at once and ``dist.new_group`` costs no agreement round.  The
key is the group's index (slots.group_key: the world 0, a subgroup 1 + (g-1) mod 1023),
which every member computes alike.  Group ranks map to global ranks; global rank ``r``
lives on ``hosts[r // P]`` at ``B + r % P``.  Only a process that serves CUDA still agrees
on a port slot per group, for its NCCL communicator (each listens on a port of its own in
the NCCL block; slots.py).  Torch's store is a process-local placeholder that fails at once
where something waits on it (a Gloo subgroup, a store barrier) instead of at the timeout.

The world's membership and generations live in one owner (world_state.py).  Which world to
connect is decided above this module (recovery.py: the first world, or the next after a failure;
follow.py: the one ``hpct run``'s agent holds); they end here, in ``connect_world``.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ... import _gloo
from ...config import NPROC_DEFAULT, Config, nproc_source
from ...errors import ConfigError, FormationError, PortPlanError, RendezvousError
from ...ports import shared_peers
from ..backend import checks
from ..backend.group import BACKEND_NAME, HpctProcessGroup
from ..backend.monitor import monitored_barrier as _monitored_barrier
from . import agent_link, slots
from .slots import PlaceholderStore
from .world_state import state


def generation() -> int:
    """The generation this process's groups use now."""
    return state.generation()


def live_groups() -> list[HpctProcessGroup]:
    return state.live_groups()


def _group_index(group_name: str) -> int:
    if str(group_name).isdigit():
        return int(group_name)
    # A hashed name (use_local_synchronization=True): torch has already advanced the counter.
    return max(c10d._world.group_count - 1, 0)


def connect_context(cfg: Config, *, name: str, group_rank: int, generation: int, peers: list,
                    global_rank: int, key: int, timeout: float, connect_timeout: float | None = None,
                    connect: bool = True, deadline_name: str = "HPCT_CONNECT_TIMEOUT", missing_fix: str = ""):
    """A storeless Gloo context for one group, connected (unless ``connect`` is False) to ``peers``
    [(host, port)] within ``connect_timeout`` (default HPCT_CONNECT_TIMEOUT); errors say what to do."""
    group_size, gen = len(peers), generation
    connect_timeout = cfg.connect_timeout if connect_timeout is None else connect_timeout
    retry_max = cfg.socket_retry_delay / 1000.0
    try:
        ctx = _gloo.Context(group_rank, group_size, gen, peers, timeout=timeout,
                            connect_timeout=connect_timeout, connect=False,
                            retry_delay_initial=min(0.002, retry_max), retry_delay_max=retry_max,
                            lazy=cfg.lazy_connect, group_key=key,
                            float_doubling=cfg.float_doubling(group_size))
    except _gloo.AddressInUseError as err:
        host, port = peers[group_rank]
        raise PortPlanError(
            f"group {name}: global rank {global_rank} cannot listen on {host}:{port} "
            f"(the port every hpct group of this process shares): {err}",
            fix="another process holds the port: stop it, run `hpct ports check`, or move the plan "
                "with HPCT_PORT_BASE") from None
    if not connect:
        return ctx
    with state.connecting(ctx):
        _connect(ctx, name, gen, global_rank, connect_timeout, deadline_name, missing_fix)
    _disable_store_barrier()
    if cfg.init_barrier:
        try:
            ctx.barrier()
        except BaseException:
            ctx.close()
            raise
    return ctx


def _connect(ctx, name: str, gen: int, global_rank: int, connect_timeout: float, deadline_name: str,
             missing_fix: str) -> None:
    """``ctx.connect()``; a failure closes the context and says what to do."""
    try:
        ctx.connect()
    except _gloo.StaleGenerationError as err:
        ctx.close()
        state.saw(err.newer_generation)
        raise RendezvousError(
            f"group {name}: generation {gen} is older than a peer's ({err.newer_generation}): {err}",
            fix="call recover() again: it moves to the newest generation seen") from None
    except _gloo.PeerLeftError as err:
        ctx.close()
        raise FormationError(
            f"group {name} (generation {gen}): global rank {global_rank}'s connect failed before the "
            f"group formed: {err}",
            fix="call recover() again: the next membership forms without the peer that left (under "
                "hpct run, recover() asks the agent for it)") from None
    except _gloo.ConnectTimeoutError as err:
        ctx.close()
        raise RendezvousError(
            f"group {name} (generation {gen}): global rank {global_rank} could not connect "
            f"to every peer within {deadline_name}={connect_timeout:g} s: {err}",
            fix=missing_fix or "start the missing ranks (a replacement must join with HPCT_GENERATION set to "
                               "the survivors' generation), or raise HPCT_CONNECT_TIMEOUT") from None
    except BaseException:
        ctx.close()
        raise


def create_group(dist_opts, backend_options=None):
    """The c10d creator (extended API): build and connect one storeless context."""
    cfg = state.config()
    gen, forced_key = state.next_group()
    gen = state.generation() if gen is None else gen
    group_rank, group_size = dist_opts.group_rank, dist_opts.group_size
    global_ranks = list(dist_opts.global_ranks_in_group) or list(range(group_size))
    name = str(dist_opts.group_id)
    index = _group_index(name)
    # Key 0 is the world's: the group torch makes first (after a default-group shrink torch
    # numbers new groups from "0" again, and those are subgroups).
    is_world = index == 0 and name == "0" and not dist.is_initialized()
    if is_world and nproc_source() == NPROC_DEFAULT and group_size > cfg.nproc_per_node:
        # init_process_group("hpct", rank=r, world_size=n) with no hpct variable: the world fits on
        # the default single host (Config.from_mapping's rule, now that its size is known).
        cfg = state.reconfigure_for(group_size)
    p = cfg.nproc_per_node
    if is_world:
        state.first_places(cfg, group_size)
    key = slots.check_key(name, index, live_groups(), is_world, forced_key)
    # Only the NCCL block still holds a port per live group (a communicator's own listener).
    engines = device_engines()
    slot = slots.choose(name, index, global_ranks, group_rank, live_groups(), cfg) if engines else None
    try:
        peers = shared_peers(cfg.hosts, cfg.gloo_port_base, map(state.plan_rank, global_ranks), p)
    except PortPlanError as err:
        raise ConfigError(f"cannot place group {name} of {group_size} ranks: {err.problem}",
                          fix=f"set N_PROC_PER_NODE (now {p}, from {nproc_source()}) and HPCT_HOSTS/HPCT_HOSTFILE "
                              f"so that every rank has a node: on one host, N_PROC_PER_NODE={group_size}") from None
    timeout = dist_opts.timeout.total_seconds() if dist_opts.timeout else 1800.0
    t0 = time.perf_counter()
    # A group made for torch's reconfigure API forms its membership at the first reconfigure
    # (reconfigure.py); until then it listens (so its handle can be reached) and connects nothing.
    pending = bool(getattr(dist_opts, "enable_reconfigure", False))
    ctx = connect_context(cfg, name=name, group_rank=group_rank, generation=gen, peers=peers,
                          global_rank=global_ranks[group_rank], key=key, timeout=timeout,
                          connect=not pending)
    pg = HpctProcessGroup(ctx, group_name=name, group_index=index, global_ranks=global_ranks)
    pg.awaiting_reconfigure = pending
    pg.slot = slot
    pg.group_key = key
    for device_type, factory in engines:
        # Nothing touches the GPU or opens a socket here: the communicator forms rootlessly at
        # the group's first CUDA op, on the group's slot in the NCCL block.
        pg.attach(factory(cfg, name=name, index=index, slot=slot, group_rank=group_rank,
                          global_ranks=global_ranks, generation=gen, op_timeout=timeout,
                          places=[state.plan_rank(r) for r in global_ranks]), device_type)
    pg.on_shutdown = state.forget
    with state.locked():
        state.add_group(pg)
        if index == 0:       # a world started through torch's own init_process_group takes its rank here
            state.world_formed(gen, time.perf_counter() - t0, global_ranks[group_rank], group_size,
                               dist_opts.timeout)
    if is_world and cfg.agent_port is not None:
        agent_link.report_joined(cfg, state.plan_rank(global_ranks[group_rank]), gen, timeout)
    return pg


def _serves_cuda() -> bool:
    """Whether groups get a CUDA engine: torch was built with CUDA and sees a device."""
    return torch.cuda.is_available()


# The engines a group gets besides Gloo's, as [(device type served, factory)], when not None.
# hpct/testing/nccl_sim sets it to route CPU tensors to the NCCL engine over a simulated library and
# CUDA runtime (a test seam: nothing in hpct sets it).
ENGINES_OVERRIDE: list | None = None


def device_engines() -> list:
    """[(device type, engine factory)] for a new group: the NCCL engine for CUDA tensors when
    torch sees a GPU (the factory's keywords are engine_for_group's)."""
    if ENGINES_OVERRIDE is not None:
        return ENGINES_OVERRIDE
    if not _serves_cuda():
        return []
    from ..nccl.plan import engine_for_group
    return [("cuda", engine_for_group)]


def register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        devices = ["cpu", "cuda"] if _serves_cuda() else ["cpu"]
        dist.Backend.register_backend(BACKEND_NAME, create_group, extended_api=True, devices=devices)


def _disable_store_barrier() -> None:
    # torch's TORCH_DIST_INIT_BARRIER barrier (read after the creator returns) goes through the
    # store, a process-local placeholder here: it would wait for the timeout.  hpct has read the
    # variable (Config.init_barrier) and runs a real barrier on each new group instead.
    os.environ.pop("TORCH_DIST_INIT_BARRIER", None)


def members(cfg: Config, rank: int | None, world_size: int | None,
            plan_ranks: list[int] | None) -> tuple[int, int, list[int] | None]:
    """(rank, world size, plan places or None) of a world to connect: the given ones, else
    RANK/WORLD_SIZE and HPCT_PLAN_PLACES (a first world only); a wrong one names the fix."""
    rank = cfg.rank if rank is None else rank
    world_size = cfg.world_size if world_size is None else world_size
    if rank is None or world_size is None:
        raise ConfigError("hpct.distributed.init_process_group needs the rank and the world size",
                          fix="pass rank= and world_size=, or set RANK and WORLD_SIZE (torchrun sets both)")
    if plan_ranks is None:
        plan_ranks = state.start_places(cfg, world_size)
    if plan_ranks is not None and len(plan_ranks) != world_size:
        raise ConfigError(f"plan_ranks places {len(plan_ranks)} ranks in the port plan, but the world has "
                          f"{world_size}",
                          fix="pass one plan place per global rank (a shrunk world keeps its survivors'), "
                              "or plan_ranks=None to place rank r at r")
    return rank, world_size, plan_ranks


def connect_world(rank: int | None, world_size: int | None, *, config: Config,
                  timeout: datetime.timedelta | float | None = None, generation: int | None = None,
                  plan_ranks: list[int] | None = None):
    """Connect the default group of this membership (``members``) in ``generation`` (None: the
    current one); returns the world group.  Which world to connect is recovery.py's to decide."""
    rank, world_size, plan_ranks = members(config, rank, world_size, plan_ranks)
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    state.start(config, rank, world_size, generation=generation, timeout=timeout, plan_ranks=plan_ranks)
    _disable_store_barrier()
    if not dist.is_initialized():
        c10d._world.group_count = 0      # a failed earlier attempt may have advanced it
    kwargs = {"timeout": timeout} if timeout is not None else {}
    store = PlaceholderStore()
    state.keep_store(store)
    dist.init_process_group(BACKEND_NAME, store=store, rank=rank, world_size=world_size, **kwargs)
    return dist.group.WORLD


def abort_all(reason: str = "aborted by hpct.distributed.abort_all") -> int:
    """Abort every hpct group (and connect in progress) of this process; bounded, any thread."""
    groups, connecting = state.live_groups(), state.connecting_contexts()
    for pg in groups:
        pg.abort(reason)
    for ctx in connecting:
        ctx.abort(reason)
    return len(groups) + len(connecting)


def shutdown_all(timeout: float = 10.0) -> None:
    """Release every hpct group, then forget torch's world (resets its group counter).

    The clean exit (``dist.barrier(); shutdown_all()``): an idle group closes gracefully, so
    peers still finishing the barrier read its last messages, then a goodbye, and fail
    nothing; a group with an op in flight is aborted (see HpctProcessGroup.shutdown), and so
    is a connect in progress.  For the fault path use abort_all() first (recover() does).
    """
    for ctx in state.connecting_contexts():
        ctx.abort("shutting down")
    for pg in state.live_groups():
        pg.shutdown(timeout)
        state.forget(pg)
    if dist.is_initialized():
        dist.destroy_process_group()
    c10d._world.group_count = 0


def group_monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """``torch.distributed.monitored_barrier`` for an hpct group (default: the world)."""
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, HpctProcessGroup):
        checks.fail("monitored_barrier", f"{pg!r} is not an hpct group",
                    "call torch.distributed.monitored_barrier for a Gloo group")
    _monitored_barrier(pg, timeout, wait_all_ranks)


def last_connect_seconds() -> float | None:
    """Seconds the last default-group connect took (for benchmarks and the demo)."""
    return state.last_connect_seconds
