"""Process plumbing of a node's agent: a process's state from /proc, stopping process groups within
a bound, and the last lines of a log (the message that ends a job)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


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
