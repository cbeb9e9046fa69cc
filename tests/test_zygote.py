"""The suite's fork server (tests/zygote.py) starts a rank as a spawned interpreter would: its
argv, environment, folder, session, log and exit code; threads joined and atexit run at exit;
a variable read at start-up that differs from the server's gets a fresh interpreter instead."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time

import pytest

from zygote import Zygote, children_cpu

pytestmark = pytest.mark.multiprocess

PROBE = textwrap.dedent("""
    import atexit, json, os, sys, threading, time
    facts = {"argv": sys.argv, "name": __name__, "x": os environ_x, "cwd": os.getcwd(),
             "own_session": os.getsid(0) == os.getpid(), "path0": sys.path[0],
             "torch_preloaded": "torch" in sys.modules}
    def late():
        time.sleep(0.3)
        open("late.txt", "w").write("joined")       # a non-daemon thread: the exit waits for it
    threading.Thread(target=late).start()
    atexit.register(lambda: print("atexit ran", flush=True))
    print(json.dumps(facts), flush=True)
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
""").replace("os environ_x", 'os.environ.get("ZYGOTE_X")')


@pytest.fixture(scope="module")
def server():
    z = Zygote()
    yield z
    z.close()
    assert z.server.poll() is not None, "the server outlived close()"


def _run(server, tmp_path, argv, env=None, timeout=60.0):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    log = tmp_path / "log.txt"
    p = server.launch(argv, env, log, str(tmp_path))
    return p, p.wait(timeout), log


def _facts(log):
    return json.loads(next(line for line in log.read_text().splitlines() if line.startswith("{")))


def test_a_forked_script_runs_as_main_with_its_argv_env_folder_session_and_exit(server, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    p, code, log = _run(server, tmp_path, [sys.executable, str(script), "3"], {"ZYGOTE_X": "seven"})
    text = log.read_text()
    assert code == 3 and p.returncode == 3 and p.poll() == 3, text
    facts = _facts(log)
    assert facts == {"argv": [str(script), "3"], "name": "__main__", "x": "seven", "cwd": str(tmp_path),
                     "own_session": True, "path0": str(tmp_path), "torch_preloaded": True}, facts
    assert "to stderr" in text and text.rstrip().endswith("atexit ran"), text
    assert (tmp_path / "late.txt").read_text() == "joined"


def test_a_module_and_code_run_the_way_python_runs_them(server, tmp_path):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    _, code, log = _run(server, tmp_path, [sys.executable, "-u", "-m", "probe_mod", "0"])
    assert code == 0, log.read_text()
    facts = _facts(log)
    assert facts["argv"] == [str(tmp_path / "probe_mod.py"), "0"] and facts["name"] == "__main__", facts
    assert facts["path0"] == str(tmp_path), facts
    _, code, log = _run(server, tmp_path, [sys.executable, "-P", "-c", PROBE, "5"])
    assert code == 5, log.read_text()
    facts = _facts(log)
    assert facts["argv"] == ["-c", "5"] and facts["name"] == "__main__" and facts["path0"] != "", facts


def test_an_uncaught_error_exits_1_with_its_traceback(server, tmp_path):
    _, code, log = _run(server, tmp_path, [sys.executable, "-c", "raise ValueError('no such rank')"])
    assert code == 1
    assert "ValueError: no such rank" in log.read_text()


def test_a_start_up_variable_unlike_the_servers_gets_a_fresh_interpreter(server, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    _, code, log = _run(server, tmp_path, [sys.executable, str(script), "0"], {"OMP_NUM_THREADS": "2"})
    assert code == 0, log.read_text()
    assert _facts(log)["torch_preloaded"] is False       # exec'd: torch reads OMP_* as it loads


def test_signals_reach_the_rank_and_its_status_says_which(server, tmp_path):
    p = server.launch([sys.executable, "-c", "import time; time.sleep(60)"], {**os.environ, "OMP_NUM_THREADS": "1"},
                      tmp_path / "log.txt", str(tmp_path))
    time.sleep(0.2)
    p.send_signal(signal.SIGSTOP)
    p.send_signal(signal.SIGCONT)
    os.killpg(p.pid, signal.SIGKILL)                    # its own session, as Job.stop kills it
    assert p.wait(30) == -signal.SIGKILL


def test_a_forked_ranks_cpu_reaches_the_suites_profile(server, tmp_path):
    # pytest's RUSAGE_CHILDREN never sees the server's children: without this count the profile
    # (tests/conftest.py), from which the tiers are chosen, would call a CPU-bound test idle.
    before = children_cpu()
    burn = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass"
    _, code, log = _run(server, tmp_path, [sys.executable, "-c", burn])
    assert code == 0, log.read_text()
    assert children_cpu() - before >= 0.45


def test_a_reaped_servers_ranks_are_counted_once(tmp_path):
    # Once this process waits for a server, RUSAGE_CHILDREN holds its ranks' CPU: the count
    # gives theirs back (the churn test closes a server per node, and read 3 CPU-s per second
    # on 2 cores before).
    before = children_cpu()
    z = Zygote()
    try:
        burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
        _, code, log = _run(z, tmp_path, [sys.executable, "-c", burn])
        assert code == 0, log.read_text()
        assert children_cpu() - before >= 0.25
    finally:
        z.close()
    deadline = time.monotonic() + 10
    while abs(children_cpu() - before) > 1e-6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert abs(children_cpu() - before) < 1e-6, (before, children_cpu())
