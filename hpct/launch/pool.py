"""One node's pool of worker processes: a worker started fresh, forked from the node's fork server
or handed to a warm standby (its orders on stdin), the standbys kept ready and when they may
start.  The health rules are health.py's, the process plumbing procs.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .procs import stop, tail


@dataclass
class Worker:
    """The process holding one plan place of this node now."""

    place: int                   # place in the port plan: node * nproc_per_node + local rank
    local_rank: int
    rank: int
    generation: int
    proc: subprocess.Popen
    log: Path
    warm: bool                   # started from a standby
    why: str = ""                # how it started: from a warm standby, or cold and why
    started: float = field(default_factory=time.monotonic)
    joined: bool = False         # its world group formed (it told the agent)
    watched: float = 0.0         # when it last asked the agent's view while connecting (monotonic)
    formed: int = -1             # the generation its world last formed in (it told the agent)
    re_forming: bool = False     # it asked for a new world (recover()) and has not formed one since
    op_timeout: float | None = None   # its world's op timeout, seconds (it told the agent)
    reaped: bool = False         # killed as a no-show: its exit is the loss that replaces it
    stopped_since: float | None = None   # seen stopped by a signal since (monotonic): note_stopped


STANDBY_DEFER_S = 30.0     # a node's standbys start at the latest this long after its workers (standbys_due)
# A standby imports the interpreter's own packages, as the agent did: ``-m`` would put the working
# folder first on sys.path, and a source checkout of hpct there (an ``hpct/`` folder without the
# compiled extension) then shadowed the installed package and the standby died at its import.
STANDBY_ARGV = ("-c", "import sys; del sys.path[0]; from hpct.launch.standby import main; sys.exit(main())")
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 30.0     # between standbys that failed to warm or died waiting


class Pool:
    """Starts workers and keeps ``size`` warm standbys ready; a standby that exits before it is
    taken is reported (``on_failed``, with its log's last lines) and replaced after a backoff."""

    def __init__(self, command: tuple[str, ...], python_script: bool, log_dir: Path, size: int,
                 base_env: dict[str, str], on_ready=None, on_failed=None) -> None:
        self.command, self.python_script, self.log_dir = command, python_script, log_dir
        self.size, self.base_env, self.on_ready, self.on_failed = size, base_env, on_ready, on_failed
        self.standbys: list[subprocess.Popen] = []
        self.ready: set[int] = set()
        self.logs: dict[int, Path] = {}
        self.started = 0
        self.last_failure: str | None = None
        self.backoff, self.next_try = 0.0, 0.0
        self.forks = None           # the node's fork server (forkserver.py), unless --no-fork-server
        self.lock = threading.Lock()
        log_dir.mkdir(parents=True, exist_ok=True)

    def fill(self) -> None:
        """Reap standbys that died (reported), then start the missing ones unless backing off."""
        with self.lock:
            dead = [p for p in self.standbys if p.poll() is not None]
            self.standbys = [p for p in self.standbys if p.poll() is None]
        for p in dead:
            self._failed(p, "exited while waiting" if p.pid in self.ready else "exited before it was warm")
        with self.lock:
            if time.monotonic() < self.next_try:
                return
            missing = self.wanted() - len(self.standbys)
        for _ in range(missing):
            self.started += 1
            log = self.log_dir / f"standby-{self.started}.log"
            p = subprocess.Popen([sys.executable, *STANDBY_ARGV], env=self.base_env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=open(log, "w"), start_new_session=True, cwd=os.getcwd())
            with self.lock:
                self.standbys.append(p)
                self.logs[p.pid] = log
            threading.Thread(target=self._await_ready, args=(p,), daemon=True).start()

    def wanted(self) -> int:
        """Standbys to keep: none while the node's fork server lives, since a forked replacement is
        as warm and a standby's own import of torch took cores from the training after every
        fault (the goodput soak); ``size`` once it has ended."""
        return 0 if self.forks is not None and self.forks.alive() else self.size

    def _await_ready(self, p: subprocess.Popen) -> None:
        if p.stdout.readline().strip() == b"ready":
            with self.lock:
                self.ready.add(p.pid)
                self.backoff = 0.0
            if self.on_ready:
                self.on_ready(p.pid)
            return
        try:
            p.wait(10.0)
        except subprocess.TimeoutExpired:         # closed its output yet lives on: not a standby
            stop([p], 0.0)
        with self.lock:
            if p not in self.standbys:            # reaped by fill() already, and reported there
                return
            self.standbys.remove(p)
        self._failed(p, "exited before it was warm")

    def _failed(self, p: subprocess.Popen, what: str) -> None:
        code = p.returncode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit {code}"
        with self.lock:
            self.ready.discard(p.pid)
            log = self.logs.pop(p.pid, self.log_dir / "standby.log")
            self.backoff = min(max(self.backoff * 2, BACKOFF_FIRST_S), BACKOFF_MAX_S)
            self.next_try = time.monotonic() + self.backoff
            self.last_failure = f"standby pid {p.pid} {what} ({how})"
            backoff = self.backoff
        if self.on_failed:
            self.on_failed(p.pid, f"{what} ({how}); the next one in {backoff:g} s; its log {log}:\n"
                                  f"{tail(log, 10)}", code=code, log=str(log), retry_s=backoff)

    def _take_standby(self) -> subprocess.Popen | None:
        with self.lock:
            for p in self.standbys:
                if p.pid in self.ready and p.poll() is None:
                    self.standbys.remove(p)
                    return p
        return None

    def _cold_why(self, warm_ok: bool) -> str:
        if self.forks is not None:
            f = self.forks
            state = ("ended" if not f.alive() else "is not ready" if not f.ready.is_set()
                     else f"did not fork it within {f.fork_timeout_s:g} s")
            return f"cold: the fork server pid {f.proc.pid} {state} (its log {f.log})"
        if not warm_ok:
            return "cold: a first start (generation 0)"
        if not self.python_script:
            return "cold: the command is not a Python script (--no-python)"
        if self.size == 0:
            return "cold: no standby is kept (--standby 0)"
        with self.lock:
            waiting = len(self.standbys)
            failure = self.last_failure
        if not self.started:
            return "cold: no standby started yet (they start once this node's workers formed their world)"
        text = f"cold: no standby was ready ({waiting} warming up"
        return text + (f"; the last failed: {failure})" if failure else ")")

    def start(self, place: int, local_rank: int, rank: int, generation: int, env: dict[str, str],
              warm_ok: bool) -> Worker:
        log = self.log_dir / f"rank{place}-g{generation}.log"
        standby = self._take_standby() if warm_ok and self.python_script else None
        if standby is not None:
            order = {"argv": list(self.command), "env": env, "cwd": os.getcwd(), "log": str(log)}
            standby.stdin.write(json.dumps(order).encode() + b"\n")
            standby.stdin.close()
            standby.stdout.close()
            return Worker(place, local_rank, rank, generation, standby, log, warm=True,
                          why=f"warm: standby pid {standby.pid}")
        if self.forks is not None:
            proc = self.forks.fork(list(self.command), env, log)
            if proc is not None:
                return Worker(place, local_rank, rank, generation, proc, log, warm=False,
                              why=f"forked: from the fork server pid {self.forks.proc.pid}")
        why = self._cold_why(warm_ok)
        argv = list(self.command) if not self.python_script else [sys.executable, *self.command]
        with open(log, "w") as out:
            try:
                proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as err:      # --no-python with a program that cannot run
                out.write(f"hpct run: cannot start {argv[0]}: {err}\n")
                proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(127)"])
        return Worker(place, local_rank, rank, generation, proc, log, warm=False, why=why)

    def close(self) -> None:
        with self.lock:
            standbys, self.standbys = self.standbys, []
        for p in standbys:
            stop([p], 0.0)
        if self.forks is not None:
            self.forks.close()          # it ends after its last worker


def standbys_due(workers, started: float, now: float) -> bool:
    """Whether a node's standbys may start: once every worker its slot started with has formed its
    world, or STANDBY_DEFER_S after they started (a script that starts its world with torch's own
    init_process_group never tells).  A standby imports torch as the workers do; during their
    start it would only take cores and file-system reads from them.  A worker lost before its world
    formed starts cold; any replacement (generation above 0) is started and refilled at once."""
    return all(w.joined or w.generation > 0 for w in workers) or now - started > STANDBY_DEFER_S
