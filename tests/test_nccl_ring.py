"""The rootless bootstrap ring of the NCCL series, built and run without NCCL's source.

The ring core (``src/nccl_rootless/hpct_ring.cc`` and ``hpct_ring.h`` in this
repository) is project-owned code that hpct-build places into every pinned NCCL
tree (2.21.5 and 2.30.7, as ``src/misc/hpct_ring.cc`` and
``src/include/hpct_ring.h``) before the series.  These tests take it from where
each pin's series takes it, so what runs here is byte for byte what NCCL builds,
link it into ``tests/nccl/ring_harness.cc`` (one rank per process) and check
the ring and the ring allgather NCCL runs next, on loopback and across network
namespaces.
"""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hpct.builder.layout import Layout
from hpct.builder.patches import extract_new_file, load_series
from hpct.builder.sources import load_manifest, pinned_versions
from hpct.config import Config
from hpct.ports import PortPlan, free_port_block
from hpct.testing.netns import netns_network, unavailable_reason
from util import REPO

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = pytest.mark.serial

HARNESS = REPO / "tests" / "nccl" / "ring_harness.cc"
OK, ABORTED, TIMEOUT, ADDR_IN_USE, MISMATCH, STALE = 0, 1, 2, 3, 4, 5
# The ring's hello: proto "HCTRING1", magic, then rank, nranks, generation, group.
PROTO = 0x31474E4952544348


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    if not shutil.which("g++"):
        pytest.fail("g++ is missing: run ci/setup.sh")
    layout = Layout(REPO)
    m = load_manifest(layout, "nccl")
    out = tmp_path_factory.mktemp("ring")
    for rel in ("src/include/hpct_ring.h", "src/misc/hpct_ring.cc"):
        extract_new_file(layout, m, rel, out)
        # One file for every pin: each series places the same project file.
        for version in pinned_versions(layout, "nccl"):
            placed = dict(load_series(layout, load_manifest(layout, "nccl", version)).project_files)
            assert placed[rel] == REPO / "src" / "nccl_rootless" / Path(rel).name, (version, rel)
    binary = out / "ring_harness"
    # -Werror with the warning flags NCCL builds with: the core must be clean there too.
    subprocess.run(["g++", "-std=c++11", "-O2", "-Wall", "-Wextra", "-Wvla", "-Werror", "-Wno-sign-compare",
                    "-I", str(out), str(HARNESS), str(out / "hpct_ring.cc"), "-o", str(binary), "-pthread"],
                   check=True, timeout=180)
    assert load_series(layout, m).entries
    return binary


def _argv(binary, rank, nranks, ports, hosts=None, **opts):
    """One rank's command line; ``hosts[r]`` (default loopback) and ``ports[r]`` place rank r."""
    where = [f"{hosts[r] if hosts else '127.0.0.1'}:{ports[r]}" for r in (rank, (rank + 1) % nranks)]
    argv = [str(binary), "--rank", str(rank), "--nranks", str(nranks), "--listen", where[0], "--next", where[1]]
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def _results(procs, timeout):
    out = {}
    for rank, p in procs.items():
        stdout, stderr = p.communicate(timeout=timeout)
        lines = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
        assert lines, f"rank {rank} printed nothing; stderr: {stderr}"
        out[rank] = lines
    return out


def _ring(binary, nranks, *, ports, skip=(), delays=None, opts_for=None, timeout=60, **opts):
    procs, started, delays = {}, time.monotonic(), delays or {}
    # Punctual ranks first, then the late ones in order of lateness.
    for rank in sorted(set(range(nranks)) - set(skip), key=lambda r: delays.get(r, 0.0)):
        time.sleep(max(0.0, delays.get(rank, 0.0) - (time.monotonic() - started)))
        extra = dict(opts, **(opts_for(rank) if opts_for else {}))
        procs[rank] = subprocess.Popen(_argv(binary, rank, extra.pop("nranks", nranks), ports, **extra),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        return _results(procs, timeout), ports
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


def _port_block(n):
    base = free_port_block(n)
    return [base + i for i in range(n)]


# ------------------------------------------------------------ forming the ring

@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks", [1, 2, 4, 8, 16, 32])
def test_ring_forms_and_allgathers_exactly(harness, nranks):
    res, _ = _ring(harness, nranks, ports=_port_block(nranks))
    for rank, (line,) in res.items():
        assert line["status"] == OK, line["message"]
        assert line["allgather_ok"], line["allgather_error"]


@pytest.mark.multiprocess
def test_a_rank_three_seconds_late_is_waited_for(harness):
    nranks, late = 4, 2
    res, _ = _ring(harness, nranks, ports=_port_block(nranks), delays={late: 3.0}, timeout_ms=20000)
    for rank, (line,) in res.items():
        assert line["status"] == OK and line["allgather_ok"], line
    # The neighbour that connects to the late rank kept retrying; the late rank itself was quick.
    assert res[late - 1][0]["attempts"] > 3
    assert res[late - 1][0]["form_ms"] > 2500
    assert res[late][0]["form_ms"] < 1000


@pytest.mark.multiprocess
def test_a_missing_rank_fails_every_other_rank_at_the_deadline(harness):
    nranks, missing, deadline_ms = 6, 3, 1500
    ports = _port_block(nranks)
    started = time.monotonic()
    res, _ = _ring(harness, nranks, ports=ports, skip=(missing,), timeout_ms=deadline_ms)
    elapsed = time.monotonic() - started
    for rank, (line,) in res.items():
        assert line["status"] != OK or not line["allgather_ok"], f"rank {rank} did not fail: {line}"
    assert elapsed < deadline_ms / 1e3 * 2 + 5
    before = res[missing - 1][0]
    assert before["status"] == TIMEOUT
    assert f"next rank {missing} at 127.0.0.1:{ports[missing]}" in before["message"]
    assert "timed out after 1.5 s" in before["message"]
    after = res[missing + 1][0]
    assert after["status"] == TIMEOUT
    assert f"previous rank {missing} never connected (this rank listens on 127.0.0.1:{ports[missing + 1]})" in after["message"]
    # The rest formed their part of the ring and then lost it when the neighbours gave up.
    for rank in set(res) - {missing - 1, missing + 1}:
        assert res[rank][0]["allgather_error"], res[rank][0]


def _stale_client(port, hello, results):
    """A process of an older membership knocking at a new rank's fixed port."""
    answers = []
    for _ in range(50):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(hello)
                data = s.recv(32)
                if len(data) == 32:
                    answers.append(struct.unpack("<QIIIIQ", data)[1])
        except OSError:
            pass
        time.sleep(0.02)
    results.extend(answers)


@pytest.mark.multiprocess
def test_a_stale_generation_is_refused_and_does_not_disturb_the_new_ring(harness):
    nranks, victim = 4, 2
    ports = _port_block(nranks)
    # rank 1 of generation 0 claims to be the victim's previous rank; the ring is at generation 1
    stale = struct.pack("<QQIIII", PROTO, 12345, victim - 1, nranks, 0, 0)
    answers: list[int] = []
    knocker = threading.Thread(target=_stale_client, args=(ports[victim], stale, answers))
    knocker.start()
    res, _ = _ring(harness, nranks, ports=ports, generation=1, delays={victim - 1: 0.5}, timeout_ms=10000,
                   hold_ms=600)
    knocker.join(timeout=30)
    for rank, (line,) in res.items():
        assert line["status"] == OK and line["allgather_ok"], line
    assert res[victim][0]["refused"] >= 1
    assert 2 in answers          # "you are older": the stale process learns it at once


@pytest.mark.multiprocess
def test_the_stale_rank_itself_fails_at_once_naming_both_generations(harness):
    nranks = 2
    ports = _port_block(nranks)
    procs = {0: subprocess.Popen(_argv(harness, 0, nranks, ports, generation=1, timeout_ms=10000, hold_ms=2500),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)}
    time.sleep(0.3)
    procs[1] = subprocess.Popen(_argv(harness, 1, nranks, ports, generation=0, timeout_ms=10000),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    res = _results({1: procs[1]}, timeout=30)
    procs[0].kill()
    procs[0].communicate(timeout=10)
    line = res[1][0]
    assert line["status"] == STALE
    assert "rank 1 is at generation 0, but rank 0 at" in line["message"]
    assert "generation 1" in line["message"] and "rejoin at generation 1" in line["message"]
    assert line["form_ms"] < 3000


@pytest.mark.multiprocess
def test_nranks_mismatch_between_neighbours_is_named(harness):
    ports = _port_block(3)
    res, _ = _ring(harness, 3, ports=ports, timeout_ms=5000,
                   opts_for=lambda r: {"nranks": 4} if r == 1 else {})
    messages = " | ".join(line["message"] for (line,) in res.values())
    assert "nranks mismatch" in messages
    assert "nranks 4" in messages and "has 3" in messages
    assert all(line["status"] != OK for (line,) in res.values() if "nranks mismatch" in line["message"])


@pytest.mark.multiprocess
def test_another_jobs_connection_is_refused_and_reported_at_the_deadline(harness):
    ports = _port_block(2)
    res, _ = _ring(harness, 2, ports=ports, timeout_ms=1500, opts_for=lambda r: {"key": 7 if r else 8})
    for (line,) in res.values():
        assert line["status"] == TIMEOUT
        assert "another job or group" in line["message"], line["message"]


@pytest.mark.multiprocess
def test_abort_from_another_thread_returns_within_100_ms(harness):
    ports = _port_block(2)
    res, _ = _ring(harness, 2, ports=ports, skip=(1,), timeout_ms=60000, abort_after_ms=300)
    line = res[0][0]
    assert line["status"] == ABORTED, line
    assert "aborted" in line["message"]
    assert 0 <= line["abort_return_ms"] < 100


@pytest.mark.multiprocess
def test_a_fixed_port_in_use_fails_at_once_naming_the_port(harness):
    with socket.socket() as holder:
        for _ in range(20):
            # Another process's connection (CI's background downloads) may take a port of the block
            # between its choice and this bind: choose again then.
            ports = _port_block(2)
            try:
                holder.bind(("127.0.0.1", ports[0]))
                break
            except OSError:
                continue
        else:
            pytest.fail("no free port block to hold within 20 tries")
        holder.listen()
        res, _ = _ring(harness, 2, ports=ports, skip=(1,), timeout_ms=30000)
    line = res[0][0]
    assert line["status"] == ADDR_IN_USE
    assert f"listen on 127.0.0.1:{ports[0]}: the port is already in use" in line["message"]
    assert line["form_ms"] < 100


@pytest.mark.multiprocess
def test_bytes_that_are_no_handshake_are_dropped_and_the_ring_forms(harness):
    nranks = 3
    ports = _port_block(nranks)

    def garbage():
        for i in range(40):
            try:
                with socket.create_connection(("127.0.0.1", ports[1]), timeout=1) as s:
                    s.sendall(b"GET / HTTP/1.0\r\n\r\n" * (1 + i % 3) if i % 2 else b"\x00" * 7)
            except OSError:
                pass
            time.sleep(0.01)

    t = threading.Thread(target=garbage)
    t.start()
    res, _ = _ring(harness, nranks, ports=ports, delays={0: 0.3}, timeout_ms=10000, hold_ms=300)
    t.join(timeout=30)
    for (line,) in res.values():
        assert line["status"] == OK and line["allgather_ok"], line
    assert res[1][0]["dropped"] >= 1


@pytest.mark.multiprocess
@pytest.mark.slow
def test_200_form_and_abort_cycles_on_the_same_ports(harness):
    nranks, cycles = 4, 200
    res, _ = _ring(harness, nranks, ports=_port_block(nranks), cycles=cycles, generation_per_cycle=True,
                   timeout_ms=20000, timeout=300)
    for rank, lines in res.items():
        assert len(lines) == cycles
        bad = [ln for ln in lines if ln["status"] != OK or not ln["allgather_ok"]]
        assert bad == [], bad[:3]
        assert not any("already in use" in ln["message"] for ln in lines)


# ------------------------------------------------------------ several hosts

@pytest.mark.multihost
@pytest.mark.multiprocess
def test_ring_across_four_namespaces(harness, tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    nodes, per_node = 4, 2
    nranks = nodes * per_node
    with netns_network(nodes, name_prefix="hpct-ring", subnet="10.232.0") as ns:
        # Every rank's address from the port plan's NCCL block (default base, group 0).
        plan = PortPlan.from_config(Config.from_mapping(
            {"HPCT_HOSTS": ",".join(n.address for n in ns), "N_PROC_PER_NODE": str(per_node)}))
        table = plan.peers("nccl", 0)
        hosts, ports = [h for h, _ in table], [p for _, p in table]
        procs = {}
        for rank in range(nranks):
            argv = _argv(harness, rank, nranks, ports, hosts=hosts, timeout_ms=15000)
            procs[rank] = ns[rank // per_node].popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                      text=True)
        try:
            res = _results(procs, timeout=60)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
    for rank, (line,) in res.items():
        assert line["status"] == OK and line["allgather_ok"], line
