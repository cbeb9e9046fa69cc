"""The port plan (DESIGN.md, normative): where every rank listens and where it dials its peers.

Process ``l`` of a node listens for group ``g`` of a backend whose block starts at
``B`` on ``B + (g mod S)*P + l``; global rank ``r`` lives on ``hosts[r // P]``.  A backend
whose groups share one listener (the ``hpct`` backend's Gloo: every group of a process on
``B + l``, told apart by a group key in the handshake) uses slot 0 only: ``shared_port``.
The same formulas are implemented in C++ (Gloo, NCCL, c10d patches); the shared
vectors in tests/vectors/port_plan.json keep every implementation in step.

Everything here is pure: no sockets, no /proc.  ``check_plan`` takes the kernel's
values as arguments so it can be tested with any range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from .errors import PortPlanError

BACKENDS = ("gloo", "nccl")
MAX_PORT = 65535


def port_of(block_base: int, group: int, local_rank: int, nproc_per_node: int, slots: int) -> int:
    """Listening port of local rank ``local_rank`` for group ``group``: B + (g mod S)*P + l."""
    if nproc_per_node < 1 or slots < 1:
        raise PortPlanError(f"nproc_per_node={nproc_per_node}, slots={slots}: both must be at least 1",
                            fix="set N_PROC_PER_NODE and HPCT_PORT_SLOTS to positive integers")
    if not 0 <= local_rank < nproc_per_node:
        raise PortPlanError(f"local rank {local_rank} is outside 0..{nproc_per_node - 1}",
                            fix="LOCAL_RANK must be below N_PROC_PER_NODE")
    if group < 0:
        raise PortPlanError(f"group index {group} is negative",
                            fix="group indices come from the global group counter and start at 0")
    port = block_base + (group % slots) * nproc_per_node + local_rank
    if not 1 <= block_base or port > MAX_PORT:
        raise PortPlanError(f"port {port} (block base {block_base}) is not a valid TCP port",
                            fix="choose a block base so that base + slots*nproc_per_node - 1 <= 65535")
    return port


def shared_port(block_base: int, local_rank: int, nproc_per_node: int) -> int:
    """The one port local rank ``l`` listens on for every group of a backend that shares a
    listener among its groups (the ``hpct`` backend's Gloo, patch 0018): B + l, slot 0."""
    return port_of(block_base, 0, local_rank, nproc_per_node, 1)


def shared_peers(hosts: Sequence[str], block_base: int, places: Iterable[int],
                 nproc_per_node: int) -> list[tuple[str, int]]:
    """(host, port) of each plan place in ``places`` for a backend whose groups share one
    listener per process (``shared_port``): the hpct backend's Gloo, ``hpct diagnose``."""
    return [(host_of(hosts, q, nproc_per_node), shared_port(block_base, q % nproc_per_node, nproc_per_node))
            for q in places]


def host_of(hosts: Sequence[str], rank: int, nproc_per_node: int) -> str:
    """Address of global rank ``rank``: hosts[rank // P] (block placement, as torchrun does)."""
    node = rank // nproc_per_node if nproc_per_node >= 1 else -1
    if rank < 0 or not 0 <= node < len(hosts):
        raise PortPlanError(f"rank {rank} with {nproc_per_node} processes per node needs node {node}, "
                            f"but the host list has {len(hosts)} entries",
                            fix="list every node in HPCT_HOSTS or HPCT_HOSTFILE")
    return hosts[node]


def peer_table(hosts: Sequence[str], block_base: int, group: int, world_size: int,
               nproc_per_node: int, slots: int) -> list[tuple[str, int]]:
    """(host, port) of every global rank 0..world_size-1 for one group of one backend."""
    return [(host_of(hosts, r, nproc_per_node),
             port_of(block_base, group, r % nproc_per_node, nproc_per_node, slots))
            for r in range(world_size)]


@dataclass(frozen=True)
class PortPlan:
    """The plan of one job, as every rank computes it from the same configuration."""

    hosts: tuple[str, ...]
    nproc_per_node: int
    slots: int
    bases: tuple[tuple[str, int], ...]      # (backend, block base), in BACKENDS order
    world_size: int

    @classmethod
    def from_config(cls, config) -> "PortPlan":
        world = config.world_size if config.world_size is not None else \
            len(config.hosts) * config.nproc_per_node
        return cls(hosts=tuple(config.hosts), nproc_per_node=config.nproc_per_node,
                   slots=config.port_slots, world_size=world,
                   bases=(("gloo", config.gloo_port_base), ("nccl", config.nccl_port_base)))

    @property
    def max_groups(self) -> int:
        """The most groups of one slotted backend alive at once (slot g mod S is reused): NCCL
        communicators, and the patched-PyTorch track's ProcessGroupGloo.  The ``hpct`` backend's
        Gloo groups share one port (``shared_port``) and have no such bound."""
        return self.slots

    def base(self, backend: str) -> int:
        for name, base in self.bases:
            if name == backend:
                return base
        raise PortPlanError(f"unknown backend {backend!r}", fix=f"use one of: {', '.join(BACKENDS)}")

    def block(self, backend: str) -> range:
        """Every port the backend may listen on, on every node."""
        base = self.base(backend)
        return range(base, base + self.slots * self.nproc_per_node)

    def listen_port(self, backend: str, group: int, local_rank: int) -> int:
        return port_of(self.base(backend), group, local_rank, self.nproc_per_node, self.slots)

    def shared_port(self, backend: str, local_rank: int) -> int:
        """The one port local rank ``l`` listens on for every group of a backend whose groups
        share a listener (the ``hpct`` backend's Gloo): B + l."""
        return shared_port(self.base(backend), local_rank, self.nproc_per_node)

    def local_ports(self, backend: str, local_rank: int) -> list[int]:
        """The ports one local rank uses across all slots (what `hpct doctor` test-binds)."""
        return [self.listen_port(backend, g, local_rank) for g in range(self.slots)]

    def peers(self, backend: str, group: int, ranks: Iterable[int] | None = None) -> list[tuple[str, int]]:
        """(host, port) of each rank in ``ranks`` (default: the whole world) for one group."""
        ranks = range(self.world_size) if ranks is None else ranks
        base = self.base(backend)
        return [(host_of(self.hosts, r, self.nproc_per_node),
                 port_of(base, group, r % self.nproc_per_node, self.nproc_per_node, self.slots))
                for r in ranks]

    def as_dict(self) -> dict:
        return {"hosts": list(self.hosts), "nproc_per_node": self.nproc_per_node, "slots": self.slots,
                "world_size": self.world_size, "max_groups": self.max_groups,
                "blocks": {b: {"first": self.block(b).start, "last": self.block(b).stop - 1}
                           for b, _ in self.bases}}


@dataclass(frozen=True)
class Problem:
    """One way the plan conflicts with the kernel, with the fix."""

    backend: str
    ports: tuple[int, ...]
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.message}\n  fix: {self.fix}"


def port_set(ports: Iterable[int | range]) -> set[int]:
    """Flatten a mix of ports and ranges (the reserved list's two spellings) into a set."""
    out: set[int] = set()
    for item in ports:
        if isinstance(item, range):
            out.update(item)
        else:
            out.add(int(item))
    return out


def compress(ports: Iterable[int]) -> str:
    """1,2,3,7 -> '1-3,7' (the kernel's ip_local_reserved_ports syntax)."""
    spans: list[list[int]] = []
    for p in sorted(set(ports)):
        if spans and p == spans[-1][1] + 1:
            spans[-1][1] = p
        else:
            spans.append([p, p])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def check_plan(plan: PortPlan, port_range: tuple[int, int],
               reserved: Iterable[int | range] = ()) -> list[Problem]:
    """Ports of the plan that an outgoing connection could take before hpct listens on them.

    The kernel hands out ephemeral ports from ``port_range`` (inclusive) except the
    reserved ones.  DESIGN.md asks each block to end below the floor or be fully
    reserved; a block entirely above the range's high end is equally safe, so the
    check is exact: every block port inside the range must be reserved.
    """
    low, high = port_range
    taken = port_set(reserved)
    problems = []
    blocks = {b: plan.block(b) for b, _ in plan.bases}
    for backend, block in blocks.items():
        exposed = tuple(p for p in block if low <= p <= high and p not in taken)
        if exposed:
            span = f"{block.start}-{block.stop - 1}"
            problems.append(Problem(
                backend, exposed,
                f"{len(exposed)} of the {backend} block's ports ({compress(exposed)}) lie in the ephemeral "
                f"range {low}-{high} and are not reserved",
                f"run `hpct ports apply`: it sets the ephemeral floor (20000) and, where the block is not "
                f"below it, reserves {span} (merged with the existing reservations)"))
    names = list(blocks)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            common = set(blocks[a]) & set(blocks[b])
            if common:
                problems.append(Problem(f"{a}+{b}", tuple(sorted(common)),
                                        f"the {a} and {b} blocks share ports {compress(common)}",
                                        fix="set TORCH_NCCL_GET_PORT_BASE after the gloo block, or unset it"))
    return problems


def busy_ports(ports: Iterable[int], host: str = "0.0.0.0") -> dict[int, str]:
    """Ports that cannot be bound now, with the reason; binds like Gloo's listener (SO_REUSEADDR)."""
    import socket
    busy = {}
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as err:
                busy[port] = err.strerror or str(err)
    return busy


def free_port_block(count: int, low: int = 11000, high: int = 19000, host: str = "127.0.0.1",
                    avoid: Iterable[int] = ()) -> int:
    """A base B with B..B+count-1 bindable now, for tests, benchmarks and the demo.

    Searched at random in [low, high): below hpct's ephemeral floor (20000), so no outgoing
    connection takes one meanwhile, and spread out so parallel runs rarely collide.
    """
    import os
    import random
    import time
    avoid = set(avoid)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(500):
        base = rng.randrange(low, high - count)
        ports = range(base, base + count)
        if not avoid.intersection(ports) and not busy_ports(ports, host):
            return base
    raise RuntimeError(f"no block of {count} free ports in {low}..{high}")
