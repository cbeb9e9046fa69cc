"""The rootless configuration: every variable hpct reads, defined once, typed and checked.

``Config.from_mapping()`` reads the environment (or any mapping, for tests) and
returns one frozen ``Config`` or raises ``ConfigError`` naming the variable, the
bad value and the fix.  Rules that join several variables are checked at
construction, so a ``Config`` that exists is always a usable port plan.

Conventions (documented in ``VARIABLES`` and docs/usage.md):
- an empty value counts as unset (``export X=`` is common in launch scripts);
- booleans are exactly ``0`` or ``1`` (HyperPod's spelling; "yes"/"true" are
  rejected rather than guessed);
- ``NCCL_SOCKET_RETRY_DELAY`` is an integer number of **milliseconds**;
  ``HPCT_CONNECT_TIMEOUT`` is seconds (a float).
"""

from __future__ import annotations

import difflib
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from .errors import ConfigError

DEFAULT_PORT_BASE = 12000    # below the 20000 ephemeral floor that `hpct ports apply` sets
DEFAULT_PORT_SLOTS = 8       # slotted groups alive at once (NCCL; the hpct backend's Gloo needs none)
DEFAULT_HOSTS = ("127.0.0.1",)
# From this group size a small float all_reduce takes recursive doubling (log2 N hops) instead of
# Gloo's ring (2(N-1) hops): below it DDP stays bit-identical to stock Gloo, as users compare.
DEFAULT_LOG_ALLREDUCE_FROM = 16
MAX_PORT = 65535
NCCL_LIBRARY_VAR = "HPCT_NCCL_LIBRARY"   # read by hpct.distributed.nccl.library and hpct doctor


@dataclass(frozen=True)
class Var:
    """One variable: its name, the Config field it fills, its type and limits."""

    name: str
    field: str
    kind: str                  # "bool" | "int" | "float" | "hosts" | "path" (a host file) | "file" | "places"
    default: object            # None: optional, or derived from other fields
    low: float | None = None
    high: float | None = None
    help: str = ""


VARIABLES: tuple[Var, ...] = (
    Var("HPCT_USE_ROOTLESS", "use_rootless", "bool", False, help="1 turns on rootless, TCPStore-less start-up"),
    Var("HPCT_PORT_BASE", "port_base", "int", DEFAULT_PORT_BASE, 1024, MAX_PORT,
        help="first port of hpct's blocks; the Gloo and NCCL bases default from it"),
    Var("N_PROC_PER_NODE", "nproc_per_node", "int", None, 1, 1024,
        help="processes per node (P); default LOCAL_WORLD_SIZE, else the world size on the default single "
             "host (WORLD_SIZE, or the size init_process_group is given), else 1"),
    Var("HPCT_PORT_SLOTS", "port_slots", "int", DEFAULT_PORT_SLOTS, 1, 4096,
        help="port slots per block (S): NCCL communicators alive at once per process (and the "
             "patched-PyTorch track's Gloo groups); the hpct backend's Gloo groups share one port, uncapped"),
    Var("TORCH_GLOO_GET_PORT_BASE", "gloo_port_base", "int", None, 1024, MAX_PORT,
        help="first port of the Gloo block; default HPCT_PORT_BASE"),
    Var("TORCH_NCCL_GET_PORT_BASE", "nccl_port_base", "int", None, 1024, MAX_PORT,
        help="first port of the NCCL block; default: right after the Gloo block"),
    Var("NCCL_SOCKET_RETRY_DELAY", "socket_retry_delay", "int", 100, 1, 60000,
        help="milliseconds between connect retries while a peer is not listening yet"),
    Var("TORCH_DIST_INIT_BARRIER", "init_barrier", "bool", False,
        help="1 runs a barrier at the end of init_process_group (PyTorch's own variable)"),
    Var("HPCT_HOSTS", "hosts", "hosts", None, help="comma list of node addresses, node 0 first"),
    Var("HPCT_HOSTFILE", "hosts", "path", None,
        help="file with one node address per line (# comments); exclusive with HPCT_HOSTS"),
    Var("HPCT_CONNECT_TIMEOUT", "connect_timeout", "float", 300.0, 0.001, 86400.0,
        help="seconds to keep connecting to peers before start-up fails"),
    Var("HPCT_LAZY_CONNECT", "lazy_connect", "bool", True,
        help="1 (default): a Gloo group connects each pair on first use; 0: the full mesh at start"),
    Var("HPCT_LOG_ALLREDUCE", "log_allreduce_from", "int", DEFAULT_LOG_ALLREDUCE_FROM, 0, 16777216,
        help="group size from which small float sums and products (up to 64 KiB) also take the log-depth "
             "all_reduce (the same bits on every rank, not stock Gloo's ring order); 0: never, so every "
             "size stays bit-equal to stock Gloo; 1: always"),
    Var(NCCL_LIBRARY_VAR, "nccl_library", "file", None,
        help="libnccl.so.2 with ncclCommInitRankRootless for CUDA tensors; default: the one torch loaded, "
             "when it is hpct's"),
    Var("HPCT_NCCL_BLOCKING", "nccl_blocking", "bool", True,
        help="1 (default): CUDA ops launch on a blocking NCCL communicator when the libnccl has "
             "ncclCommRaiseAbortFlag (hpct's series; a held call is then ended by NCCL's rules), else on a "
             "non-blocking one; 0: always non-blocking (NCCL starts a thread per launch, 60-100 us more "
             "per small op)"),
    Var("HPCT_GENERATION", "generation", "int", 0, 0, (1 << 31) - 1,
        help="membership generation a process starts in (a replacement joins at the survivors' next one)"),
    Var("HPCT_PLAN_PLACES", "plan_places", "places", None,
        help="comma list: global rank r's place in the port plan (set by `hpct run` for a replacement "
             "started into a shrunk world); default: rank r at place r"),
    Var("HPCT_AGENT_PORT", "agent_port", "int", None, 1024, MAX_PORT,
        help="port of `hpct run`'s agent on every node (set by it for its workers, who ask it for the new "
             "world in recover()); default for the agent: the first port after the NCCL block"),
    Var("RANK", "rank", "int", None, 0, 1 << 24, help="global rank (set by torchrun)"),
    Var("LOCAL_RANK", "local_rank", "int", None, 0, 1023, help="rank on this node (set by torchrun)"),
    Var("WORLD_SIZE", "world_size", "int", None, 1, 1 << 24, help="number of ranks (set by torchrun)"),
    Var("LOCAL_WORLD_SIZE", "local_world_size", "int", None, 1, 1024,
        help="ranks on this node (set by torchrun); must equal N_PROC_PER_NODE"),
)

# HPCT_* names read by other parts of hpct (the build: CMake defines, hpct/builder/main_fetch.py's
# HPCT_<COMPONENT>_SOURCE, build_cache.py's HPCT_BUILD_CACHE), accepted here so that an
# environment that builds and runs hpct is not rejected as misspelled.
FOREIGN_HPCT_NAMES = frozenset({"HPCT_BUILD_CACHE", "HPCT_GLOO_PREFIX", "HPCT_GLOO_SERIES_ID", "HPCT_GLOO_SOURCE",
                                "HPCT_NCCL_SOURCE", "HPCT_NCCL_SOURCES", "HPCT_PYTORCH_SOURCE"})
KNOWN_HPCT_NAMES = frozenset(v.name for v in VARIABLES if v.name.startswith("HPCT_")) | FOREIGN_HPCT_NAMES


def _bad(var: Var, raw: str, why: str, fix: str) -> ConfigError:
    return ConfigError(f"{var.name}={raw!r}: {why}", fix=fix)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _range_text(var: Var) -> str:
    return f"between {_num(var.low)} and {_num(var.high)}"


def _parse_bool(var: Var, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise _bad(var, raw, "expected 0 or 1", f"set {var.name}=0 or {var.name}=1")
    return raw == "1"


def _parse_number(var: Var, raw: str, convert: Callable[[str], float]) -> float:
    text = raw.strip()
    try:
        # int() would also take "1_000" and "٣"; a port or count is plain ASCII digits.
        if "_" in text or (convert is int and not text.lstrip("+-").isascii()):
            raise ValueError(text)
        value = convert(text)
    except ValueError:
        kind = "an integer" if convert is int else "a number"
        raise _bad(var, raw, f"not {kind}", f"set {var.name} to {kind} {_range_text(var)}") from None
    if value != value or not var.low <= value <= var.high:   # value != value: NaN
        raise _bad(var, raw, f"out of range ({_range_text(var)})",
                   f"set {var.name} to a value {_range_text(var)}")
    return value


def _parse_hosts(var: Var, raw: str, entries: list[str]) -> tuple[str, ...]:
    hosts = tuple(entries)
    if not hosts:
        raise _bad(var, raw, "no host addresses", f"list one address per node in {var.name}")
    for host in hosts:
        if not host or any(c.isspace() for c in host):
            raise _bad(var, raw, f"bad host entry {host!r}",
                       f"list addresses separated by commas, with no blanks, in {var.name}")
        if host.startswith("[") or host.endswith("]"):
            raise _bad(var, raw, f"host entry {host!r} is bracketed",
                       f"write IPv6 addresses without brackets in {var.name} (e.g. ::1); the port is not "
                       "part of a host entry")
    # Gloo and the NCCL ring open one socket family per group: every node must be reachable in it.
    families = {f"IPv{ipaddress.ip_address(h).version}" for h in hosts if _is_ip(h)}
    if len(families) > 1:
        raise _bad(var, raw, "IPv4 and IPv6 addresses mixed",
                   f"list every node in one family in {var.name} (all IPv4 or all IPv6)")
    # Two nodes at one address would derive identical (host, port) pairs for different ranks.
    dupes = sorted({h for h in hosts if hosts.count(h) > 1})
    if dupes:
        raise _bad(var, raw, f"host {dupes[0]} listed twice", f"list each node once in {var.name}")
    return hosts


def _parse_places(var: Var, raw: str) -> tuple[int, ...]:
    try:
        places = tuple(int(x) for x in raw.split(","))
    except ValueError:
        raise _bad(var, raw, "not a comma list of integers",
                   f"list one plan place per global rank in {var.name}, e.g. 0,1,4,5") from None
    if min(places) < 0:
        raise _bad(var, raw, f"negative place {min(places)}", f"places in {var.name} count from 0")
    dupes = sorted({x for x in places if places.count(x) > 1})
    if dupes:
        raise _bad(var, raw, f"place {dupes[0]} listed twice", f"give each rank its own place in {var.name}")
    return places


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _read_hostfile(var: Var, raw: str) -> tuple[str, ...]:
    try:
        text = Path(raw).read_text(encoding="utf-8")
    except OSError as err:
        raise _bad(var, raw, f"cannot read the file ({err.strerror or err})",
                   f"point {var.name} at a readable file with one address per line") from None
    except UnicodeDecodeError as err:
        raise _bad(var, raw, f"not UTF-8 text (byte {err.start})",
                   f"write {var.name} as plain text, one address per line") from None
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return _parse_hosts(var, raw, [line for line in lines if line])


def _parse(var: Var, raw: str):
    if var.kind == "bool":
        return _parse_bool(var, raw)
    if var.kind == "int":
        return int(_parse_number(var, raw, int))
    if var.kind == "float":
        return float(_parse_number(var, raw, float))
    if var.kind == "hosts":
        return _parse_hosts(var, raw, [h.strip() for h in raw.split(",")])
    if var.kind == "places":
        return _parse_places(var, raw)
    if var.kind == "file":
        if not Path(raw).is_file():
            raise _bad(var, raw, "no such file", f"point {var.name} at an existing file, or unset it")
        return raw
    return _read_hostfile(var, raw)


def _reject_unknown(env: Mapping[str, str]) -> None:
    for name in sorted(env):
        if name.startswith("HPCT_") and name not in KNOWN_HPCT_NAMES:
            close = difflib.get_close_matches(name, sorted(KNOWN_HPCT_NAMES), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            known = ", ".join(sorted(KNOWN_HPCT_NAMES))
            raise ConfigError(f"unknown variable {name}={env[name]!r}",
                              fix=f"{hint}hpct reads only: {known}")


@dataclass(frozen=True)
class Config:
    """The checked configuration; build it with ``Config.from_mapping()``."""

    use_rootless: bool = False
    port_base: int = DEFAULT_PORT_BASE
    nproc_per_node: int = 1
    port_slots: int = DEFAULT_PORT_SLOTS
    gloo_port_base: int = DEFAULT_PORT_BASE
    nccl_port_base: int = DEFAULT_PORT_BASE + DEFAULT_PORT_SLOTS
    socket_retry_delay: int = 100          # milliseconds
    init_barrier: bool = False
    hosts: tuple[str, ...] = DEFAULT_HOSTS
    connect_timeout: float = 300.0         # seconds
    lazy_connect: bool = True              # Gloo pairs on first use, not the full mesh
    log_allreduce_from: int = DEFAULT_LOG_ALLREDUCE_FROM   # group size: small float sums in log depth
    generation: int = 0                    # bumped by each in-process recovery
    nccl_library: str | None = None        # the rootless libnccl for the CUDA half
    nccl_blocking: bool = True             # CUDA ops on a blocking NCCL communicator
    agent_port: int | None = None          # hpct run's node agent (None: no agent)
    plan_places: tuple[int, ...] | None = None   # rank -> plan place at start (a shrunk world's)
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None

    @property
    def block_size(self) -> int:
        """Ports per backend block: S slots of P ports."""
        return self.port_slots * self.nproc_per_node

    @property
    def blocks(self) -> dict[str, range]:
        return {"gloo": range(self.gloo_port_base, self.gloo_port_base + self.block_size),
                "nccl": range(self.nccl_port_base, self.nccl_port_base + self.block_size)}

    @property
    def default_agent_port(self) -> int:
        """Where ``hpct run``'s agents listen unless HPCT_AGENT_PORT says: right after the blocks."""
        return max(b.stop for b in self.blocks.values())

    def float_doubling(self, group_size: int) -> bool:
        """Whether a group of ``group_size`` sums a small float all_reduce by recursive doubling
        (other bits than Gloo's ring) rather than the ring (HPCT_LOG_ALLREDUCE; 0: never)."""
        return 0 < self.log_allreduce_from <= group_size

    def __post_init__(self) -> None:
        _check_rules(self)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, str] | None = None, *, world_size: int | None = None) -> "Config":
        """Read, type-check and cross-check every variable of ``mapping`` (default: os.environ).

        ``world_size``: the size ``init_process_group`` was given, when WORLD_SIZE is unset: on the
        default single host with neither N_PROC_PER_NODE nor LOCAL_WORLD_SIZE set, the world fits
        on that host (a notebook's or a test harness's ``init_process_group("hpct", rank=r,
        world_size=n)`` needs no hpct variable)."""
        env = os.environ if mapping is None else mapping
        _reject_unknown(env)
        raw = {v.name: env[v.name] for v in VARIABLES if env.get(v.name, "") != ""}
        if "HPCT_HOSTS" in raw and "HPCT_HOSTFILE" in raw:
            raise ConfigError("both HPCT_HOSTS and HPCT_HOSTFILE are set",
                              fix="unset one of them: they are two spellings of the same host list")
        values = {v.field: _parse(v, raw[v.name]) for v in VARIABLES if v.name in raw}
        for v in VARIABLES:
            if v.default is not None:
                values.setdefault(v.field, v.default)
        # Derived defaults: P from torchrun's LOCAL_WORLD_SIZE, Gloo at the base,
        # NCCL right after the Gloo block so the two never overlap.
        source = nproc_source(env, world_size)
        if source == NPROC_FROM_LOCAL:
            values["nproc_per_node"] = values["local_world_size"]
        elif source == NPROC_FROM_WORLD:
            values["nproc_per_node"] = values.get("world_size") or world_size
        values.setdefault("nproc_per_node", 1)
        values.setdefault("gloo_port_base", values["port_base"])
        values.setdefault("nccl_port_base",
                          values["gloo_port_base"] + values["port_slots"] * values["nproc_per_node"])
        values.setdefault("hosts", DEFAULT_HOSTS)
        return cls(**values)


# Where a Config's processes per node come from (nproc_source): doctor and `hpct ports plan` say it.
NPROC_GIVEN, NPROC_FROM_LOCAL = "N_PROC_PER_NODE", "LOCAL_WORLD_SIZE"
NPROC_FROM_WORLD = "the world size on the default single host"
NPROC_DEFAULT = "the default (no world size known yet)"


def nproc_source(mapping: Mapping[str, str] | None = None, world_size: int | None = None) -> str:
    """Which rule gives N_PROC_PER_NODE for ``mapping``: set, LOCAL_WORLD_SIZE, the world size on
    the default single host (WORLD_SIZE, or ``world_size`` given by init_process_group), else 1."""
    env = os.environ if mapping is None else mapping
    if env.get("N_PROC_PER_NODE", ""):
        return NPROC_GIVEN
    if env.get("LOCAL_WORLD_SIZE", ""):
        return NPROC_FROM_LOCAL
    one_host = not env.get("HPCT_HOSTS", "") and not env.get("HPCT_HOSTFILE", "")
    if one_host and (env.get("WORLD_SIZE", "") or world_size):
        return NPROC_FROM_WORLD
    return NPROC_DEFAULT


def _span(block: range) -> str:
    return f"{block.start}-{block.stop - 1}"


def _check_rules(c: Config) -> None:
    """Rules that join several variables; each names every variable involved."""
    p, s = c.nproc_per_node, c.port_slots
    blocks = c.blocks
    for backend, var in (("gloo", "TORCH_GLOO_GET_PORT_BASE"), ("nccl", "TORCH_NCCL_GET_PORT_BASE")):
        block = blocks[backend]
        if block.stop - 1 > MAX_PORT:
            raise ConfigError(
                f"the {backend} block {block.start}-{block.stop - 1} ({var}={block.start}, "
                f"HPCT_PORT_SLOTS={s} x N_PROC_PER_NODE={p} ports) ends above {MAX_PORT}",
                fix=f"lower {var} (or HPCT_PORT_BASE) to at most {MAX_PORT + 1 - c.block_size}, "
                    f"or lower HPCT_PORT_SLOTS")
    g, n = blocks["gloo"], blocks["nccl"]
    if g.start < n.stop and n.start < g.stop:
        raise ConfigError(
            f"the gloo block {_span(g)} (TORCH_GLOO_GET_PORT_BASE={g.start}) overlaps the nccl block "
            f"{_span(n)} (TORCH_NCCL_GET_PORT_BASE={n.start})",
            fix=f"set TORCH_NCCL_GET_PORT_BASE to at least {g.stop} or unset it (it then follows the gloo block)")
    if c.agent_port is not None and any(c.agent_port in b for b in blocks.values()):
        raise ConfigError(f"HPCT_AGENT_PORT={c.agent_port} lies in the gloo block {_span(g)} or the nccl block "
                          f"{_span(n)}", fix=f"unset HPCT_AGENT_PORT (it then follows the blocks) or pick a port "
                                             f"outside both, e.g. {c.default_agent_port}")
    if c.local_world_size is not None and c.local_world_size != p:
        raise ConfigError(f"LOCAL_WORLD_SIZE={c.local_world_size} differs from N_PROC_PER_NODE={p}",
                          fix="set N_PROC_PER_NODE to the number of processes torchrun starts per node "
                              "(or unset it: it defaults to LOCAL_WORLD_SIZE)")
    if c.local_rank is not None and c.local_rank >= p:
        raise ConfigError(f"LOCAL_RANK={c.local_rank} is not below N_PROC_PER_NODE={p}",
                          fix=f"set N_PROC_PER_NODE to the processes per node (more than {c.local_rank})")
    capacity = len(c.hosts) * p
    if c.world_size is not None and c.world_size > capacity:
        if len(c.hosts) == 1 and c.hosts == DEFAULT_HOSTS:
            raise ConfigError(
                f"WORLD_SIZE={c.world_size} spans more than one node (N_PROC_PER_NODE={p}) "
                f"but no host list is set",
                fix=f"on one host, set N_PROC_PER_NODE={c.world_size} (or unset it and LOCAL_WORLD_SIZE); on "
                    "several, set HPCT_HOSTS=addr0,addr1,... or HPCT_HOSTFILE=FILE, one address per node")
        raise ConfigError(
            f"WORLD_SIZE={c.world_size} does not fit {len(c.hosts)} hosts x N_PROC_PER_NODE={p} = {capacity}",
            fix="list every node in HPCT_HOSTS/HPCT_HOSTFILE, or correct N_PROC_PER_NODE")
    if c.rank is not None:
        limit = c.world_size if c.world_size is not None else capacity
        if c.rank >= limit:
            what = f"WORLD_SIZE={c.world_size}" if c.world_size is not None else \
                f"{len(c.hosts)} hosts x N_PROC_PER_NODE={p}"
            raise ConfigError(f"RANK={c.rank} is not below {what}",
                              fix="set RANK to 0..WORLD_SIZE-1 (torchrun sets it for you)")
        # The plan places rank r on hosts[r // P] with local rank r % P (as torchrun does);
        # any other placement would make peers dial the wrong port.
        if c.local_rank is not None and c.rank % p != c.local_rank:
            raise ConfigError(
                f"RANK={c.rank} with N_PROC_PER_NODE={p} has local rank {c.rank % p}, "
                f"but LOCAL_RANK={c.local_rank}",
                fix="launch with block placement (rank = node * N_PROC_PER_NODE + LOCAL_RANK), as torchrun does")


def describe_variables() -> str:
    """A Markdown table of every variable (used for docs/usage.md)."""
    rows = ["| variable | type | default | range | meaning |", "|---|---|---|---|---|"]
    derived = {"N_PROC_PER_NODE": "LOCAL_WORLD_SIZE, else the world size on the default single host, else 1",
               "TORCH_GLOO_GET_PORT_BASE": "HPCT_PORT_BASE",
               "TORCH_NCCL_GET_PORT_BASE": "Gloo base + S x P",
               "HPCT_HOSTS": "127.0.0.1"}
    for v in VARIABLES:
        if v.name in derived:
            default = derived[v.name]
        elif isinstance(v.default, bool):
            default = str(int(v.default))
        else:
            default = "unset" if v.default is None else f"{v.default:g}" if isinstance(v.default, float) \
                else str(v.default)
        limits = f"{_num(v.low)}..{_num(v.high)}" if v.low is not None else ("0 or 1" if v.kind == "bool" else "")
        rows.append(f"| `{v.name}` | {v.kind} | {default} | {limits} | {v.help} |")
    return "\n".join(rows)
