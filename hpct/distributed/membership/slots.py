"""Group keys and NCCL port slots of hpct groups, and the placeholder store torch is given.

Group keys.  Every hpct group of a process listens for Gloo on one port, ``B + l``: the
listener routes each connection by the group key its handshake carries (patch 0018), so
any number of groups may be alive at once.  The key comes from the group's index, which
every member computes alike: the world group 0, subgroup ``g`` ``1 + (g - 1) mod (K - 1)``
(K = ``_gloo.GROUP_KEYS``), so a subgroup never shares the world's key.  Two live groups of
one process whose keys are equal (subgroup indexes K - 1 apart) cannot share the port: the
second is refused, naming the first.

NCCL slots (only in a process that serves CUDA).  A communicator listens on a port of its
own in the NCCL block, ``B + slot*P + l``, so a
slot must be free in every member process and all members must pick the same one.  Torch
calls a backend only on the members of a new group, so a table kept by each process
alone differs between processes (rank 0 and rank 2 have seen different subgroups) and a
"lowest free slot" read from it would differ too.  The members therefore agree over the
world group, which connects every pair already: each member sends the others its table of
held slots (point to point, a tag derived from the group's index), and every member takes
the lowest slot that no member holds.  Same inputs, same rule, same answer; no store, no
root.  The world group holds slot 0.  When every slot is held on some member the new group
is refused on every member alike, naming the slots and the fix.

Without an hpct world group (the default group is another backend) a subgroup takes
``1 + (g - 1) mod (S - 1)`` from its group index ``g``, which every rank computes alike.
"""

from __future__ import annotations

import datetime
import time
import zlib

import torch
import torch.distributed as dist

from ... import _gloo
from ...errors import CollectiveError, PortPlanError, RendezvousError

def group_key(index: int, is_world: bool | None = None) -> int:
    """The key a group's Gloo handshakes carry (see the module doc); a subgroup never gets 0,
    even one torch numbers 0 (after a default-group shrink it counts from 0 again)."""
    keys = _gloo.GROUP_KEYS
    if is_world is None:
        is_world = index == 0
    return 0 if is_world else 1 + (index - 1) % (keys - 1)


def check_key(name: str, index: int, live: list, is_world: bool | None = None, key: int | None = None) -> int:
    """The key of a new group (``key``: given, for a shrunk group that keeps its own); PortPlanError
    if a live group of this process holds it."""
    key = group_key(index, is_world) if key is None else key
    for pg in live:
        if getattr(pg, "group_key", None) == key:
            raise PortPlanError(
                f"group {name} (index {index}) would share Gloo group key {key} with the live group "
                f"{pg.group_name} (index {pg.group_index}) on this process's port: keys repeat every "
                f"{_gloo.GROUP_KEYS - 1} subgroup indexes",
                fix=f"destroy group {pg.group_name} when it is no longer needed (any number of groups "
                    f"may be alive at once, but not two whose indexes are {_gloo.GROUP_KEYS - 1} apart)")
    return key


SLOT_TAG_BASE = (1 << 30) + (1 << 24)     # above application tags and monitor.py's
SLOT_TAG_SPAN = 1 << 20


def _tag(name: str, index: int) -> int:
    key = index if str(name).isdigit() else zlib.crc32(str(name).encode())
    return SLOT_TAG_BASE + key % SLOT_TAG_SPAN


def _full(name, index, held, s) -> PortPlanError:
    return PortPlanError(
        f"group {name} (index {index}): no port slot is free on every member; slots held "
        f"{sorted(held)} of HPCT_PORT_SLOTS={s} (the world group included)",
        fix="destroy groups you no longer need, or raise HPCT_PORT_SLOTS on every rank")


def choose(name: str, index: int, global_ranks: list[int], group_rank: int, live: list, cfg) -> int:
    """The slot of a new group; the same on every member (see the module doc)."""
    s = cfg.port_slots
    held_here = {pg.slot for pg in live if pg.slot is not None}
    if index == 0 and str(name) == "0" and 0 not in held_here:
        return 0                               # the default (world) group
    if s < 2:
        raise PortPlanError(f"group {name}: HPCT_PORT_SLOTS=1 leaves no port slot for new_group "
                            "(slot 0 is the world group's)",
                            fix="set HPCT_PORT_SLOTS to the most groups alive at once (at least 2) "
                                "on every rank")
    world = next((pg for pg in live if pg.slot == 0 and pg.group_index == 0), None)
    if len(global_ranks) == 1:
        held = held_here
    elif world is None:
        slot = 1 + (index - 1) % (s - 1)
        if slot in held_here:
            raise _full(name, index, held_here, s)
        return slot
    else:
        held = _agree(world, name, index, global_ranks, global_ranks[group_rank], held_here, s,
                      cfg.connect_timeout)
    for slot in range(1, s):
        if slot not in held:
            return slot
    raise _full(name, index, held, s)


def _agree(world, name, index, members, me, held_here, s, deadline_s) -> set[int]:
    """Exchange held-slot tables with every other member over the world group; the union."""
    mine = torch.zeros(s, dtype=torch.uint8)
    for slot in held_here:
        mine[slot] = 1
    tag = _tag(name, index)
    others = [m for m in members if m != me]
    inbox = {m: torch.zeros(s, dtype=torch.uint8) for m in others}
    works = [world.send([mine], m, tag) for m in others]
    works += [world.recv([inbox[m]], m, tag) for m in others]
    end = time.monotonic() + deadline_s
    try:
        for w in works:
            w.wait(datetime.timedelta(seconds=max(end - time.monotonic(), 0.001)))
    except CollectiveError as err:
        raise RendezvousError(
            f"group {name} (index {index}): members {members} could not agree on a port slot over the "
            f"world group within {deadline_s:g} s: {err}",
            fix="every member must call new_group for this group (every rank calls new_group in the "
                "same order); raise HPCT_CONNECT_TIMEOUT if a member is merely late") from None
    held = set(held_here)
    for table in inbox.values():
        held.update(int(i) for i in torch.nonzero(table).flatten())
    return held


class PlaceholderStore(dist.Store):
    """The store torch is given for an hpct world: process-local, and it never waits.

    hpct needs no store, but torch keeps one per world and hands it to groups of other
    backends.  Keys set in this process read back; reading or waiting for any other key
    fails at once (a HashStore would wait for the whole group timeout, 30 min by default),
    naming the reason and the fix.
    """

    def __init__(self):
        super().__init__()
        self._data: dict[str, bytes] = {}

    def _missing(self, keys):
        return RuntimeError(
            f"hpct: the store of an hpct world is a process-local placeholder (hpct connects without a "
            f"store), and no rank can set key(s) {list(keys)} in it. A Gloo or NCCL group made under an "
            f"hpct world would wait for them until its timeout. Fix: create the group with the hpct "
            f"backend (new_group(backend='hpct'), the default here), or give torch a real store: "
            f"init_process_group('hpct', store=<TCPStore or FileStore>, ...)")

    @staticmethod
    def _bytes(value) -> bytes:
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    def set(self, key, value):
        self._data[key] = self._bytes(value)

    def get(self, key):
        if key not in self._data:
            raise self._missing([key])
        return self._data[key]

    def add(self, key, amount):
        value = int(self._data.get(key, b"0")) + int(amount)
        self._data[key] = str(value).encode()
        return value

    def compare_set(self, key, expected, desired):
        current = self._data.get(key)
        if (current is None and not self._bytes(expected)) or current == self._bytes(expected):
            self._data[key] = self._bytes(desired)
            return self._data[key]
        return current if current is not None else self._bytes(expected)

    def check(self, keys):
        return all(k in self._data for k in keys)

    def wait(self, keys, timeout=None):
        missing = [k for k in keys if k not in self._data]
        if missing:
            raise self._missing(missing)

    def delete_key(self, key):
        return self._data.pop(key, None) is not None

    def num_keys(self):
        return len(self._data)
