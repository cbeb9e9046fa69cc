"""Helpers for the multi-process hpct._gloo tests: ports, workers, results.

Ports come from the port plan (``hpct.ports``) with a block base found by
probing: a run of free ports well below the ephemeral range (and far from
29500), chosen per test so that tests and parallel runs do not collide.
Every worker process is bounded by a timeout and killed if it overstays.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from hpct.ports import free_port_block, peer_table

WORKER = str(Path(__file__).resolve().parent / "gloo_worker.py")

_used: set[int] = set()


def free_block(count: int, host: str = "127.0.0.1") -> int:
    """A base B such that B..B+count-1 are all bindable now (and not handed out before)."""
    base = free_port_block(count, host=host, avoid=_used)      # the range: hpct.ports (per xdist worker)
    _used.update(range(base, base + count))
    return base


def loopback_peers(size: int, group: int = 0, slots: int = 1, base: int | None = None,
                   nproc_per_node: int | None = None) -> list[tuple[str, int]]:
    """Peer table of a single-node job on 127.0.0.1 from the port plan."""
    p = nproc_per_node or size
    base = free_block(slots * p) if base is None else base
    return peer_table(["127.0.0.1"], base, group, size, p, slots)


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen
    started: float
    timeout: float
    out: str = ""
    err: str = ""
    events: list[dict] = field(default_factory=list)
    _partial: str = ""

    def wait(self) -> "Worker":
        remaining = max(0.1, self.started + self.timeout - time.monotonic())
        try:
            out, self.err = self.proc.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, self.err = self.proc.communicate(timeout=10)
            self.err += f"\n[worker rank {self.rank} killed after {self.timeout} s timeout]"
        self.out += self._partial + (out or "")
        self._partial = ""
        self.events = [json.loads(line) for line in self.out.splitlines() if line.startswith("{")]
        return self

    def read_event(self, name: str, timeout: float) -> dict:
        """Read stdout until an event called ``name`` arrives (raw reads: no hidden buffering)."""
        import select
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while "\n" in self._partial:
                line, self._partial = self._partial.split("\n", 1)
                self.out += line + "\n"
                if line.startswith("{") and json.loads(line)["event"] == name:
                    return json.loads(line)
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            self._partial += chunk.decode()
        raise AssertionError(f"rank {self.rank}: no {name!r} event within {timeout} s; output so far:\n{self.out}")

    def event(self, name: str) -> dict:
        found = [e for e in self.events if e["event"] == name]
        assert found, f"rank {self.rank}: no {name!r} event\nstdout:\n{self.out}\nstderr:\n{self.err}"
        return found[-1]

    def describe(self) -> str:
        return (f"rank {self.rank} exit={self.proc.returncode}\nstdout:\n{self.out}\n"
                f"stderr:\n{self.err[-3000:]}")


def start_worker(spec: dict, timeout: float = 60.0, argv_prefix: Sequence[str] = (),
                 env: dict | None = None, stdin: bool = False) -> Worker:
    argv = [*argv_prefix, sys.executable, WORKER, json.dumps(spec)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, cwd="/",
                            env={**os.environ, **(env or {})}, bufsize=1)
    return Worker(spec["rank"], proc, time.monotonic(), timeout)


def run_group(size: int, script: list[dict], *, generation: int = 1,
              peers: list[tuple[str, int]] | None = None, timeout: float = 60.0,
              connect_timeout: float = 30.0, op_timeout: float = 30.0,
              per_rank: dict[int, dict] | None = None, skip: Sequence[int] = ()) -> list[Worker]:
    """Start one worker per rank (except ``skip``), wait for all, return them."""
    peers = peers or loopback_peers(size)
    workers = []
    for r in range(size):
        if r in skip:
            continue
        spec = {"rank": r, "size": size, "generation": generation, "peers": peers,
                "timeout": op_timeout, "connect_timeout": connect_timeout, "script": script}
        spec.update((per_rank or {}).get(r, {}))
        workers.append(start_worker(spec, timeout=timeout))
    return [w.wait() for w in workers]


def kill_all(workers: Sequence[Worker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            try:
                os.kill(w.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            w.proc.kill()
            try:
                w.proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass


def wait_all_succeeded(workers: Sequence[Worker]) -> Sequence[Worker]:
    """Wait for every worker (killing the rest on any failure); each must exit 0."""
    try:
        for w in workers:
            w.wait()
    finally:
        kill_all(workers)
    for w in workers:
        assert w.proc.returncode == 0, w.describe()
    return workers
