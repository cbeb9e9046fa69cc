"""The NCCL series' log-depth bootstrap exchange, built and run without NCCL's source.

The exchange (``src/nccl_rootless/hpct_exchange*``) is project-owned, POSIX-only code that
hpct-build places into every pinned NCCL tree before the series, as it places the ring core.
These tests take it from where each pin's series takes it, link it into
``tests/nccl/exchange_harness.cc`` (one rank per process) and check what NCCL's own harness
(tests/test_nccl_bootstrap.py, slow tier) does not reach cheaply: the handshake's refusals
and a peer that dies between two allgathers.  What only NCCL proves (the same bytes as NCCL's
ring allgather, a missing rank named through NCCL's init, an abort of a real comm, an older
generation refused) is there.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hpct.builder.layout import Layout
from hpct.builder.patches import extract_new_file, load_series
from hpct.builder.sources import load_manifest, pinned_versions
from hpct.ports import free_port_block
from util import REPO

# serial: many processes per test, some of them timing themselves (ci/test.sh)
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]

HARNESS = REPO / "tests" / "nccl" / "exchange_harness.cc"
SOURCES = ("src/include/hpct_ring.h", "src/misc/hpct_ring.cc", "src/include/hpct_exchange.h",
           "src/include/hpct_exchange_wire.h", "src/misc/hpct_exchange.cc", "src/misc/hpct_exchange_form.cc")
OK, ABORTED, TIMEOUT, MISMATCH, STALE, PEER_FAILED = 0, 1, 2, 4, 5, 8


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    if not shutil.which("g++"):
        pytest.fail("g++ is missing: run ci/setup.sh")
    layout = Layout(REPO)
    out = tmp_path_factory.mktemp("exchange")
    for rel in SOURCES:
        extract_new_file(layout, load_manifest(layout, "nccl"), rel, out)
        for version in pinned_versions(layout, "nccl"):   # one file for every pin
            placed = dict(load_series(layout, load_manifest(layout, "nccl", version)).project_files)
            assert placed[rel] == REPO / "src" / "nccl_rootless" / Path(rel).name, (version, rel)
    binary = out / "exchange_harness"
    # -Werror with the warning flags NCCL builds with, in the older pin's C++ standard.
    for std in ("-std=c++11",):
        subprocess.run(["g++", std, "-O2", "-Wall", "-Wextra", "-Wvla", "-Werror", "-Wno-sign-compare", "-I", str(out),
                        "-I", str(HARNESS.parent),
                        str(HARNESS), *(str(out / Path(r).name) for r in SOURCES if r.endswith(".cc")),
                        "-o", str(binary), "-pthread"], check=True, timeout=240)
    return binary


def _argv(binary, rank, nranks, ports, **opts):
    argv = [str(binary), "--rank", str(rank), "--nranks", str(nranks), "--listen", f"127.0.0.1:{ports[rank]}",
            "--next", f"127.0.0.1:{ports[(rank + 1) % nranks]}"]
    for key, value in opts.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return argv


def _run(binary, nranks, *, skip=(), opts_for=None, delays=None, timeout=60, **opts):
    base = free_port_block(nranks)
    ports = [base + r for r in range(nranks)]
    procs, started, delays = {}, time.monotonic(), delays or {}
    for rank in sorted(set(range(nranks)) - set(skip), key=lambda r: delays.get(r, 0.0)):
        time.sleep(max(0.0, delays.get(rank, 0.0) - (time.monotonic() - started)))
        extra = dict(opts, **(opts_for(rank) if opts_for else {}))
        procs[rank] = subprocess.Popen(_argv(binary, rank, extra.pop("nranks", nranks), ports, **extra),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    try:
        for rank, p in procs.items():
            stdout, stderr = p.communicate(timeout=timeout)
            lines = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
            if lines:              # a rank made to die prints nothing; the test says which
                out[rank] = lines[0]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return out, ports


@pytest.mark.parametrize("nranks", [1, 5, 33])
def test_three_allgathers_come_back_exact_in_ceil_log2_n_rounds(harness, nranks):
    res, _ = _run(harness, nranks, allgathers=3, payload_bytes=4099, timeout_ms=30000)
    assert set(res) == set(range(nranks))
    rounds = (nranks - 1).bit_length()
    for rank, line in res.items():
        assert line["status"] == OK and line["exact"], line
        assert (line["rounds"], line["opened"], line["accepted"]) == (rounds, rounds, rounds), line
    assert len({tuple(line["digests"]) for line in res.values()}) == 1


def test_a_rank_that_dies_between_allgathers_is_named_on_every_rank(harness):
    nranks, dead = 8, 5
    res, ports = _run(harness, nranks, allgathers=3, timeout_ms=20000, opts_for=lambda r: {"die_after": 1} if r == dead else {})
    assert set(res) == set(range(nranks)) - {dead}     # it printed nothing: _exit(9)
    for rank, line in res.items():
        # Its exit resets connections that held the next allgather's data for it, which can
        # also cut the first one short for a peer still reading it: a dead rank's data is lost.
        assert line["status"] == PEER_FAILED and line["allgathers"] <= 1, line
        assert f"rank {dead} at 127.0.0.1:{ports[dead]} closed the connection" in line["message"], line
        assert line["total_ms"] < 5000, line          # an end of file, not the deadline


def test_another_jobs_connection_is_refused_and_reported_at_the_deadline(harness):
    res, _ = _run(harness, 2, timeout_ms=1500, opts_for=lambda r: {"key": 7 if r else 8})
    for line in res.values():
        assert line["status"] == TIMEOUT, line
        assert "another job or group" in line["message"], line["message"]


def test_nranks_mismatch_between_peers_is_named(harness):
    res, _ = _run(harness, 3, timeout_ms=2000, opts_for=lambda r: {"nranks": 4} if r == 1 else {})
    assert set(res) == {0, 1, 2}
    messages = " | ".join(line["message"] for line in res.values())
    assert "nranks mismatch" in messages and "nranks 4" in messages and "has 3" in messages, messages
    assert all(line["status"] != OK for line in res.values())


def test_an_older_generation_is_refused_and_learns_it_at_once(harness):
    nranks = 2
    base = free_port_block(nranks)
    ports = [base, base + 1]
    new = subprocess.Popen(_argv(harness, 0, nranks, ports, generation=1, timeout_ms=8000), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)
    old = subprocess.run(_argv(harness, 1, nranks, ports, generation=0, timeout_ms=8000), capture_output=True,
                         text=True, timeout=30)
    new.kill()
    new.communicate(timeout=10)
    line = json.loads(old.stdout.splitlines()[0])
    assert line["status"] == STALE, line
    assert "rank 1 is at generation 0, but rank 0 at" in line["message"], line["message"]
    assert "rejoin at generation 1" in line["message"]
    assert line["form_ms"] < 3000, line


def test_bytes_that_are_no_handshake_are_dropped_and_the_exchange_forms(harness):
    nranks = 3
    base = free_port_block(nranks)
    stop = threading.Event()

    def garbage():
        i = 0
        while not stop.is_set() and i < 60:
            try:
                with socket.create_connection(("127.0.0.1", base + 1), timeout=1) as s:
                    s.sendall(b"GET / HTTP/1.0\r\n\r\n" * (1 + i % 3) if i % 2 else b"\x00" * 7)
            except OSError:
                pass
            i += 1
            time.sleep(0.01)

    t = threading.Thread(target=garbage)
    t.start()
    procs = {}
    try:
        for rank in (1, 2, 0):       # rank 1 listens first, then the others come
            procs[rank] = subprocess.Popen(_argv(harness, rank, nranks, [base, base + 1, base + 2], timeout_ms=10000,
                                                 hold_ms=300), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True)
            time.sleep(0.2)
        res = {r: json.loads(p.communicate(timeout=30)[0].splitlines()[0]) for r, p in procs.items()}
    finally:
        stop.set()
        t.join(timeout=30)
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for line in res.values():
        assert line["status"] == OK and line["exact"], line
    assert res[1]["dropped"] >= 1
