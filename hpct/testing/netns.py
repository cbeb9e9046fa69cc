"""Throw-away network namespaces for tests (sysctl values, multi-host rendezvous).

Each namespace has its own ports, its own loopback and its own
``net.ipv4.ip_local_port_range`` / ``ip_local_reserved_ports``, so tests may
change those for real without touching the machine.  Everything created here is
deleted in ``finally`` blocks; names carry a random suffix so parallel runs never
collide.  Every command has a timeout.

Children run with cwd "/" so that ``python -c`` imports the installed hpct, never a
checkout in the current folder.  Use (an installed part of hpct, for the tests and benchmarks/)::

    from hpct.testing.netns import netns, netns_network, unavailable_reason


    with netns("hpct-sysctl") as ns:
        ns.python("print(open('/proc/sys/net/ipv4/ip_local_port_range').read())")

    with netns_network(3) as nodes:          # 3 namespaces on one bridge
        nodes[0].address                     # "10.231.0.1", reachable from nodes[1] and nodes[2]
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

TIMEOUT_S = 30.0


def _ip(*args: str, timeout: float = TIMEOUT_S) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=timeout)


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """None when namespaces can be made here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN); run the multihost tests as root"
    if shutil.which("ip") is None:
        return "the `ip` program (iproute2) is not installed"
    name = f"hpct-probe-{secrets.token_hex(4)}"
    try:
        _ip("netns", "add", name)
    except (subprocess.SubprocessError, OSError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        return f"`ip netns add` fails here: {detail.strip()}"
    _delete(name)
    return None


def tc(ns: "Namespace", *args: str, check: bool = True) -> None:
    """tc inside a namespace; a failure names the command and what tc said (a bare
    CalledProcessError, its output captured, told nothing of why a qdisc was refused)."""
    r = subprocess.run(["ip", "netns", "exec", ns.name, "tc", *args], capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    if check and r.returncode:
        raise RuntimeError(f"`tc {' '.join(args)}` in namespace {ns.name} exited {r.returncode}: "
                           f"{(r.stderr or r.stdout).strip() or '(nothing said)'}")


@contextlib.contextmanager
def limited_link(a: "Namespace", b: "Namespace", rate: str) -> Iterator[None]:
    """Limit only the traffic between namespaces a and b, both ways, to RATE (tc's units, such as
    4kbit) for the with-block: an htb class that only b's (a's) address is filtered into; the
    rest stays unshaped."""
    try:
        for src, dst in ((a, b), (b, a)):
            tc(src, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb")
            tc(src, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:20", "htb", "rate", rate)
            tc(src, "filter", "add", "dev", "eth0", "protocol", "ip", "parent", "1:", "prio", "1", "u32",
               "match", "ip", "dst", f"{dst.address}/32", "flowid", "1:20")
        yield
    finally:
        for n in (a, b):     # unchecked: a set-up that failed half-way left no qdisc on one end
            tc(n, "qdisc", "del", "dev", "eth0", "root", check=False)


def _delete(name: str) -> None:
    try:
        _ip("netns", "del", name)
    except (subprocess.SubprocessError, OSError):
        pass    # already gone; nothing else of ours lives outside the namespace


def hpct_pythonpath() -> str:
    """The folder holding the ``hpct`` the tests imported, so children import the same copy."""
    import hpct
    return str(Path(hpct.__file__).resolve().parent.parent)


@dataclass(frozen=True)
class Namespace:
    name: str
    address: str | None = None      # IPv4 address on the shared link; None for a lone namespace

    def _env(self, env: dict | None) -> dict:
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (hpct_pythonpath(), env.get("PYTHONPATH")) if p)
        return env

    def argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str], *, timeout: float = TIMEOUT_S, env: dict | None = None,
            check: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=timeout,
                              env=self._env(env), check=check, cwd="/")

    def python(self, code: str, *args: str, timeout: float = TIMEOUT_S, env: dict | None = None,
               check: bool = False) -> subprocess.CompletedProcess:
        return self.run([sys.executable, "-c", code, *args], timeout=timeout, env=env, check=check)

    def hpct(self, *args: str, timeout: float = TIMEOUT_S, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run the ``hpct`` console entry point inside the namespace."""
        code = "import sys; from hpct.cli import main; sys.exit(main())"
        return self.run([sys.executable, "-c", code, *args], timeout=timeout, env=env)

    def popen(self, argv: Sequence[str], *, env: dict | None = None, **kwargs) -> subprocess.Popen:
        """Start a process in the namespace; the caller must wait for it with a timeout."""
        kwargs.setdefault("cwd", "/")
        return subprocess.Popen(self.argv(argv), env=self._env(env), **kwargs)

    def read_sysctl(self, name: str) -> str:
        path = "/proc/sys/" + name.replace(".", "/")
        return self.run(["cat", path], check=True).stdout.strip()


@contextlib.contextmanager
def netns(name_prefix: str = "hpct-test") -> Iterator[Namespace]:
    """One namespace with loopback up, deleted on exit."""
    name = f"{name_prefix}-{secrets.token_hex(4)}"
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        yield Namespace(name)
    finally:
        _delete(name)


@contextlib.contextmanager
def hub_and_hosts(count: int, name_prefix: str, subnet: str) -> Iterator[tuple[str, list[Namespace]]]:
    """A hub namespace and ``count`` host namespaces, each host's eth0 at ``subnet.(i+1)/24``.

    The other end of host i's eth0 is the hub's ``h<i>`` (up, attached to nothing): the
    caller joins them (a bridge in :func:`netns_network`, a forwarder in lossy.py).
    Every name carries one random tag, so parallel runs never collide.  The hub holds
    every link made, so deleting the namespaces (on exit, always) removes every link
    and address this made.
    """
    if not 1 <= count <= 250:
        raise ValueError(f"count={count}: between 1 and 250 namespaces fit one /24")
    tag = secrets.token_hex(4)
    hub = f"{name_prefix}-hub-{tag}"
    names = [f"{name_prefix}-{i}-{tag}" for i in range(count)]
    made: list[str] = []
    try:
        for name in (hub, *names):
            _ip("netns", "add", name)
            made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        nodes = []
        for i, name in enumerate(names):
            _ip("-n", hub, "link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("-n", hub, "link", "set", f"h{i}", "up")
            address = f"{subnet}.{i + 1}"
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            nodes.append(Namespace(name, address))
        yield hub, nodes
    finally:
        for name in reversed(made):
            _delete(name)


@contextlib.contextmanager
def netns_network(count: int, name_prefix: str = "hpct-test",
                  subnet: str = "10.231.0") -> Iterator[list[Namespace]]:
    """``count`` namespaces, each with eth0 at ``subnet.(i+1)/24``, joined by a bridge.

    The bridge lives in an extra "hub" namespace rather than on the machine, so
    deleting the namespaces removes every link and address this made.
    """
    with hub_and_hosts(count, name_prefix, subnet) as (hub, nodes):
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i in range(len(nodes)):
            _ip("-n", hub, "link", "set", f"h{i}", "master", "br0")
        yield nodes
