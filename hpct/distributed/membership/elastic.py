"""Shrink: the members that remain go on with fewer ranks, renumbered, at the next generation.

A shrink is a recovery with a smaller membership: the group (for the default group: every
hpct group of the process, as torch destroys the others) is aborted and released, and the
survivors connect again at the next generation from the same port plan, with no store, no
replacement and no restart.  Survivors renumber (0..n-1 in their old order) but keep their
listening addresses: the world remembers each new global rank's place in the plan
(``state.plan_rank``, world_state.py), so every peer derives a survivor's host and port from its
ORIGINAL global rank, never from its new number.

Two ways in, one result:

- ``torch.distributed.shrink_group(ranks, group=...)`` (torch >= 2.13): torch validates,
  asks the group's backend (the HpctProcessGroup itself) for ``supports_shrinking`` and calls
  its ``shrink()`` (``_torch_shrink`` here), then registers what it returns; ``install()``
  teaches torch's finaliser to take a Python process group as it is, as torch's own
  group creation does for Python groups.
- ``hd.shrink(ranks, group=...)`` for any torch: the default group shrinks through
  ``recovery.recover`` with the survivors' plan; another group is destroyed and made again
  over the survivors with ``new_group(..., use_local_synchronization=True)``.

A shrunk subgroup forms at its old generation + 1 (its members alone agree on it); the
world keeps its generation.  Ops in flight on the old group fail (the shrink aborts it).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ...errors import HpctArgumentError
from . import recovery, world
from .world import HpctProcessGroup     # only world builds groups (tests/test_layout.py)
from .world_state import state

SHRINK_DEFAULT = getattr(c10d, "SHRINK_DEFAULT", 0)
SHRINK_ABORT = getattr(c10d, "SHRINK_ABORT", 1)
SHRINK_FIX = ("pass ranks_to_exclude as a list of the group's ranks to leave out: each once, within "
              "0..size-1, not this rank (a leaving rank does not call shrink) and not all of them")


def _validate(ranks_to_exclude, pg, shrink_flags) -> set[int]:
    """The excluded group ranks, checked by torch's own validators where torch has them."""
    try:
        if not isinstance(pg, HpctProcessGroup):
            raise TypeError(f"{pg!r} is not an hpct group; use torch.distributed.shrink_group for it")
        if pg.size() <= 1:
            raise ValueError(f"Cannot shrink a process group with size {pg.size()}. "
                             "Group must have at least 2 ranks to support shrinking.")
        info = {"group_size": pg.size(), "current_rank": pg.rank()}
        if hasattr(c10d, "_validate_and_process_excluded_ranks"):
            c10d._validate_shrink_inputs(ranks_to_exclude, shrink_flags)
            return c10d._validate_and_process_excluded_ranks(ranks_to_exclude, info)
        return _validate_here(ranks_to_exclude, shrink_flags, info)
    except (TypeError, ValueError, RuntimeError) as err:
        raise HpctArgumentError(f"shrink refused, nothing changed: {err}", fix=SHRINK_FIX) from None


def _validate_here(ranks, flags, info) -> set[int]:
    """torch's rules, for a torch without shrink_group."""
    if not isinstance(ranks, list) or not ranks:
        raise ValueError(f"ranks_to_exclude must be a non-empty list, got {ranks!r}")
    if flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
        raise ValueError(f"Invalid shrink_flags value: {flags}")
    size, seen = info["group_size"], set()
    for i, r in enumerate(ranks):
        if not isinstance(r, int) or not 0 <= r < size:
            raise ValueError(f"Rank {r} at index {i} is out of bounds for group size {size}.")
        if r in seen:
            raise ValueError(f"Duplicate rank {r} found in ranks_to_exclude at index {i}.")
        seen.add(r)
    if len(seen) >= size:
        raise ValueError(f"Cannot exclude all {size} ranks from process group.")
    if info["current_rank"] in seen:
        raise RuntimeError(f"Current rank {info['current_rank']} is in the exclusion list and should not "
                           "call shrink_group().")
    return seen


def _is_default(pg) -> bool:
    return dist.is_initialized() and pg is c10d._get_default_group()


def _survivors(pg: HpctProcessGroup, excluded) -> tuple[list[int], int]:
    """The survivors' global ranks (old numbering, old order) and this process's new group rank."""
    keep = [i for i in range(pg.size()) if i not in excluded]
    return [pg.global_ranks[i] for i in keep], keep.index(pg.rank())


def shrink(ranks_to_exclude: list[int], group=None, shrink_flags: int = SHRINK_DEFAULT):
    """Go on without ``ranks_to_exclude`` (ranks of ``group``); returns the shrunk group.

    Every survivor calls it with the same list; the excluded ranks do not call.  The
    default group (``group=None``) shrinks in place: every other group is destroyed (make
    them again, in the same order), ranks renumber 0..n-1 and ``dist.group.WORLD`` is the new
    world.  Bad input raises HpctArgumentError and changes nothing.
    """
    pg = group if group is not None else (c10d._get_default_group() if dist.is_initialized() else None)
    excluded = _validate(ranks_to_exclude, pg, shrink_flags)
    survivors, new_rank = _survivors(pg, excluded)
    if _is_default(pg):
        plan = [state.plan_rank(r) for r in survivors]
        return recovery.recover(world_size=len(survivors), rank=new_rank, plan_ranks=plan)
    gen = pg.generation + 1
    key = getattr(pg, "group_key", None)
    pg.abort("shrinking the group")
    dist.destroy_process_group(pg)
    with state.groups_made_at(gen, key):
        return dist.new_group(survivors, use_local_synchronization=True)


def _backend_options(group_rank, group_size, global_ranks, name, timeout):
    opts = c10d._DistributedBackendOptions()
    opts.group_rank, opts.group_size = group_rank, group_size
    opts.global_ranks_in_group = global_ranks
    opts.group_id = name
    opts.timeout = timeout
    return opts


def _torch_shrink(pg: HpctProcessGroup, excluded, shrink_flags, pg_options) -> HpctProcessGroup:
    """The backend's shrink hook torch's shrink_group calls (after its own validation)."""
    survivors, new_rank = _survivors(pg, set(excluded))
    timeout = pg.options._timeout
    if _is_default(pg):
        # torch destroys every other group after this returns; release them now, so the new
        # world can listen on slot 0 at once (the survivor keeps its address).
        plan = [state.plan_rank(r) for r in survivors]
        gen = state.next_generation()
        world.abort_all("shrinking the default group")
        for other in state.live_groups():
            other.shutdown()
        state.renumber(new_rank, len(survivors), plan, gen)
        with state.groups_made_at(gen, 0):      # the world's key
            return world.create_group(_backend_options(new_rank, len(survivors), list(range(len(survivors))),
                                                  "0", timeout))
    gen = pg.generation + 1
    key = getattr(pg, "group_key", None)
    pg.abort("shrinking the group")
    pg.shutdown()
    with state.groups_made_at(gen, key):
        return world.create_group(_backend_options(new_rank, len(survivors), survivors,
                                              f"{pg.group_name}:shrunk:{gen}", timeout))


def _create_shrunk_process_group(new_backend, remaining_ranks, metadata, is_default_group):
    """torch's finaliser step, taking a Python process group as it is (see install)."""
    if not isinstance(new_backend, HpctProcessGroup):
        return _TORCH_CREATE_SHRUNK(new_backend, remaining_ranks, metadata, is_default_group)
    new_backend._set_group_name(metadata["new_group_name"])
    new_backend._set_group_desc("default:shrunken" if is_default_group
                                else f"{metadata['original_group_name']}:shrunk")
    return new_backend


_TORCH_CREATE_SHRUNK = getattr(c10d, "_create_shrunk_process_group", None)


def install() -> None:
    """Let torch's shrink_group shrink hpct groups (a no-op on a torch without it).

    torch wraps the backend that shrink() returns in a new c10d ProcessGroup, which only takes
    C++ backends; an hpct group is a Python ProcessGroup, which torch's group creation already
    returns as it is.  The finaliser step is replaced by one that does the same for Python
    groups and calls torch's own for every other backend.
    """
    HpctProcessGroup.shrinker = staticmethod(_torch_shrink)
    if _TORCH_CREATE_SHRUNK is not None and c10d._create_shrunk_process_group is _TORCH_CREATE_SHRUNK:
        c10d._create_shrunk_process_group = _create_shrunk_process_group
