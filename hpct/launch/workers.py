"""One node's worker processes: start (fresh, or by handing a warm standby its orders), poll,
stop gracefully, and the last lines of a worker's log for the message that ends a job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .forkserver import FORK_TIMEOUT_S


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


# A worker its peers wait for, seen stopped by a signal this long, is taken for hung without
# waiting out its op timeout: it runs no code until someone continues it (no_show_bound).
STOPPED_NO_SHOW_S = 1.0
STOPPED_CHECK_S = 0.25     # how often an agent reads its workers' states (note_stopped)
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
                     else f"did not fork it within {FORK_TIMEOUT_S:g} s")
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


def re_form_bound(w: Worker, default_s: float) -> float:
    """How long after a view move that broke its world a worker may stay silent: its op timeout,
    if it told one, else ``default_s``."""
    return w.op_timeout or default_s


def silent(w: Worker, generation: int, broke_at: float | None) -> bool:
    """Whether ``w`` has not come to re-form after the view's last move that broke its world (at
    ``broke_at``, monotonic): its world formed before ``generation`` and it has not asked the
    agent anything since."""
    return (broke_at is not None and w.joined and not w.reaped and w.formed < generation
            and w.watched < broke_at and w.proc.poll() is None)


def process_state(pid: int) -> bytes | None:
    """A process's state letter in /proc/PID/stat (R, S, T, Z ...), or None: gone, or no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:][:1]


def is_stopped(pid: int) -> bool:
    """Whether a process is stopped by a signal (SIGSTOP, SIGTSTP: state T in /proc/PID/stat).  One
    stopped by a tracer (t: a debugger, py-spy) is being looked at on purpose and is not.  Gone, or
    no /proc: not stopped, and the op timeout bound holds."""
    return process_state(pid) == b"T"


def note_stopped(workers, now: float, probe=is_stopped) -> None:
    """Track since when each running worker is seen stopped by a signal (None: running)."""
    for w in workers:
        stopped = not w.reaped and w.proc.poll() is None and probe(w.proc.pid)
        w.stopped_since = (now if w.stopped_since is None else w.stopped_since) if stopped else None


def stopped_past(workers, now: float, grace: float) -> list[Worker]:
    """The workers seen stopped for ``grace`` seconds (0: none ever is).  Each collective of the
    job waits on such a worker, and it runs nothing until someone continues it: waiting for its
    peers' op timeout (then for their re-form) only lengthens the stall a replacement ends."""
    return [w for w in workers if grace > 0 and not w.reaped and w.stopped_since is not None
            and now - w.stopped_since >= grace]


def stopped_long(w: Worker, now: float) -> bool:
    """Whether ``w`` has been seen stopped (``note_stopped``) for STOPPED_NO_SHOW_S."""
    return w.stopped_since is not None and now - w.stopped_since >= STOPPED_NO_SHOW_S


def no_show_bound(w: Worker, now: float, default_s: float) -> float:
    """How long after the breaking move a silent worker is waited for: STOPPED_NO_SHOW_S once it
    is ``stopped_long`` (its peers' collectives already timed out on it, and it cannot come before
    someone continues it), else its op timeout (``re_form_bound``)."""
    return STOPPED_NO_SHOW_S if stopped_long(w, now) else re_form_bound(w, default_s)


def no_shows(workers, generation: int, broke_at: float | None, now: float, default_s: float) -> list[Worker]:
    """The silent workers (``silent``) past their bound (``no_show_bound``).  Such a worker is hung
    (stopped, deadlocked): its peers would wait for it until their connect deadline and then fail,
    over and over, while it never exits.  A worker busy past its op timeout would have failed its
    peers' collectives already, so that bound is the user's own."""
    return [w for w in workers if silent(w, generation, broke_at)
            and now - broke_at > no_show_bound(w, now, default_s)]


def stranded(w: Worker) -> str | None:
    """Why ``w``'s next world can no longer form once a rank of the job finished (a finished rank
    never comes to re-form; it left only after every rank had taken the last step), or None: a
    newcomer (grow, spare, replacement) that has not joined, or a worker that re-forms after its
    world failed."""
    if not w.joined:
        return "before it joined" if w.generation > 0 else None
    return "while it re-formed" if w.re_forming else None


def stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM each process group, SIGKILL what is left after ``grace`` seconds, reap all."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            return
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end and any(p.poll() is None for p in alive):
            time.sleep(0.02)


def tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])
