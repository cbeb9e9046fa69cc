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
    started: float = field(default_factory=time.monotonic)
    joined: bool = False         # its world group formed (it told the agent)


class Pool:
    """Starts workers and keeps ``size`` warm standbys ready."""

    def __init__(self, command: tuple[str, ...], python_script: bool, log_dir: Path, size: int,
                 base_env: dict[str, str], on_ready=None) -> None:
        self.command, self.python_script, self.log_dir = command, python_script, log_dir
        self.size, self.base_env, self.on_ready = size, base_env, on_ready
        self.standbys: list[subprocess.Popen] = []
        self.ready: set[int] = set()
        self.lock = threading.Lock()
        log_dir.mkdir(parents=True, exist_ok=True)

    def fill(self) -> None:
        with self.lock:
            self.standbys = [p for p in self.standbys if p.poll() is None]
            missing = self.size - len(self.standbys)
        for _ in range(missing):
            p = subprocess.Popen([sys.executable, "-m", "hpct.launch.standby"], env=self.base_env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=open(self.log_dir / "standby.log", "a"), start_new_session=True,
                                 cwd=os.getcwd())
            with self.lock:
                self.standbys.append(p)
            threading.Thread(target=self._await_ready, args=(p,), daemon=True).start()

    def _await_ready(self, p: subprocess.Popen) -> None:
        if p.stdout.readline().strip() == b"ready":
            with self.lock:
                self.ready.add(p.pid)
            if self.on_ready:
                self.on_ready(p.pid)

    def _take_standby(self) -> subprocess.Popen | None:
        with self.lock:
            for p in self.standbys:
                if p.pid in self.ready and p.poll() is None:
                    self.standbys.remove(p)
                    return p
        return None

    def start(self, place: int, local_rank: int, rank: int, generation: int, env: dict[str, str],
              warm_ok: bool) -> Worker:
        log = self.log_dir / f"rank{place}-g{generation}.log"
        standby = self._take_standby() if warm_ok and self.python_script else None
        if standby is not None:
            order = {"argv": list(self.command), "env": env, "cwd": os.getcwd(), "log": str(log)}
            standby.stdin.write(json.dumps(order).encode() + b"\n")
            standby.stdin.close()
            standby.stdout.close()
            return Worker(place, local_rank, rank, generation, standby, log, warm=True)
        argv = list(self.command) if not self.python_script else [sys.executable, *self.command]
        with open(log, "w") as out:
            try:
                proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as err:      # --no-python with a program that cannot run
                out.write(f"hpct run: cannot start {argv[0]}: {err}\n")
                proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(127)"])
        return Worker(place, local_rank, rank, generation, proc, log, warm=False)

    def close(self) -> None:
        with self.lock:
            standbys, self.standbys = self.standbys, []
        for p in standbys:
            stop([p], 0.0)


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
