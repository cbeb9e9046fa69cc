"""The cluster agent of tests/test_churn.py: ranks in network namespaces, spares, events.

Each rank is a tests/churn_worker.py process in the namespace of its plan place (place p on
node p // P).  The agent keeps one warm spare per node (torch already imported), so that a
replacement or a joiner costs a connect, not an interpreter start.  Each node's workers are
forked by a fork server there (tests/zygote.py: torch imported once per node, not once per
worker; it is the harness's start path, and what the test checks begins at "join").  The agent
talks to every worker through a Unix socket (JSON lines) and waits for each answer with a
deadline; any process still alive at the end is killed (SIGCONT first, so a stopped one can die).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from zygote import Forked, Zygote

WORKER = str(Path(__file__).with_name("churn_worker.py"))
ANSWER_S = 60.0           # any answer a process owes the agent arrives within this, or the test fails
STARTUP_S = 240.0         # an interpreter importing torch on a loaded 2-core machine: a start, not a hang
SPARES_PER_NODE = 2       # a round may replace two ranks of one node, or admit a joiner next to one


@dataclass
class Proc:
    node: int
    popen: Forked               # from its node's fork server
    log: Path
    place: int = -1
    ready: bool = False        # torch imported: it said "spare"
    events: queue.Queue = field(default_factory=queue.Queue)

    def send(self, **cmd) -> None:
        self.popen.stdin.write(json.dumps(cmd) + "\n")
        self.popen.stdin.flush()

    def expect(self, *names: str, timeout: float = ANSWER_S) -> dict:
        """The next event; it must be one of ``names``."""
        try:
            ev = self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"place {self.place} (pid {self.popen.pid}) gave no {names} within "
                                 f"{timeout:g} s: a hang\n{self.tail()}") from None
        assert ev["ev"] in names, f"place {self.place}: expected {names}, got {ev}\n{self.tail()}"
        return ev

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def tail(self) -> str:
        try:
            return self.log.read_text()[-3000:]
        except OSError:
            return ""


class Cluster:
    """``nodes`` (Namespaces) x ``nproc`` places; the job's world lives in ``members`` (rank order)."""

    def __init__(self, nodes, nproc: int, port_base: int, out: Path, op_timeout: float = 30.0):
        self.nodes, self.nproc, self.out, self.op_timeout = nodes, nproc, out, op_timeout
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("HPCT_", "TORCH_GLOO", "RANK", "WORLD_SIZE", "LOCAL_"))}
        self.env.update({"HPCT_HOSTS": ",".join(n.address for n in nodes), "N_PROC_PER_NODE": str(nproc),
                         "HPCT_PORT_BASE": str(port_base), "HPCT_CONNECT_TIMEOUT": "10",
                         "OMP_NUM_THREADS": "1"})
        self.members: list[Proc] = []
        self.spares: dict[int, list[Proc]] = {n: [] for n in range(len(nodes))}
        self.everyone: list[Proc] = []
        self.zygotes: dict[int, Zygote] = {}     # node -> its fork server (torch imported once there)
        # A socket's path has room for 107 bytes; pytest's folder may not leave it
        self.sock_dir = tempfile.mkdtemp(prefix="hpct-churn-")
        self.sock_path = os.path.join(self.sock_dir, "zygote.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.sock_path)
        self.listener.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()
        self.gen = 0
        self.reform_errors: list[str] = []    # error types of re-formations a loss broke

    # ---- processes -------------------------------------------------------------------------
    def spawn(self, node: int) -> Proc:
        log = self.out / f"proc-{len(self.everyone)}-node{node}.log"
        if node not in self.zygotes:
            self.zygotes[node] = Zygote(popen=self.nodes[node].popen, log=self.out / f"zygote-node{node}.log")
        forked = self.zygotes[node].launch([sys.executable, "-u", WORKER], self.env, log, "/",
                                           sock=self.sock_path, wait=False)
        proc = Proc(node, forked, log)
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()
        self.everyone.append(proc)
        return proc

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return                    # closed by stop_all
            ident = b""
            while not ident.endswith(b"\n"):   # byte by byte: the worker's first event follows at once
                ident += conn.recv(1) or b"\n"
            ident = int(ident) if ident.strip().isdigit() else None
            forked = next((z.children[ident] for z in self.zygotes.values() if ident in z.children), None)
            if forked is not None:
                forked.attach(conn)
            else:                         # a worker that died before it said who it is
                conn.close()

    @staticmethod
    def _pump(proc: Proc) -> None:
        if not proc.popen.connected.wait(STARTUP_S):
            proc.events.put({"ev": "exited", "code": None, "why": f"never connected within {STARTUP_S:g} s"})
            return
        for line in proc.popen.stdout:
            try:
                ev = json.loads(line)
                proc.ready = proc.ready or ev.get("ev") == "spare"
                proc.events.put(ev)
            except ValueError:
                pass                      # stray output (a library's print), not an event
        try:
            code = proc.popen.wait(timeout=ANSWER_S)
        except subprocess.TimeoutExpired:
            code = None
        proc.events.put({"ev": "exited", "code": code})

    def refill_spares(self) -> None:
        for node, spares in self.spares.items():
            while len(spares) < SPARES_PER_NODE:
                spares.append(self.spawn(node))

    def ready_spares(self) -> dict[int, int]:
        """node -> spares there that are ready now (a round prefers a move that needs no wait)."""
        return {node: sum(p.ready for p in spares) for node, spares in self.spares.items()}

    def can_place(self, places) -> bool:
        ready = self.ready_spares()
        return all(sum(q // self.nproc == node for q in places) <= n for node, n in ready.items())

    def take_spare(self, place: int) -> Proc:
        spares = self.spares[place // self.nproc]
        proc = next((p for p in spares if p.ready), spares[0])
        spares.remove(proc)
        proc.expect("spare", timeout=STARTUP_S)
        proc.place = place
        return proc

    def stop_all(self) -> None:
        for p in self.everyone:
            p.popen.started.wait(10)          # a fork asked for just now: learn its pid
            if p.popen.poll() is None and p.popen.pid is not None:
                p.signal(signal.SIGCONT)
                p.popen.kill()
        for p in self.everyone:
            try:
                p.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for zygote in self.zygotes.values():  # its workers would follow it (PR_SET_PDEATHSIG)
            zygote.close()
        self.listener.close()
        shutil.rmtree(self.sock_dir, ignore_errors=True)

    # ---- membership ------------------------------------------------------------------------
    @property
    def plan(self) -> list[int]:
        return [m.place for m in self.members]

    def free_places(self) -> list[int]:
        return [p for p in range(len(self.nodes) * self.nproc) if p not in self.plan]

    def start(self, size: int) -> list[dict]:
        starting = [self.spawn(place // self.nproc) for place in range(size)]   # all import at once
        self.refill_spares()
        for place, proc in enumerate(starting):
            proc.expect("spare", timeout=STARTUP_S)
            proc.place = place
        self.members = starting
        for rank, m in enumerate(self.members):
            m.send(cmd="join", rank=rank, size=size, gen=0, plan=self.plan, member=True,
                   op_timeout=self.op_timeout)
        return self.collect(self.members, ("reformed",))

    @staticmethod
    def collect(procs, names, timeout: float = ANSWER_S) -> list[dict]:
        end = time.monotonic() + timeout
        return [p.expect(*names, timeout=max(end - time.monotonic(), 0.1)) for p in procs]

    def reform(self, how: str, *, lost: list[Proc] = (), joiners: int = 0, places=None,
               during=None) -> list[dict]:
        """Re-form the world; returns every new member's "reformed" event (rank order).

        ``during(members)`` runs once the commands are out (the test kills a rank there) and
        returns the ranks it lost; the survivors then re-form again without them."""
        old = self.members
        gen = self.gen + 1
        if how == "shrink":
            exclude = [old.index(p) for p in lost]
            self.members = [m for m in old if m not in lost]
            for m in self.members:
                m.send(cmd="reform", how="shrink", exclude=exclude)
            new = []
        elif how == "replace":
            new = [self.take_spare(p.place) for p in lost]
            self.members = [new[lost.index(m)] if m in lost else m for m in old]
            for m in old:
                if m not in lost:
                    m.send(cmd="reform", how="recover", joiners=True)
        elif how == "grow":
            new = [self.take_spare(p) for p in places]
            self.members = old + new
            for m in old:
                m.send(cmd="reform", how="grow", size=len(self.members), plan=self.plan, joiners=True)
        else:                                         # "check": same world, parity only
            new = []
            for m in old:
                m.send(cmd="reform", how="check")
        for p in new:
            p.send(cmd="join", rank=self.members.index(p), size=len(self.members), gen=gen, plan=self.plan,
                   op_timeout=self.op_timeout)
        if during is None:
            got = self.collect(self.members, ("reformed",))
        else:
            gone = during(list(self.members))
            self.members = [m for m in self.members if m not in gone]
            got = self.collect(self.members, ("reformed", "reform_failed"))
            for attempt in range(3):          # a failed attempt is an error on every member, then again
                failed = [e for e in got if e["ev"] == "reform_failed"]
                assert not any(e.get("unclear") for e in failed), failed
                self.reform_errors += [e["type"] for e in failed]
                if not failed and not gone:
                    break
                gone = []
                gen = max(e["gen"] for e in got) + 1
                for rank, m in enumerate(self.members):
                    m.send(cmd="reform", how="rejoin", rank=rank, size=len(self.members), plan=self.plan, gen=gen)
                got = self.collect(self.members, ("reformed", "reform_failed"))
            assert all(e["ev"] == "reformed" for e in got), got
        if how != "check":
            self.gen = max(gen, got[0]["gen"])
        self.refill_spares()
        return got
