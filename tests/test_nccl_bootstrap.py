"""NCCL's bootstrap with hpct's series, run for real without a GPU, for every pin (2.21.5, 2.30.7).

tests/nccl/bootstrap_harness.cc is compiled against the pin's patched tree (NCCL's bootstrap.cc,
socket.cc, utils.cc, param.cc, debug.cc and the series' hpct_ring.cc / hpct_rootless.cc; 2.30.7
adds its os/, param/ and env-plugin files: HARNESS_PROFILES in benchmarks/nccl_bootstrap.py;
CUDA headers from the pinned wheels for 2.21.5, from the CUDA 13.0 toolkit for 2.30.7) and forks
one process per rank: rootless ranks go through ncclCommInitRankRootless (their bootstrap gathers
in log depth; NCCL_HPCT_BOOTSTRAP=ring runs hpct's ring and NCCL's ring allgathers instead),
stock ranks through NCCL's root.  Needs the pin's source (skipped without it, saying how to provide it, e.g.
HPCT_NCCL_SOURCES); the series is applied with hpct-build patch nccl=<version>.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
import tomllib

import pytest

from util import REPO, run_cli

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = pytest.mark.serial


def _slow(test):
    return pytest.mark.slow(pytest.mark.multiprocess(test))


def _load_tools():
    # The harness plumbing lives beside the benchmark that shares it (not in the hpct package).
    spec = importlib.util.spec_from_file_location("nccl_bootstrap_tools", REPO / "benchmarks" / "nccl_bootstrap.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


tools = _load_tools()
PINS = tuple(p["version"] for p in tomllib.loads((REPO / "third_party" / "nccl.toml").read_text())["pins"])
RUN_TIMEOUT_S = 120      # any single harness run; the harness kills its own silent ranks sooner
MARGIN_S = 10.0          # scheduling slack on a loaded 2-core machine


@pytest.mark.unit
def test_skip_reason_says_how_to_provide_the_source(scratch_root, monkeypatch):
    monkeypatch.delenv("HPCT_NCCL_SOURCE", raising=False)
    monkeypatch.delenv("HPCT_NCCL_SOURCES", raising=False)
    assert tools.source_missing(scratch_root) == (
        "NCCL 2.21.5's source is not available: put nccl-2.21.5-1.tar.gz into the folder HPCT_NCCL_SOURCES "
        "names, or set HPCT_NCCL_SOURCE=<nccl-2.21.5-1.tar.gz or tree> "
        "(make it with git archive --format=tar --prefix=nccl-2.21.5-1/ v2.21.5-1 | gzip -n) "
        "or run hpct-build fetch nccl --source PATH")
    assert tools.source_missing(scratch_root, "2.30.7").startswith(
        "NCCL 2.30.7's source is not available: put nccl-2.30.7-1.tar.gz into the folder HPCT_NCCL_SOURCES")
    assert tools.source_missing(scratch_root, "2.30.7").endswith("hpct-build fetch nccl=2.30.7 --source PATH")
    folder = scratch_root / "sources"
    folder.mkdir()
    (folder / "nccl-2.30.7-1.tar.gz").write_bytes(b"")
    monkeypatch.setenv("HPCT_NCCL_SOURCES", str(folder))
    assert tools.source_missing(scratch_root, "2.30.7") is None    # its tarball is there
    assert tools.source_missing(scratch_root) is not None          # 2.21.5's is not
    monkeypatch.setenv("HPCT_NCCL_SOURCE", str(scratch_root / "nccl.tar.gz"))
    assert tools.source_missing(scratch_root) is None     # hpct-build patch will judge that file


@pytest.mark.unit
def test_every_pin_has_a_harness_profile():
    assert sorted(tools.HARNESS_PROFILES) == sorted(PINS)
    with pytest.raises(tools.SourceMissing, match=r"no bootstrap harness profile for NCCL 2\.99\.0"):
        tools.harness_profile("2.99.0")


@pytest.fixture(scope="module", params=PINS)
def harness(request):
    """The harness compiled against one pin's patched tree (each pin once per run)."""
    version = request.param
    why = tools.source_missing(REPO, version)
    if why is not None:
        pytest.skip(why)
    proc = run_cli("hpct-build", "patch", f"nccl={version}", "--root", str(REPO), timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "patched tree at" in proc.stdout, proc.stdout
    tree, series_id = tools.patched_tree(REPO, version)
    from hpct.errors import ToolchainError
    try:
        return tools.harness_binary(tree, series_id, REPO)
    except tools.SourceMissing as err:       # no profile for a new pin: say so, do not hide it
        pytest.fail(str(err))
    except ToolchainError as err:            # 2.30.7: no CUDA 13.0 toolkit on this machine
        pytest.skip(f"NCCL {version}'s harness needs its CUDA headers: {err.problem} ({err.fix})")


def _run(binary, mode, nranks, env=None, **options):
    run = tools.run_harness(binary, mode, nranks, timeout=RUN_TIMEOUT_S, env=env, **options)
    assert [r["rank"] for r in run.ranks] == sorted(r["rank"] for r in run.ranks), run.ranks
    return run


def _assert_all_ok(run, nranks, mode):
    assert run.returncode == 0, (run.stderr, run.ranks)
    assert [r["rank"] for r in run.ranks] == list(range(nranks))
    for r in run.ranks:
        assert r["mode"] == mode and r["nranks"] == nranks
        assert r["status"] == "ok" and r["stage"] == "done" and r["result"] == "ncclSuccess", r
        assert r["table_ok"] is True and r["sendrecv_ok"] is True, r
        assert r["warnings"] == [], r
        assert 0 < r["init_ms"] <= r["allgather_ms"], r
        # Forked while the harness had one thread: a rank forked after stock mode's root thread
        # started could inherit ncclLoadParam's mutex locked and block on it for ever.
        assert r["threads_at_fork"] == 1, r
    assert len({r["pid"] for r in run.ranks}) == nranks     # one process per rank


@_slow
@pytest.mark.parametrize("nranks", [4, 16])
def test_rootless_bootstrap_allgathers_the_exact_table_in_log_depth(harness, nranks):
    from hpct.ports import free_port_block
    base = free_port_block(nranks)
    run = _run(harness, "rootless", nranks, base_port=base, timeout_ms=30000)
    _assert_all_ok(run, nranks, "rootless")
    assert [r["listen"] for r in run.ranks] == [f"127.0.0.1:{base + r}" for r in range(nranks)]
    rounds = (nranks - 1).bit_length()          # ceil(log2 N)
    allgathers = {"2.21.5": 3, "2.30.7": 1}[tools.harness_version(harness)] + 1   # bootstrapInit's, the table's
    for r in run.ranks:
        x = r["exchange"]
        assert x is not None, r                  # the default for a rootless comm: log depth
        assert x["rounds"] == rounds and x["opened"] == rounds and x["accepted"] == rounds, x
        assert x["allgathers"] == allgathers, x


# ------------------------------------------------------------ the log-depth exchange (issue 60)

def _xorshift_block(size: int, rank: int, index: int) -> bytes:
    """tests/nccl/payload.h's fill(): rank's block of payload allgather ``index``."""
    x = (2654435761 * (rank + 1) & 0xFFFFFFFF) ^ ((index * 40503 + 7) & 0xFFFFFFFF)
    out = bytearray(size)
    for i in range(size):
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        out[i] = x & 0xFF
    return bytes(out)


def _fnv1a(data: bytes) -> str:
    h = 1469598103934665603
    for c in data:
        h = ((h ^ c) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


PAYLOADS = (1, 28, 4099)      # a byte, a socket address, an odd size that spans several socket reads


@_slow
@pytest.mark.parametrize("nranks", [1, 2, 3, 5, 8, 33])
def test_log_depth_exchange_gives_exactly_the_rings_bytes(harness, nranks):
    """Bruck's rounds for N = 1, a power of two, and not; the same harness with
    NCCL_HPCT_BOOTSTRAP=ring runs NCCL's own ring allgather on the same inputs."""
    from hpct.ports import free_port_block
    expect = [_fnv1a(b"".join(_xorshift_block(size, r, i) for r in range(nranks))) for i, size in enumerate(PAYLOADS)]
    digests = {}
    for bootstrap in ("ring", "log"):
        run = _run(harness, "rootless", nranks, base_port=free_port_block(nranks), timeout_ms=60000,
                   payload_bytes=",".join(map(str, PAYLOADS)), no_spin=1, env=tools.bootstrap_env(bootstrap=bootstrap))
        _assert_all_ok(run, nranks, "rootless")
        assert all((r["exchange"] is not None) == (bootstrap == "log") for r in run.ranks), run.ranks
        digests[bootstrap] = {tuple(r["digests"]) for r in run.ranks}
    assert digests["log"] == digests["ring"] == {tuple(expect)}


@_slow
def test_log_depth_a_rank_that_never_starts_is_named_with_its_address_on_every_rank(harness):
    from hpct.ports import free_port_block
    nranks, missing, timeout_ms = 6, 3, 3000
    base = free_port_block(nranks)
    run = _run(harness, "rootless", nranks, base_port=base, missing_rank=missing, timeout_ms=timeout_ms)
    assert run.returncode == 1
    ranks = run.by_rank()
    assert ranks[missing]["status"] == "absent"
    named = f"rank {missing} at 127.0.0.1:{base + missing} did not answer"
    # The ranks that connect to it in some round (2, 1 and 5: rank + 2^k = 3) give up at their
    # deadline; the others wait a grace (a quarter of it) for the cause and learn it from them.
    grace_ms = 750
    for rank, r in ranks.items():
        if rank == missing:
            continue
        assert r["status"] == "error" and r["result"] == "ncclRemoteError" and r["stage"] == "init", r
        assert named in r["error"] and "Connection refused" in r["error"], r["error"]
        assert r["error"].startswith("hpct rootless bootstrap: rank "), r["error"]
        assert timeout_ms * 0.95 <= r["launch_end_ms"] <= timeout_ms + grace_ms + MARGIN_S * 1e3, r
    assert run.wall_s < (timeout_ms + grace_ms) / 1e3 + MARGIN_S


@_slow
@pytest.mark.parametrize("phase", ["forming", "allgather"])
def test_log_depth_an_abort_during_round_k_returns_within_the_bound(harness, phase):
    """Rank 1 waits in round 2 for rank 5 (1 + 2^2): rank 5 never starts (forming) or stalls
    before its first allgather after init; rank 1's abort flag rises 1.5 s in."""
    from hpct.ports import free_port_block
    nranks, base = 8, free_port_block(8)
    where = {"forming": {"missing_rank": 5}, "allgather": {"stall_rank": 5, "stall_ms": 3000}}[phase]
    run = _run(harness, "rootless", nranks, base_port=base, timeout_ms=60000, abort_rank=1, abort_ms=1500,
               kill_ms=30000, **where)
    r = run.by_rank()[1]
    assert r["status"] == "error" and r["result"] == "ncclInternalError", r
    if phase == "forming":
        assert r["stage"] == "init", r
        assert "forming the log-depth bootstrap exchange was aborted in round 2 of 3" in r["error"], r["error"]
        assert f"rank 5 at 127.0.0.1:{base + 5}" in r["error"], r["error"]
    else:
        assert r["stage"] == "allgather", r
        assert "round 2 of 3: aborted while waiting for rank 5 at 127.0.0.1:" in r["error"], r["error"]
    # The exchange polls the flag every 10 ms; the rest is a loaded 2-core machine's slack.
    assert 0 <= r["abort_return_ms"] < 250, r
    # Its peers hear of the abort from it and fail at once, not at their 60 s deadline.
    for rank, other in run.by_rank().items():
        if rank in (1, 5):
            continue
        assert other["status"] == "error" and "failed at rank 1" in other["error"], other
        assert other["launch_end_ms"] < 1500 + MARGIN_S * 1e3, other


@_slow
def test_log_depth_a_rank_of_an_older_generation_is_refused(harness):
    """A straggler of generation 0 holds rank 2's port when the generation-1 group forms: it
    learns at once that it was replaced, and the group forms once the real rank 2 comes."""
    from hpct.ports import free_port_block
    nranks, base = 4, free_port_block(4)
    env = tools.bootstrap_env()

    def start(ranks, generation):
        argv = tools.harness_argv(harness, "rootless", nranks, base_port=base, ranks=ranks, generation=generation,
                                  timeout_ms=20000, kill_ms=40000)
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    stale = start("2", 0)
    time.sleep(0.5)
    group = start("0,1,3", 1)
    try:
        out, err = stale.communicate(timeout=RUN_TIMEOUT_S)
        (old,) = tools.parse_lines(out)
        assert old["status"] == "error" and old["result"] == "ncclInvalidUsage" and old["stage"] == "init", old
        assert "rank 2 is at generation 0, but rank " in old["error"], old["error"]
        assert "rejoin at generation 1" in old["error"], old["error"]
        assert old["end_ms"] < 5000, old
        newcomer = start("2", 1)
        outs = [p.communicate(timeout=RUN_TIMEOUT_S)[0] for p in (group, newcomer)]
    finally:
        for p in (stale, group):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    ranks = {r["rank"]: r for o in outs for r in tools.parse_lines(o)}
    assert sorted(ranks) == list(range(nranks))
    for r in ranks.values():
        assert r["status"] == "ok" and r["table_ok"] and r["sendrecv_ok"], r


@_slow
def test_a_bootstrap_that_is_neither_log_nor_ring_is_refused_naming_the_variable(harness):
    from hpct.ports import free_port_block
    run = _run(harness, "rootless", 2, base_port=free_port_block(2), timeout_ms=5000,
               env=tools.bootstrap_env(bootstrap="tree"))
    assert run.returncode == 1
    for r in run.ranks:
        assert r["result"] == "ncclInvalidUsage", r
        assert r["error"] == ("hpct rootless bootstrap: NCCL_HPCT_BOOTSTRAP=tree is not a bootstrap: set it to log "
                              "(the default, log depth) or ring (NCCL's ring allgathers), or unset it"), r
        assert r["end_ms"] < 2000, r


@_slow
def test_stock_root_bootstrap_works_as_control(harness):
    run = _run(harness, "stock", 4, timeout_ms=30000)
    _assert_all_ok(run, 4, "stock")
    assert all("listen" not in r for r in run.ranks)


@_slow
def test_rootless_waits_for_a_rank_three_seconds_late(harness):
    from hpct.ports import free_port_block
    run = _run(harness, "rootless", 4, base_port=free_port_block(4), late_rank=2, late_ms=3000,
               timeout_ms=30000)
    _assert_all_ok(run, 4, "rootless")
    # Nobody can be through the ring before the late rank arrived; the others waited for it.
    for r in run.ranks:
        assert r["launch_init_ms"] >= 3000, r
    assert run.by_rank()[2]["init_ms"] >= 3000


@_slow
def test_rootless_ring_missing_rank_fails_every_rank_by_the_deadline_naming_it(harness):
    """NCCL_HPCT_BOOTSTRAP=ring: hpct's ring and NCCL's ring allgathers, as before issue 60."""
    from hpct.ports import free_port_block
    nranks, missing, timeout_ms = 6, 3, 3000
    base = free_port_block(nranks)
    run = _run(harness, "rootless", nranks, base_port=base, missing_rank=missing, timeout_ms=timeout_ms,
               env=tools.bootstrap_env(bootstrap="ring"))
    assert run.returncode == 1
    ranks = run.by_rank()
    assert ranks[missing]["status"] == "absent"
    assert run.wall_s < timeout_ms / 1e3 + MARGIN_S
    for rank, r in ranks.items():
        if rank == missing:
            continue
        # Every rank fails inside init, on both pins.  Upstream 2.30.7's ringAllInfo returns
        # ncclSuccess when its ring allgather failed, so the ranks away from the gap used to leave
        # init and fail at their next bootstrap call; the series' patch 0003 returns the error.
        assert r["status"] == "error" and r["result"] == "ncclRemoteError", r
        assert r["stage"] == "init", r
        assert r["warnings"], r
        # The ring breaks only when the missing rank's neighbours give up at the deadline.
        assert timeout_ms * 0.95 <= r["launch_end_ms"] <= timeout_ms + MARGIN_S * 1e3, r
    before, after = ranks[missing - 1], ranks[missing + 1]
    assert before["error"].startswith(f"hpct rootless bootstrap: rank {missing - 1} of {nranks} timed out after")
    assert f"next rank {missing} at 127.0.0.1:{base + missing} did not complete the handshake" in before["error"]
    assert "Connection refused" in before["error"]        # nobody listens on the missing rank's port
    assert f"previous rank {missing} never connected (this rank listens on 127.0.0.1:{base + missing + 1})" in after["error"]
    # The others were already in NCCL's ring allgather; they learn of it from a closed ring socket.
    for rank in set(ranks) - {missing, missing - 1, missing + 1}:
        error = ranks[rank]["error"]
        assert "Connection closed by remote peer" in error or "Connection reset by peer" in error, error


@_slow
def test_rootless_taken_port_is_named_at_once(harness):
    from hpct.ports import free_port_block
    base = free_port_block(2)
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As free_port_block probes (and listeners bind): a connection of an earlier test still in
    # TIME_WAIT on that port must not fail the bind; a listening squatter still holds the port.
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        squatter.bind(("127.0.0.1", base + 1))
        squatter.listen(8)
        started = time.monotonic()
        run = _run(harness, "rootless", 2, base_port=base, timeout_ms=4000, kill_ms=20000)
    finally:
        squatter.close()
    assert run.returncode == 1
    taken = run.by_rank()[1]
    assert taken["status"] == "error" and taken["result"] == "ncclSystemError", taken
    assert taken["error"] == (f"hpct rootless bootstrap: rank 1: listen on 127.0.0.1:{base + 1}: the port is already "
                              "in use (another process, or a group that was not closed, holds it); stop that "
                              "process or choose another port block")
    assert taken["end_ms"] < 2000, taken          # no waiting for the deadline
    # Rank 0 reached the squatter, which never answers the handshake: it times out naming it.
    other = run.by_rank()[0]
    assert other["status"] == "error" and other["result"] == "ncclRemoteError", other
    assert f"rank 1 at 127.0.0.1:{base + 1} did not answer" in other["error"], other["error"]
    assert "no answer to the handshake" in other["error"] and "timed out after" in other["error"]
    assert time.monotonic() - started < 4 + MARGIN_S


@_slow
def test_stock_missing_rank_hangs_until_killed(harness):
    # The contrast: NCCL's root waits for every rank without a deadline, and so do the ranks.
    run = _run(harness, "stock", 4, missing_rank=3, kill_ms=3000)
    assert run.returncode == 1
    ranks = run.by_rank()
    assert ranks[3]["status"] == "absent"
    for rank in (0, 1, 2):
        assert ranks[rank]["status"] == "killed", ranks[rank]
        assert ranks[rank]["error"] == "no result within 3000 ms of launch; killed"
    assert run.wall_s < 3 + MARGIN_S


@_slow
@pytest.mark.multihost
def test_rootless_across_network_namespaces(harness):
    from hpct.testing.netns import netns_network, unavailable_reason
    from hpct.ports import free_port_block
    if (why := unavailable_reason()) is not None:
        pytest.skip(why)
    hosts, per_host = 4, 2
    nranks = hosts * per_host
    base = free_port_block(per_host)
    with netns_network(hosts, name_prefix="hpct-ncclb") as nodes:
        # NCCL 2.30 takes only RUNNING interfaces (carrier up), which a fresh veth gets a moment
        # after it is set up; 2.21.5 did not look.  Wait for it rather than race it.
        deadline = time.monotonic() + 10
        for node in nodes:
            while "LOWER_UP" not in node.run(["ip", "link", "show", "eth0"]).stdout:
                assert time.monotonic() < deadline, f"{node.name}: eth0 has no carrier after 10 s"
                time.sleep(0.05)
        addresses = ",".join(n.address for n in nodes)
        env = tools.bootstrap_env("eth0")
        procs = []
        try:
            for i, node in enumerate(nodes):
                ranks = ",".join(str(i * per_host + k) for k in range(per_host))
                argv = tools.harness_argv(harness, "rootless", nranks, base_port=base, hosts=addresses,
                                          per_host=per_host, ranks=ranks, timeout_ms=30000, kill_ms=60000)
                procs.append(node.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            results = []
            for p in procs:
                out, err = p.communicate(timeout=RUN_TIMEOUT_S)
                assert p.returncode == 0, (out, err)
                results += tools.parse_lines(out)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
        by_rank = {r["rank"]: r for r in results}
        assert sorted(by_rank) == list(range(nranks))
        for rank, r in by_rank.items():
            assert r["status"] == "ok" and r["table_ok"] and r["sendrecv_ok"], r
            assert r["listen"] == f"{nodes[rank // per_host].address}:{base + rank % per_host}"
        assert len({r["listen"].split(":")[0] for r in results}) == hosts
