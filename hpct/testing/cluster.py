"""Agents of `hpct run` for tests and benchmarks: on this machine, or one per network namespace.

Each agent writes its event log as JSON lines (``--json``); the helpers here read those logs
to wait for events and to find every worker's pid, and kill everything still running at the
end, agents and workers (which run in sessions of their own).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RUN = "import sys; from hpct.cli import main; sys.exit(main())"
# -P: as the `hpct` console script, the agent imports the installed package, never the working folder's.
PY = [sys.executable, "-P"] if sys.version_info >= (3, 11) else [sys.executable]


class Agents:
    def __init__(self, tmp: Path, args: list[str], nodes: int = 1, namespaces=None,
                 node_args=None, env: dict | None = None) -> None:
        self.tmp, self.args, self.nodes = tmp, args, nodes
        self.namespaces = namespaces
        self.node_args = node_args or [[] for _ in range(nodes)]
        self.env = {**os.environ, **(env or {})}
        self.procs: list[subprocess.Popen] = []
        self.lives = [0] * nodes         # agents started per node: a restarted agent logs anew

    def json_path(self, node: int, life: int = 0) -> Path:
        return self.tmp / f"events-{node}{f'-{life}' if life else ''}.jsonl"

    def err_path(self, node: int, life: int = 0) -> Path:
        return self.tmp / f"agent-{node}{f'-{life}' if life else ''}.err"

    def start(self) -> "Agents":
        for n in range(self.nodes):
            self.procs.append(self._spawn(n))
        return self

    def restart(self, node: int) -> subprocess.Popen:
        """Start node ``node``'s agent again (its first one is gone), as a node that comes back."""
        self.lives[node] += 1
        self.procs[node] = self._spawn(node)
        return self.procs[node]

    def _spawn(self, n: int) -> subprocess.Popen:
        life = self.lives[n]
        argv = [*PY, "-c", RUN, "run", "--json", str(self.json_path(n, life)),
                "--log-dir", str(self.tmp / "logs"), *self.node_args[n], *self.args]
        err = open(self.err_path(n, life), "w")
        if self.namespaces:
            p = self.namespaces[n].popen(argv, env=self.env, stdout=err, stderr=subprocess.STDOUT,
                                         cwd=str(self.tmp))
        else:
            p = subprocess.Popen(argv, env=self.env, stdout=err, stderr=subprocess.STDOUT, cwd=str(self.tmp))
        err.close()
        return p

    def events(self, node: int, kind: str | None = None) -> list[dict]:
        docs = []
        for life in range(self.lives[node] + 1):
            try:
                lines = self.json_path(node, life).read_text().splitlines()
            except FileNotFoundError:
                continue
            docs += [d for d in parse_lines(lines) if kind is None or d["event"] == kind]
        return docs

    def output(self, node: int) -> str:
        return "".join(self.err_path(node, life).read_text() for life in range(self.lives[node] + 1)
                       if self.err_path(node, life).exists())

    def wait_event(self, node: int, kind: str, timeout: float, count: int = 1, where=None) -> list[dict]:
        end = time.monotonic() + timeout
        while True:
            found = [e for e in self.events(node, kind) if where is None or where(e)]
            if len(found) >= count:
                return found
            if time.monotonic() > end:
                raise TimeoutError(f"node {node}: no {count} {kind!r} event(s) within {timeout:g} s:\n"
                                   f"{self.output(node)[-3000:]}")
            time.sleep(0.02)

    def worker_pid(self, node: int, rank: int) -> int:
        starts = [e for e in self.events(node, "start") if e["rank"] == rank]
        return starts[-1]["pid"]

    def wait(self, timeout: float) -> list[int]:
        end = time.monotonic() + timeout
        codes = []
        try:
            for n, p in enumerate(self.procs):
                try:
                    codes.append(p.wait(timeout=max(0.1, end - time.monotonic())))
                except subprocess.TimeoutExpired:
                    raise TimeoutError(f"agent {n} still running after {timeout:g} s:\n"
                                       f"{self.output(n)[-3000:]}") from None
        finally:
            self.stop()
        return codes

    def all_pids(self) -> set[int]:
        return {e["pid"] for n in range(self.nodes) for e in self.events(n)
                if e["event"] in ("start", "standby") and "pid" in e}

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for pid in self.all_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def __enter__(self) -> "Agents":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def parse_lines(lines: list[str]) -> list[dict]:
    """JSON lines of a log another process is still writing: a torn last line is left for later."""
    docs = []
    for line in lines:
        try:
            docs.append(json.loads(line))
        except ValueError:
            break
    return docs


def progress(out: Path, rank: int) -> int:
    """Steps ``rank`` has completed, as examples/ddp.py writes them (0 before the first, or torn)."""
    try:
        return int((out / f"progress-{rank}").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def records(out: Path) -> list[dict]:
    """examples/ddp.py's per-process records."""
    return [json.loads(f.read_text()) for f in sorted(out.glob("rank*-pid*.json"))]
