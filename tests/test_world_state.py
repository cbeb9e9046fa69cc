"""The world's one owner (hpct/distributed/world_state.py): the generation a recovery targets, the
membership a shrink or a reconfigure leaves, and the groups it keeps.  In process, no network: the
recoveries that meet in these generations are tests/test_recovery.py's."""

from __future__ import annotations

import pytest

from hpct.config import Config
from hpct.distributed.membership.world_state import WorldState

pytestmark = pytest.mark.unit


def started(generation: int = 3) -> WorldState:
    world = WorldState()
    world.start(Config.from_mapping({"HPCT_GENERATION": str(generation)}), 1, 4, generation=None, timeout=None,
                plan_ranks=None)
    return world


def test_a_recovery_targets_the_current_generation_until_a_world_formed_then_the_one_after():
    world = started(3)
    assert world.generation() == 3 and world.formed is None
    assert world.next_generation() == 3, "a replacement's first world: HPCT_GENERATION itself"
    world.world_formed(3, 0.5, rank=1, world_size=4, timeout=None)
    assert world.next_generation() == 4
    assert world.next_generation() == 4, "kept by a failed attempt: ranks that retry meet in it"
    world.start(world.config(), 1, 4, generation=4, timeout=None, plan_ranks=None)
    assert world.next_generation() == 4, "moved to but not formed in: still the target"


def test_a_newer_generation_a_peer_showed_wins():
    world = started(3)
    world.world_formed(3, 0.5, rank=1, world_size=4, timeout=None)
    world.saw(9)
    world.saw(7)
    assert world.newest_seen == 9 and world.next_generation() == 9


def test_a_shrink_renumbers_and_keeps_each_survivors_place_in_the_plan():
    world = started(0)
    world.renumber(1, 3, [0, 2, 3], generation=1)
    assert world.membership()[:2] == (1, 3) and world.generation() == 1
    assert [world.plan_rank(r) for r in range(3)] == [0, 2, 3]


def test_groups_made_inside_take_the_given_generation_and_key_and_only_there():
    world = started(0)
    assert world.next_group() == (None, None)
    with world.groups_made_at(5, key=7):
        assert world.next_group() == (5, 7)
    assert world.next_group() == (None, None)
    with pytest.raises(RuntimeError), world.groups_made_at(6):
        raise RuntimeError("the group failed to form")
    assert world.next_group() == (None, None), "reset even when the group failed to form"


def test_a_connecting_context_is_reachable_only_while_it_connects_and_groups_are_forgotten_once():
    world, ctx, pg = started(0), object(), object()
    with world.connecting(ctx):
        assert world.connecting_contexts() == [ctx]
    assert world.connecting_contexts() == []
    world.add_group(pg)
    assert world.live_groups() == [pg]
    world.forget(pg)
    world.forget(pg)
    assert world.live_groups() == []
