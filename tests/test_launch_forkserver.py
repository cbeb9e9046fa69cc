"""The fork server of ``hpct run --fork-server`` (hpct/launch/forkserver.py): workers forked from
one process per node that imported torch once.  A forked worker must look to the agent exactly as
a spawned one does: its own session, environment, folder and log, its exit code (a signal's as a
negative one), and a traceback in its log when the script fails.  It must end (a forked child
that ran torch's finalisation spun for ever in garbage collection), and die with the server, whose
exits nobody else could report.  The agent's use of it, under real training, is the last test."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hpct.launch.forkserver import ForkServer
from hpct.launch.pool import Pool
from hpct.ports import free_port_block
from hpct.testing.cluster import Agents
from launch_jobs import EXAMPLE, LIMIT_S, LONG_STEPS, check_replaced, stock_digest, wait_progress

pytestmark = pytest.mark.multiprocess

SCRIPT = '''
import os, sys, time
print("argv", sys.argv[1:], "rank", os.environ.get("RANK"), "session", os.getsid(0) == os.getpid(),
      "cwd", os.getcwd(), "torch", "torch" in sys.modules, flush=True)
how = sys.argv[1]
if how == "sleep":
    time.sleep(60)
if how == "raise":
    raise RuntimeError("the script failed on purpose")
if how == "say":
    sys.exit("a message instead of a code")
sys.exit(int(how))
'''


def wait_exit(proc, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < end, f"pid {proc.pid} did not end"
        time.sleep(0.02)
    return proc.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("forks")
    fs = ForkServer(folder / "server.log", dict(os.environ))
    assert fs.ready.wait(120), (folder / "server.log").read_text()
    script = folder / "w.py"
    script.write_text(SCRIPT)
    yield fs, folder, script
    fs.close()
    fs.proc.kill()


def fork(server, how: str, **env):
    fs, folder, script = server
    log = folder / f"{how}-{time.monotonic_ns()}.log"
    proc = fs.fork([str(script), how], {"PATH": os.environ["PATH"], **env}, log)
    assert proc is not None
    return proc, log


def test_a_forked_worker_has_its_own_session_environment_and_log_and_its_exit_code(server):
    fs, folder, _ = server
    ok, ok_log = fork(server, "0", RANK="5")
    three, _ = fork(server, "3")
    assert wait_exit(ok) == 0 and wait_exit(three) == 3
    text = ok_log.read_text()
    assert f"argv ['0'] rank 5 session True cwd {os.getcwd()} torch True" in text, text
    assert ok.pid != fs.proc.pid and ok.pid != three.pid


def test_a_failing_script_leaves_its_traceback_and_exits_1(server):
    failed, log = fork(server, "raise")
    said, said_log = fork(server, "say")
    assert wait_exit(failed) == 1 and wait_exit(said) == 1
    assert "RuntimeError: the script failed on purpose" in log.read_text()
    assert "a message instead of a code" in said_log.read_text()


def test_a_killed_worker_reads_as_killed_and_the_server_lives_on(server):
    proc, _ = fork(server, "sleep")
    time.sleep(0.3)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    assert wait_exit(proc) == -signal.SIGKILL
    assert server[0].alive()


def test_workers_die_with_their_server_and_read_as_killed(tmp_path):
    """A server gone takes its workers along (PR_SET_PDEATHSIG): an exit nobody reports would
    leave a rank nobody replaces.  Before it is warm, fork() says no, and the agent spawns.  The
    node keeps standbys (a replacement without an import) only once its server is gone."""
    fs = ForkServer(tmp_path / "server.log", dict(os.environ))
    pool = Pool(("w.py",), True, tmp_path / "logs", 2, dict(os.environ))
    pool.forks = fs
    assert pool.wanted() == 0, "a standby beside a live server"
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    assert fs.fork([str(script), "0"], dict(os.environ), tmp_path / "early.log") is None, "not warm yet"
    assert fs.ready.wait(120), (tmp_path / "server.log").read_text()
    proc = fs.fork([str(script), "sleep"], {"PATH": os.environ["PATH"]}, tmp_path / "w.log")
    time.sleep(0.3)
    fs.proc.kill()
    assert wait_exit(proc) == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{proc.pid}") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fs.fork([str(script), "0"], dict(os.environ), tmp_path / "late.log") is None, "the server ended"
    assert pool.wanted() == 2, "the server ended: --standby's standbys are kept again"


def test_the_server_ends_after_its_last_worker_once_told_no_more(tmp_path):
    fs = ForkServer(tmp_path / "server.log", dict(os.environ))
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    assert fs.ready.wait(120)
    proc = fs.fork([str(script), "sleep"], {"PATH": os.environ["PATH"]}, tmp_path / "w.log")
    fs.close()
    time.sleep(0.5)
    assert fs.alive() and proc.poll() is None, "a worker outlives the agent's end of the server's input"
    os.killpg(proc.pid, signal.SIGKILL)
    assert wait_exit(proc) == -signal.SIGKILL
    fs.proc.wait(10)
    assert fs.proc.returncode == 0


@pytest.mark.slow
@pytest.mark.serial
def test_hpct_run_forks_its_workers_and_a_killed_one_is_replaced_bit_identically(tmp_path):
    """examples/ddp.py under hpct run's default: every worker is forked (the `start` event says so), the
    node waited once for its server's import, and a killed worker's replacement is forked too; the
    parameters equal stock's.  --standby 1 starts no standby while the server lives: its import
    of torch would only take cores from the training."""
    expect = stock_digest(tmp_path, 3, steps=LONG_STEPS)
    out = tmp_path / "out"
    out.mkdir()
    args = ["--nproc-per-node", "3", "--standby", "1",
            "--port-base", str(free_port_block(2 * 8 * 3 + 2)), EXAMPLE, *LONG_STEPS, "--out", str(out)]
    with Agents(tmp_path, args) as agents:
        agents.start()
        agents.wait_event(0, "fork-server", 120)
        wait_progress(agents, out, 1, 10)
        os.kill(agents.worker_pid(0, 1), signal.SIGKILL)
        assert agents.wait(LIMIT_S) == [0], agents.output(0)
    check_replaced(agents, out, 1, 3, expect)
    [ready] = agents.events(0, "fork-server")
    assert ready["ready"] is True, ready
    starts = agents.events(0, "start")
    assert len(starts) == 4 and all(s["why"].startswith("forked: from the fork server") for s in starts), starts
    assert not agents.events(0, "standby"), "a standby started beside a live fork server"


def test_an_order_the_server_does_not_answer_is_given_up_and_its_late_fork_killed(tmp_path):
    """A server that does not answer (stopped here) costs an order the server's fork timeout: the
    agent then starts the worker cold, so the fork that comes once the server runs again is killed
    at once: never two processes of one rank."""
    from hpct.launch.pool import Pool
    fs = ForkServer(tmp_path / "server.log", dict(os.environ), fork_timeout_s=1.0)
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    try:
        assert fs.ready.wait(120), (tmp_path / "server.log").read_text()
        os.kill(fs.proc.pid, signal.SIGSTOP)
        assert fs.fork([str(script), "sleep"], {"PATH": os.environ["PATH"]}, tmp_path / "late.log") is None
        pool = Pool((str(script), "0"), True, tmp_path / "logs", 0, {})
        pool.forks = fs
        assert "did not fork it within" in pool._cold_why(True)
        os.kill(fs.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while not fs.abandoned or not any(e for e in fs.exits.values()):
            assert time.monotonic() < deadline, (fs.abandoned, fs.exits)
            time.sleep(0.05)
        assert list(fs.exits.values()) == [-signal.SIGKILL], "the late fork was killed"
    finally:
        os.kill(fs.proc.pid, signal.SIGCONT)
        fs.close()
        fs.proc.kill()
