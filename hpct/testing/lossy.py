"""A lossy, slow link between network namespaces, without ``netem``.

This machine's kernel has no ``netem`` qdisc, so loss and delay come from a small
userspace switch instead.  ``lossy_network(n, loss=0.05, delay_ms=20)`` makes ``n``
host namespaces, each with ``eth0`` at ``10.<x>.<y>.(i+1)/24``, and one hub namespace
holding the other end of every veth.  The hub has no bridge: a forwarder process
(this file, run as a script inside the hub) reads every frame from the hub ends with
AF_PACKET sockets, drops a random fraction of the IPv4 frames and sends the rest out
of the port that leads to the destination MAC (learnt from source addresses; unknown
and broadcast destinations are flooded) after a fixed delay.  Delay is constant, so
nothing is reordered.  ARP is never dropped (neighbour discovery is not under test).

Details that keep it honest:

- The sockets use PACKET_VNET_HDR: a veth hands over TCP segments as large GSO frames
  with checksums left to the hardware; the virtio header carries both facts through
  userspace, so the kernel segments and checksums them on the way out.  Loss therefore
  hits a whole GSO frame (one send of up to 64 KiB) at a time; handshakes, resets and
  small messages are one frame each.
- ``drop_rst_from``: the IPv4 addresses whose TCP resets never arrive (every RST they
  send is dropped), to make "a listener whose reset never arrives" deterministic.
- ``impair(i, loss, delay_ms)`` changes one host's link while traffic flows (the goodput
  soak's lossy-link fault): every frame from or to that host's port gets that loss and
  delay on top of the network's own; ``impair(i)`` heals it.  The forwarder reads the change
  within 0.2 s.  The queue is ordered by due time, so a frame to a slow link never holds up
  the others; one link's frames keep their order (one delay per link).
- The forwarder ends itself after ``max_seconds`` and when its parent (the test)
  goes away; the context manager kills it and deletes every namespace in ``finally``.
  All traffic stays inside namespaces made here.

Use (an installed part of hpct, for the tests and benchmarks/)::

    from hpct.testing.lossy import lossy_network

    with lossy_network(4, loss=0.05, delay_ms=20) as net:
        net.nodes[0].address           # "10.232.0.1"
        net.stats()                    # {"forwarded": ..., "dropped": ..., ...}
        net.impair(2, loss=0.05, delay_ms=20)     # host 2's link only, until net.impair(2)
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from hpct.testing.netns import Namespace, hub_and_hosts

FORWARDER = str(Path(__file__).resolve())
READY_TIMEOUT_S = 20.0


@dataclass
class LossyNetwork:
    nodes: list[Namespace]
    hub: str
    loss: float
    delay_ms: float
    _proc: subprocess.Popen | None = None
    _stats_path: str = ""
    _log: list[str] = field(default_factory=list)
    _control_path: str = ""
    _impaired: dict = field(default_factory=dict)

    def impair(self, node: int, loss: float = 0.0, delay_ms: float = 0.0) -> None:
        """Loss and delay on host ``node``'s link alone (both directions); zeros heal it."""
        _check(loss, delay_ms)
        if loss or delay_ms:
            self._impaired[str(node)] = [loss, delay_ms]
        else:
            self._impaired.pop(str(node), None)
        tmp = self._control_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"ports": self._impaired}, f)
        os.replace(tmp, self._control_path)

    def stats(self) -> dict:
        """Counters of the forwarder so far (it rewrites them about every 0.2 s)."""
        try:
            with open(self._stats_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def forwarder_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None


@contextlib.contextmanager
def lossy_network(count: int, *, loss: float = 0.0, delay_ms: float = 0.0,
                  drop_rst_from: Sequence[int] = (), seed: int | None = None,
                  name_prefix: str = "hpct-lossy", subnet: str = "10.232.0",
                  max_seconds: float = 900.0) -> Iterator[LossyNetwork]:
    """``count`` host namespaces joined by a lossy, delaying userspace switch.

    ``loss`` is the probability that one IPv4 frame is dropped (each direction, each
    frame on its own); ``delay_ms`` is added to every frame (one way: a round trip
    between two hosts takes twice that).  ``drop_rst_from`` lists host indices whose
    TCP resets are all dropped.
    """
    _check(loss, delay_ms)
    with hub_and_hosts(count, name_prefix, subnet) as (hub, nodes):
        proc = None
        stats_path, control_path = f"/tmp/{hub}.stats.json", f"/tmp/{hub}.control.json"
        try:
            ports = [f"h{i}" for i in range(len(nodes))]
            argv = ["ip", "netns", "exec", hub, sys.executable, FORWARDER,
                    "--ports", ",".join(ports), "--loss", repr(loss), "--delay-ms", repr(delay_ms),
                    "--stats", stats_path, "--control", control_path, "--max-seconds", repr(max_seconds),
                    "--parent", str(os.getpid())]
            if drop_rst_from:
                argv += ["--drop-rst-from", ",".join(nodes[i].address for i in drop_rst_from)]
            if seed is not None:
                argv += ["--seed", str(seed)]
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, text=True, cwd="/")
            _wait_ready(proc)
            yield LossyNetwork(nodes, hub, loss, delay_ms, proc, stats_path, _control_path=control_path)
        finally:
            # The forwarder goes before its namespaces (hub_and_hosts deletes them).
            if proc is not None and proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.communicate(timeout=10)
            for path in (stats_path, control_path):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def _check(loss: float, delay_ms: float) -> None:
    if not 0.0 <= loss < 1.0:
        raise ValueError(f"loss={loss}: a probability in [0, 1)")
    if not 0.0 <= delay_ms <= 10_000:
        raise ValueError(f"delay_ms={delay_ms}: between 0 and 10000")


def _wait_ready(proc: subprocess.Popen) -> None:
    import select
    deadline = time.monotonic() + READY_TIMEOUT_S
    line = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line.strip() == "ready":
                return
            if not line:
                break
    proc.kill()
    _, err = proc.communicate(timeout=10)
    raise RuntimeError(f"the lossy-link forwarder did not start ({line.strip()!r}): {err.strip()}")


# ---- the forwarder (runs inside the hub namespace) ----------------------------------------

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
VNET_HDR_LEN = 10          # struct virtio_net_hdr (no num_buffers)
ETH_HDR_LEN = 14


def _is_rst_from(frame: bytes, sources: set[bytes]) -> bool:
    """True for an IPv4 TCP segment with RST set whose source address is in ``sources``."""
    if len(frame) < ETH_HDR_LEN + 20 or frame[12:14] != b"\x08\x00":
        return False
    ip = frame[ETH_HDR_LEN:]
    if ip[9] != 6 or ip[12:16] not in sources:
        return False
    ihl = (ip[0] & 0x0F) * 4
    return len(ip) >= ihl + 14 and bool(ip[ihl + 13] & 0x04)


def _read_control(path: str, seen: int) -> tuple[int, dict[int, tuple[float, float]] | None]:
    """(mtime, {port: (loss, delay s)}) when ``path`` changed since ``seen``, else (seen, None)."""
    try:
        mtime = os.stat(path).st_mtime_ns
        if mtime == seen:
            return seen, None
        with open(path) as f:
            ports = json.load(f)["ports"]
    except (OSError, ValueError, KeyError):
        return seen, None
    return mtime, {int(p): (float(v[0]), float(v[1]) / 1000.0) for p, v in ports.items()}


def forward(ports: list[str], loss: float, delay_s: float, stats_path: str, max_seconds: float,
            parent: int, drop_rst_from: list[str], seed: int | None, control_path: str = "") -> int:
    import heapq
    import itertools
    import random
    import select
    import socket

    rng = random.Random(seed)
    rst_sources = {socket.inet_aton(a) for a in drop_rst_from}
    socks = []
    for name in ports:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        s.bind((name, 0))
        s.setblocking(False)
        socks.append(s)
    by_fd = {s.fileno(): i for i, s in enumerate(socks)}
    mac_port: dict[bytes, int] = {}
    queue: list = []        # heap of (due, sequence, out port indices, bytes)
    order = itertools.count()
    impaired: dict[int, tuple[float, float]] = {}        # port -> (loss, delay s) of its link alone
    control_seen = 0
    counts = {"forwarded": 0, "dropped": 0, "rst_dropped": 0, "flooded": 0, "send_errors": 0}
    poller = select.poll()
    for s in socks:
        poller.register(s, select.POLLIN)
    print("ready", flush=True)
    end = time.monotonic() + max_seconds
    next_stats = 0.0
    while True:
        now = time.monotonic()
        if now >= end:
            return 0
        if now >= next_stats:
            if parent > 0 and not _alive(parent):
                return 0
            tmp = stats_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(dict(counts, queued=len(queue)), f)
            os.replace(tmp, stats_path)
            next_stats = now + 0.2
            if control_path:
                control_seen, changed = _read_control(control_path, control_seen)
                impaired = impaired if changed is None else changed
        while queue and queue[0][0] <= now:
            _, _, outs, data = heapq.heappop(queue)
            for o in outs:
                try:
                    socks[o].send(data)
                    counts["forwarded"] += 1
                except OSError:
                    counts["send_errors"] += 1
        wait = 0.2 if not queue else max(0.0, queue[0][0] - now)
        for fd, _ in poller.poll(min(wait, next_stats - now, 0.2) * 1000.0):
            port = by_fd[fd]
            s = socks[port]
            for _ in range(64):
                try:
                    data = s.recv(65536 + VNET_HDR_LEN + ETH_HDR_LEN + 64)
                except BlockingIOError:
                    break
                frame = data[VNET_HDR_LEN:]
                if len(frame) < ETH_HDR_LEN:
                    continue
                mac_port[frame[6:12]] = port
                if rst_sources and _is_rst_from(frame, rst_sources):
                    counts["rst_dropped"] += 1
                    continue
                dst = mac_port.get(frame[0:6])
                flood = dst is None or frame[0] & 1
                if not flood and dst == port:
                    continue
                p_loss, delay = loss, delay_s
                for link in () if flood or not impaired else (port, dst):
                    if link in impaired:
                        p_loss, delay = 1 - (1 - p_loss) * (1 - impaired[link][0]), delay + impaired[link][1]
                if p_loss and frame[12:14] == b"\x08\x00" and rng.random() < p_loss:
                    counts["dropped"] += 1
                    continue
                if flood:
                    outs = [i for i in range(len(socks)) if i != port]
                    counts["flooded"] += 1
                else:
                    outs = [dst]
                heapq.heappush(queue, (time.monotonic() + delay, next(order), outs, data))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="lossy, delaying userspace switch (run inside a hub netns)")
    ap.add_argument("--ports", required=True, help="comma list of interfaces to switch between")
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--stats", required=True)
    ap.add_argument("--control", default="", help="JSON file of per-port impairments, re-read when it changes")
    ap.add_argument("--max-seconds", type=float, default=900.0)
    ap.add_argument("--parent", type=int, default=0)
    ap.add_argument("--drop-rst-from", default="")
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args(argv)
    return forward(a.ports.split(","), a.loss, a.delay_ms / 1000.0, a.stats, a.max_seconds,
                   a.parent, [x for x in a.drop_rst_from.split(",") if x], a.seed, a.control)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
