"""hpct-build's component locks: one writer per tree, re-entrant in a process, bounded waits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from hpct.builder.locks import file_lock
from hpct.errors import BuildError

pytestmark = pytest.mark.unit

HOLDER = textwrap.dedent("""
    import sys, time
    from hpct.builder.locks import file_lock
    with file_lock(sys.argv[1], "the test's tree"):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
""")


def _holder(path, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), str(seconds)],
                            stdout=subprocess.PIPE, text=True, cwd="/")
    assert proc.stdout.readline().strip() == "held"
    return proc


class Steps:
    def __init__(self):
        self.lines = []

    def step(self, line):
        self.lines.append(line)


def test_a_lock_held_elsewhere_is_waited_for_and_then_taken(tmp_path):
    lock = tmp_path / "locks" / "gloo.lock"
    holder = _holder(lock, 1.5)
    try:
        steps = Steps()
        started = time.monotonic()
        with file_lock(lock, "gloo 5354032", steps, wait_s=60):
            waited = time.monotonic() - started
        assert waited >= 0.5, waited      # the holder still had it when we asked
        assert steps.lines == [f"waiting for another hpct-build working on gloo 5354032 (lock {lock})"]
    finally:
        holder.wait(timeout=30)


def test_a_lock_held_past_the_deadline_is_an_error_that_names_the_holder_tool(tmp_path):
    lock = tmp_path / "gloo.lock"
    holder = _holder(lock, 30)
    try:
        with pytest.raises(BuildError) as err:
            with file_lock(lock, "gloo 5354032", wait_s=1):
                pass
        assert "another hpct-build has held the lock on gloo 5354032 for over 1 s" in str(err.value)
        assert f"fuser {lock}" in err.value.fix
        assert err.value.exit_code == 7
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # the kernel drops a killed holder's lock: nothing is left stale
    with file_lock(lock, "gloo 5354032", wait_s=5):
        pass


PROBE = textwrap.dedent("""
    import sys
    from hpct.builder.locks import file_lock
    from hpct.errors import BuildError
    try:
        with file_lock(sys.argv[1], "the test's tree", wait_s=0.5):
            print("taken")
    except BuildError:
        print("busy")
""")


def _probe(path) -> str:
    return subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True,
                          cwd="/", timeout=60).stdout.strip()


def test_the_lock_is_reentrant_in_a_process_and_free_once_the_outer_hold_ends(tmp_path):
    lock = tmp_path / "nccl.lock"
    with file_lock(lock, "nccl"):
        with file_lock(lock, "nccl", wait_s=1):      # a build's own fetch and patch
            assert _probe(lock) == "busy"
        assert _probe(lock) == "busy"                # the inner exit did not drop the outer hold
    assert _probe(lock) == "taken"
