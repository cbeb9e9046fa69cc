"""A node's fork server (``hpct run``'s default for a Python script; ``--no-fork-server`` turns it
off): one process imports torch, and every worker of the node is forked from it.

A cold worker imports torch itself: 1.5-2 s of CPU each, and on a node of 8 workers 8 processes
reading the same files at once (a shared file system at the job's start reads them for every node).
The fork server pays that once per node (standby.py's ``_warm``) and forks a worker in
milliseconds; the child takes its session, log, folder and environment and runs the script
(standby.py's ``become``).

The server stays single-threaded (a fork copies no lock another thread holds) and is the
workers' parent: it reaps them and reports each exit.  Its protocol is JSON lines: orders
``{"id", "argv", "env", "cwd", "log"}`` on its stdin; ``{"ev": "ready"}``, then
``{"ev": "forked", "id", "pid"}`` and ``{"ev": "exited", "id", "pid", "code", "cpu"}`` (code: a
Popen's returncode, negative for a signal; cpu: the seconds the child and its own children used)
on its stdout.  It exits once its stdin ends and its last worker has, so
workers outlive a killed agent as spawned ones do.  A worker dies with the server
(PR_SET_PDEATHSIG): an exit nobody could report would leave a rank nobody replaces.

``ForkServer`` is the agent's side: it starts the server, forks through it, and hands out
``Forked`` handles that answer ``pid`` and ``poll()`` as a Popen does.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from .procs import process_state

PR_SET_PDEATHSIG = 1
REAP_S = 0.05               # how often the server reaps exited workers between orders
FORK_TIMEOUT_S = 10.0       # an order the server does not answer within this is refused (ForkServer's default)
SETTLE_S = 5.0              # a forked child has this long to take its own session before its pid goes out
SERVER_ARGV = ("-c", "import sys; del sys.path[0]; from hpct.launch.forkserver import serve; sys.exit(serve())")


def _emit(ev: str, **facts) -> None:
    os.write(1, (json.dumps({"ev": ev, **facts}) + "\n").encode())


def _child(order: dict, settled: int) -> None:
    """The forked worker; never returns to the server's loop.  It ends as an interpreter would (its
    non-daemon threads joined, atexit run, the error's traceback and exit code) but without the
    interpreter's finalisation: torch's state copied from the server (a thread pool whose threads
    the fork did not copy) made the garbage collection at finalisation spin for ever, as
    multiprocessing's forked children also end with os._exit."""
    import atexit
    import threading
    import traceback
    from .standby import become
    os.setsid()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.close(settled)           # the server now tells its pid: its session and process group exist
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(os.devnull)
    code = 0
    try:
        become(order)
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else _said(end.code))
    except BaseException:           # noqa: BLE001 - reported as the interpreter reports it
        traceback.print_exc()
        code = 1
    try:
        for t in threading.enumerate():
            if t is not threading.current_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code & 0xFF)


def _said(message) -> int:
    print(message, file=sys.stderr)     # sys.exit("text"): the text, and exit 1
    return 1


def serve() -> int:
    from .standby import _warm
    # A fork copies only the forking thread.  ``import torch`` leaves one native thread of its own,
    # idle on a condition variable (it holds no lock then), so forking stays safe as long as this
    # loop itself starts none; the children skip the finalisation that would wait for it (_child).
    # The server never asks CUDA anything: once a process has (torch.cuda.is_available(), even
    # device_count() where NVML is missing), torch marks every child it forks later as a bad fork,
    # whose first CUDA op raises "Cannot re-initialize CUDA in forked subprocess".  So it leaves
    # out hpct's backend, which asks as it registers; each worker imports it itself (30 ms).
    _warm(backend=False)
    _emit("ready")
    return serve_orders(_child)


def serve_orders(child: Callable[[dict, int], None], *, linger: bool = True) -> int:
    """The server's loop on its stdin and stdout (the protocol in the module doc): fork for every
    order; the child runs ``child(order, settled)`` and never comes back here (it closes
    ``settled`` once it leads its own session).  An exit is reported with the order's id and the
    CPU the child and its own children used.  It ends once its input has and, with ``linger``,
    its last child has too (without, the children die with it: PR_SET_PDEATHSIG).
    tests/zygote_server.py serves the suite's ranks with this loop and a child of its own."""
    children: dict[int, object] = {}            # pid -> its order's id
    pending, open_input = b"", True
    while open_input or (linger and children):
        if open_input and select.select([0], [], [], REAP_S)[0]:
            data = os.read(0, 1 << 16)
            open_input = bool(data)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                order = json.loads(line)
                settling, settled = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(settling)
                    child(order, settled)
                    os._exit(70)                # a child must not return to the server's loop
                os.close(settled)
                # The pid goes out only once the child leads its own session: the agent stops a
                # worker by its process group, and a worker stopped (SIGSTOP) or killed before its
                # setsid() had none, so the agent's kill missed it and it was never replaced.
                select.select([settling], [], [], SETTLE_S)
                os.close(settling)
                children[pid] = order["id"]
                _emit("forked", id=order["id"], pid=pid)
        elif not open_input:
            time.sleep(REAP_S)
        while children:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            _emit("exited", id=children.pop(pid), pid=pid, code=os.waitstatus_to_exitcode(status),
                  cpu=round(usage.ru_utime + usage.ru_stime, 3))
    return 0


class Forked:
    """A worker the fork server started: ``pid`` and ``poll()`` as a Popen's."""

    def __init__(self, server: "ForkServer", pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode


class ForkServer:
    """The agent's side.  ``ready`` is set once the server has imported torch; ``fork`` before
    that, or after the server died, returns None and the caller starts the worker cold, as it
    does when the server has not forked within ``fork_timeout_s``."""

    def __init__(self, log: Path, env: dict[str, str], fork_timeout_s: float = FORK_TIMEOUT_S) -> None:
        self.log, self.fork_timeout_s = log, fork_timeout_s
        self.proc = subprocess.Popen([sys.executable, *SERVER_ARGV], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(log, "w"), start_new_session=True,
                                     cwd=os.getcwd())
        self.ready = threading.Event()
        self.cond = threading.Condition()
        self.forked: dict[int, int] = {}        # order id -> pid
        self.abandoned: set[int] = set()        # orders given up on: forked late, killed at once
        self.exits: dict[int, int] = {}         # pid -> exit code
        self.orders = 0
        threading.Thread(target=self._read, name="hpct-fork-server", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self.cond:
                if msg.get("ev") == "ready":
                    self.ready.set()
                elif msg.get("ev") == "forked" and msg["id"] in self.abandoned:
                    _kill(msg["pid"])           # its rank was started cold meanwhile: never two of one rank
                elif msg.get("ev") == "forked":
                    self.forked[msg["id"]] = msg["pid"]
                elif msg.get("ev") == "exited":
                    self.exits[msg["pid"]] = msg["code"]
                self.cond.notify_all()
        self.proc.wait()
        with self.cond:
            self.cond.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, argv: list[str], env: dict[str, str], log: Path) -> Forked | None:
        """A worker running ``argv`` (a script and its arguments, or ``-m`` and a module), or None
        when the server is not ready or does not answer."""
        if not self.ready.is_set() or not self.alive():
            return None
        with self.cond:
            self.orders += 1
            oid = self.orders
            order = {"id": oid, "argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log)}
            try:
                self.proc.stdin.write(json.dumps(order).encode() + b"\n")
                self.proc.stdin.flush()
            except OSError:
                return None
            self.cond.wait_for(lambda: oid in self.forked or not self.alive(), self.fork_timeout_s)
            pid = self.forked.pop(oid, None)
            if pid is None:
                self.abandoned.add(oid)
        return None if pid is None else Forked(self, pid)

    def exit_code(self, pid: int) -> int | None:
        """The worker's exit code once the server reported it; a worker of a server that ended
        unreported is gone with it (PR_SET_PDEATHSIG), and reads as killed."""
        with self.cond:
            if pid in self.exits:
                return self.exits[pid]
        if self.alive():
            return None
        return None if _running(pid) else -signal.SIGKILL

    def close(self) -> None:
        """No more orders: the server ends after its last worker."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass


def _kill(pid: int) -> None:
    """A fresh fork may not have made its own process group yet: the process, then its group."""
    for kill in (os.kill, os.killpg):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _running(pid: int) -> bool:
    return process_state(pid) not in (None, b"Z", b"X")
