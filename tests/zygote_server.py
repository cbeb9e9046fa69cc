"""The fork server of tests/zygote.py (which says what it is for and what it proves).

Its loop is ``hpct run``'s fork server's (hpct/launch/forkserver.py, ``serve_orders``): orders
arrive as JSON lines on stdin, the server forks for each and reports {"ev": "forked", "id", "pid"}
once the child leads its own session, and, once it has reaped the child, {"ev": "exited", "id",
"pid", "code", "cpu"} (code: a Popen's returncode, negative for a signal; cpu: the seconds the
child and its own children used, which the suite's profile counts).  It stays single-threaded,
so a fork copies no lock another thread holds, and it exits at the end of stdin without waiting
for its children (they die with it: PR_SET_PDEATHSIG).

What is the suite's own is the child (``child``): an order here is {"id", "argv", "env", "log",
"cwd", "exec"}, and "socket" where the child's stdin and stdout are a Unix socket the caller
listens on (the child sends its id first; its stderr goes to the log).  The child runs
``python [flags] SCRIPT|-m MOD|-c CODE`` the way that interpreter would, and leaves through the
interpreter's own exit (finalisation included), or execs the argv it cannot reproduce; hpct
run's child (forkserver._child) runs only what a standby becomes and skips the finalisation.
"""

import ctypes
import io
import os
import runpy
import signal
import socket
import sys
import types

import torch                      # noqa: F401  (the point of the server: imported once)
import torch.distributed          # noqa: F401

from hpct.launch.forkserver import serve_orders

PR_SET_PDEATHSIG = 1
FLAGS = {"-u", "-P", "-B"}        # interpreter flags a forked child reproduces


def plan(argv: list[str]):
    """(flags, how, target, args) for ``python [flags] SCRIPT|-m MOD|-c CODE args``; None: exec it."""
    if not argv or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return None
    flags, rest = set(), argv[1:]
    while rest and rest[0] in FLAGS:
        flags.add(rest.pop(0))
    if rest and rest[0] in ("-m", "-c") and len(rest) > 1:
        return flags, rest[0], rest[1], rest[2:]
    if rest and not rest[0].startswith("-"):
        return flags, "script", rest[0], rest[1:]
    return None


def child(req: dict, settled: int) -> None:
    """The forked rank: its session, log, folder and environment, then its program; never returns
    (it raises SystemExit, or the program's error, up and out of the server's loop)."""
    os.setsid()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)   # the server gone, so is the rank
    os.close(settled)              # the server now tells its pid: its session exists
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    if req.get("socket"):          # stdin and stdout: a Unix socket the caller listens on
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(req["socket"])
        conn.sendall(f"{req['id']}\n".encode())
        streams = ((conn.fileno(), 0), (conn.fileno(), 1), (log, 2))
    else:
        conn = None
        streams = ((os.open(os.devnull, os.O_RDONLY), 0), (log, 1), (log, 2))
    for fd, to in streams:
        os.dup2(fd, to)
    for fd in {fd for fd, _ in streams}:
        os.close(fd)
    if conn is not None:
        conn.detach()
    os.chdir(req["cwd"])
    how = None if req["exec"] else plan(req["argv"])
    if how is None:
        try:
            os.execvpe(req["argv"][0], req["argv"], req["env"])
        except OSError as err:
            os.write(2, f"tests/zygote_server.py: cannot run {req['argv'][0]}: {err}\n".encode())
        os._exit(127)
    os.environ.clear()
    os.environ.update(req["env"])
    flags, kind, target, args = how
    unbuffered = "-u" in flags or os.environ.get("PYTHONUNBUFFERED")
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = (io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
                  if unbuffered else open(1, "w", closefd=False))
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    sys.dont_write_bytecode = "-B" in flags
    safe_path = "-P" in flags or os.environ.get("PYTHONSAFEPATH")
    if kind == "script":
        sys.argv = [target, *args]
        if not safe_path:
            sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
        runpy.run_path(target, run_name="__main__")
    elif kind == "-m":
        sys.argv = [target, *args]            # runpy puts the module's file in argv[0]
        if not safe_path:
            sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *args]
        if not safe_path:
            sys.path.insert(0, "")
        main = sys.modules["__main__"] = types.ModuleType("__main__")   # not the server's names
        exec(compile(target, "<string>", "exec"), vars(main))
    sys.exit(0)     # the interpreter's own exit: threads joined, atexit, finalisation


if __name__ == "__main__":
    sys.exit(serve_orders(child, linger=False))
