"""The two kernel settings hpct depends on, read and written through /proc/sys.

Both values belong to the network namespace of the process that opens the file,
which is what lets the tests change them for real inside a throw-away namespace.
The /proc/sys root is a constructor argument so unit tests can point it at a
temporary folder.

Rules: reservations are merged, never replaced (other software reserves ports
too); every write is read back and verified; without privilege the error's fix
is the exact ``sysctl -w`` command to run as root.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .errors import SysctlError
from .ports import compress, port_set

PORT_RANGE = "net.ipv4.ip_local_port_range"
RESERVED_PORTS = "net.ipv4.ip_local_reserved_ports"
DEFAULT_ROOT = "/proc/sys"
DEFAULT_EPHEMERAL_FLOOR = 20000     # HyperPod's `ip_local_port_range="20000 65535"`
MIN_FLOOR = 1024                    # the kernel refuses a floor below ip_unprivileged_port_start
MAX_PORT = 65535
_NO_PRIVILEGE = (errno.EACCES, errno.EPERM)


def parse_ranges(text: str, name: str = RESERVED_PORTS) -> set[int]:
    """The kernel's list syntax ``"a-b,c"`` (empty means none) to a set of ports."""
    ports: set[int] = set()
    for item in text.strip().split(","):
        item = item.strip()
        if not item:
            continue
        try:
            a, _, b = item.partition("-")
            low, high = int(a), int(b or a)
        except ValueError:
            raise SysctlError(f"{name}: cannot parse {item!r} in {text.strip()!r}",
                              fix="write ports as a comma list of N or A-B, e.g. 12000-12015,13000") from None
        if not 0 <= low <= high <= MAX_PORT:
            raise SysctlError(f"{name}: bad port span {item!r}",
                              fix=f"spans are A-B with 0 <= A <= B <= {MAX_PORT}")
        ports.update(range(low, high + 1))
    return ports


def format_ranges(ports: Iterable[int | range]) -> str:
    """The inverse of ``parse_ranges``: the shortest ``a-b,c`` spelling."""
    return compress(port_set(ports))


def parse_port_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split())
    except ValueError:
        raise SysctlError(f"{PORT_RANGE}: cannot parse {text.strip()!r}",
                          fix='the value is two ports, low and high, e.g. "20000 65535"') from None
    return low, high


@dataclass(frozen=True)
class Write:
    """One setting to write: ``command`` is what a root shell would run instead."""

    name: str
    value: str

    @property
    def command(self) -> str:
        return f'sysctl -w {self.name}="{self.value}"'


class Sysctl:
    """Read and write net.* settings under one /proc/sys root."""

    def __init__(self, root: str | Path = DEFAULT_ROOT) -> None:
        self.root = Path(root)

    def path(self, name: str) -> Path:
        return self.root.joinpath(*name.split("."))

    def read(self, name: str) -> str:
        try:
            return self.path(name).read_text()
        except OSError as err:
            raise SysctlError(f"cannot read {name} at {self.path(name)}: {err.strerror or err}",
                              fix="run on Linux with /proc mounted (in a container: a network namespace "
                                  "of its own is fine)") from None

    def port_range(self) -> tuple[int, int]:
        return parse_port_range(self.read(PORT_RANGE))

    def reserved_ports(self) -> set[int]:
        return parse_ranges(self.read(RESERVED_PORTS))

    def _write_one(self, write: Write) -> None:
        with open(self.path(write.name), "w") as f:
            f.write(write.value + "\n")

    def write(self, writes: list[Write]) -> None:
        """Write in order, then read back; on failure undo what was written and raise."""
        olds = [self.read(w.name).strip() for w in writes]
        done: list[tuple[Write, str]] = []
        try:
            for w, old in zip(writes, olds):
                self._write_one(w)
                done.append((w, old))
        except OSError as err:
            self._undo(done)
            commands = "; ".join(w.command for w in writes)
            if err.errno == errno.EROFS:
                raise SysctlError(f"{self.path(w.name)} is read-only here (a container's /proc/sys)",
                                  fix=f"set it for this network namespace from a privileged (init) container "
                                      f"or the pod's securityContext.sysctls: {commands}") from None
            if err.errno in _NO_PRIVILEGE:
                raise SysctlError(f"no permission to write {w.name} ({err.strerror})",
                                  fix=f"run as root: {commands}") from None
            raise SysctlError(f"the kernel refused {w.name}={w.value!r} ({err.strerror or err})",
                              fix=f"check the value; the commands were: {commands}") from None
        self.verify(writes)

    def _undo(self, done: list[tuple[Write, str]]) -> None:
        # Best effort: a failed apply must not leave half of its writes behind.
        for w, old in reversed(done):
            try:
                self._write_one(Write(w.name, old))
            except OSError:
                pass

    def verify(self, writes: list[Write]) -> None:
        for w in writes:
            got = self.read(w.name)
            if w.name == PORT_RANGE:
                ok = parse_port_range(got) == parse_port_range(w.value)
            elif w.name == RESERVED_PORTS:
                ok = parse_ranges(w.value) <= parse_ranges(got)
            else:
                ok = got.split() == w.value.split()
            if not ok:
                raise SysctlError(f"{w.name} reads back {got.strip()!r} after writing {w.value!r}",
                                  fix=f"another agent may be managing this setting; run {w.command} and "
                                      f"check `sysctl {w.name}`")


def plan_writes(port_range: tuple[int, int], reserved: set[int], blocks: Iterable[range],
                floor: int = DEFAULT_EPHEMERAL_FLOOR) -> list[Write]:
    """The writes that make ``blocks`` safe: floor at ``floor``, blocks above it reserved.

    Reservations come first so that no block port is ever briefly ephemeral while
    the floor moves.  Returns [] when the kernel is already as wanted.
    """
    if not MIN_FLOOR <= floor < MAX_PORT:
        raise SysctlError(f"ephemeral floor {floor} is outside {MIN_FLOOR}..{MAX_PORT - 1}",
                          fix="pass --ephemeral-floor between 1024 and 65534 (HyperPod uses 20000)")
    low, high = port_range
    target = (floor, high if high > floor else MAX_PORT)
    needed = {p for block in blocks for p in block if target[0] <= p <= target[1]}
    writes = []
    if not needed <= reserved:
        writes.append(Write(RESERVED_PORTS, format_ranges(reserved | needed)))
    if target != (low, high):
        writes.append(Write(PORT_RANGE, f"{target[0]} {target[1]}"))
    return writes


def apply(sysctl: Sysctl, blocks: Iterable[range], floor: int = DEFAULT_EPHEMERAL_FLOOR,
          dry_run: bool = False) -> list[Write]:
    """Bring the kernel in line with the plan; returns the writes (done, or due with ``dry_run``)."""
    writes = plan_writes(sysctl.port_range(), sysctl.reserved_ports(), list(blocks), floor)
    if writes and not dry_run:
        sysctl.write(writes)
    return writes
