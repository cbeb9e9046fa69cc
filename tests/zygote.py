"""A fork server for the suite's rank processes: torch is imported once, not once per rank.

A fresh interpreter spends about 3 CPU-seconds importing torch; the serial tier starts hundreds
of ranks, and on 2 cores that import was most of its CPU.  ``launch()`` hands an argv of the form
``python [-u] [-P] SCRIPT ARGS`` or ``python [-u] [-P] -m MODULE ARGS`` to a server process
(tests/zygote_server.py, on the loop of hpct/launch/forkserver.py) that has imported torch and
torch.distributed (not hpct.distributed: hpct reads its variables when the rank imports it, after
the fork; the server's loop reads none).  The server forks; the child takes the
rank's environment, folder, session and log, runs the script as ``__main__`` and leaves through
the interpreter's own exit (threads joined, atexit, finalisation), as a spawned rank would.

What it proves, and what it does not: a forked rank runs the same hpct and torch code from the
same state a fresh one reaches after ``import torch``.  Process start itself (the import, the
interpreter's flags, variables torch reads while importing) is what `hpct demo`, `hpct run`
and the launch tests exercise on the real path.  An argv or environment the server cannot
reproduce (another interpreter, other flags, PYTHON*, LD_*, OMP_*, MKL_*, TORCH_*, CUDA_*
variables unlike its own) is exec'd by the child instead: slower, never different.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from pathlib import Path

SERVER = str(Path(__file__).with_name("zygote_server.py"))
START_S = 240.0           # the server imports torch once; a loaded 2-core machine takes seconds
# Read by the interpreter or torch while they start: a child whose values differ is exec'd.
START_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "TORCH_", "CUDA_", "GLIBC_", "MALLOC_")


def start_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(START_PREFIXES)}


class Forked:
    """A rank the server forked: what the suite uses of a Popen (pid, poll, wait, kill, signals;
    stdin and stdout once ``attach`` has its socket)."""

    def __init__(self, ident: int, argv: list[str]):
        self.ident, self.args, self.pid, self.returncode = ident, argv, None, None
        self.stdin = self.stdout = None
        self.started, self.ended, self.connected = threading.Event(), threading.Event(), threading.Event()

    def attach(self, conn: socket.socket) -> None:
        self.stdout = conn.makefile("r", encoding="utf-8")
        self.stdin = conn.makefile("w", encoding="utf-8")
        self.connected.set()

    def poll(self):
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """A server, started at the first launch, gone with this process (or ``close``).  ``popen``
    starts it elsewhere (a network namespace's ``Namespace.popen``); ``log`` takes its stderr."""

    def __init__(self, popen=subprocess.Popen, log: Path | None = None):
        self.popen, self.log = popen, log
        self.lock = threading.Lock()
        self.server: subprocess.Popen | None = None
        self.children: dict[int, Forked] = {}
        self.env: dict = {}
        self.reported = 0.0          # CPU of this server's ended ranks, until it is reaped
        _ALL.add(self)

    def _server(self, env: dict) -> subprocess.Popen:
        if self.server is None or self.server.poll() is not None:
            # The ranks' start-time variables (OMP_NUM_THREADS=1, say) are the server's.
            self.env = {k: v for k, v in os.environ.items() if not k.startswith(START_PREFIXES)}
            self.env.update(start_env(env))
            with open(self.log, "w") if self.log else contextlib.nullcontext() as err:
                self.server = self.popen([sys.executable, "-P", SERVER], env=self.env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
            threading.Thread(target=self._events, args=(self.server,), daemon=True).start()
            atexit.register(self.close)
        return self.server

    def _events(self, server: subprocess.Popen) -> None:
        for line in server.stdout:
            ev = json.loads(line)
            child = self.children.get(ev.get("id"))
            if child is None:
                continue
            if ev["ev"] == "forked":
                child.pid = ev["pid"]
                child.started.set()
            elif ev["ev"] == "exited":
                self.reported += ev.get("cpu", 0.0)     # one events thread per server writes it
                child.returncode = ev["code"]
                child.ended.set()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=10)
        self._reaped(server)
        for child in self.children.values():     # the server is gone: PR_SET_PDEATHSIG killed the rest
            if not child.ended.is_set():
                child.returncode = -signal.SIGKILL
                child.started.set()
                child.ended.set()

    def launch(self, argv: list[str], env: dict, log: Path, cwd: str, *, sock: str | None = None,
               wait: bool = True) -> Forked:
        """``argv`` forked (or exec'd) with ``env`` in ``cwd``, its output in ``log``; with ``sock``
        its stdin and stdout are a connection to that Unix socket, which it opens with its id.
        ``wait``: return once its pid is known (else ``started`` says when)."""
        with self.lock:
            server = self._server(env)
            exec_it = start_env(env) != start_env(self.env)
            child = Forked(next(IDS), list(argv))
            self.children[child.ident] = child
            server.stdin.write(json.dumps({"id": child.ident, "argv": list(argv), "env": env, "log": str(log),
                                           "cwd": cwd, "exec": exec_it, "socket": sock}) + "\n")
            server.stdin.flush()
        if not wait:
            return child
        if not child.started.wait(START_S):
            raise RuntimeError(f"the fork server (tests/zygote_server.py) forked nothing within {START_S:g} s")
        if child.pid is None:
            raise RuntimeError(f"the fork server exited before it forked {argv}")
        return child

    def _reaped(self, server: subprocess.Popen) -> None:
        """The server was waited for: its ranks' CPU is in RUSAGE_CHILDREN now, not to be counted twice."""
        if server.returncode is not None:
            self.reported = 0.0

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.stdin.close()           # it exits; PR_SET_PDEATHSIG takes any child left
            try:
                self.server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(timeout=10)
        if self.server is not None:
            self._reaped(self.server)


def children_cpu() -> float:
    """CPU seconds of every forked rank that has ended so far, its children's included, while
    its server is not yet reaped (the suite's profile, tests/conftest.py, adds them to pytest's
    own children's, which take them over once a server is waited for)."""
    return sum(z.reported for z in list(_ALL))


_ALL: weakref.WeakSet = weakref.WeakSet()
IDS = itertools.count()         # unique across servers: one listening socket may serve several
ZYGOTE = Zygote()
