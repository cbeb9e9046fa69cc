"""GPU tier (``-m gpu``, run by ci/gpu.sh): N ranks on one GPU, each its own NCCL "host"
(NCCL_HOSTID), sockets on lo.  Every process bounds itself with a timeout; nothing here runs
without a CUDA device."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpct.demo.agent import Job, free_port_block, trainer_argv

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proof_settings  # noqa: E402  (beside this file; tests/gpu is no package)

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
WORKER = Path(__file__).with_name("worker.py")
RANKS = [int(n) for n in os.environ.get("GPU_PROOF_RANKS", "2 4").split()]


def settings() -> dict:
    """Every rank's proof settings (both stacks on the pack's libnccl, one reduction order)."""
    try:
        return proof_settings.from_environ()
    except proof_settings.ProofSettingsError as err:
        pytest.fail(str(err))


def run_ranks(n: int, mode: str, timeout: float = 120.0) -> list[str]:
    base = free_port_block(16 * n)                         # both blocks of the plan (8 slots each)
    master = free_port_block(1, avoid=range(base, base + 16 * n))
    master2 = free_port_block(1, avoid=[*range(base, base + 16 * n), master])   # stock's recovery store
    procs = []
    for r in range(n):
        env = {**os.environ, **settings(), "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(n), "N_PROC_PER_NODE": str(n), "HPCT_PORT_BASE": str(base),
               "NCCL_HOSTID": f"hpct-gpu-proof-{r}", "NCCL_SOCKET_IFNAME": "lo",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "MASTER_PORT_2": str(master2),
               "GPU_PROOF_MODE": mode}
        procs.append(subprocess.Popen([sys.executable, "-P", str(WORKER)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{mode} with {n} ranks did not finish within {timeout:g} s")
        outs.append(out)
        assert p.returncode == 0, out
    return outs


@pytest.mark.parametrize("n", RANKS)
def test_engine_collectives_exact_against_stock_nccl(n):
    outs = run_ranks(n, "exact")
    assert all("EXACT OK" in o for o in outs), outs


@pytest.mark.parametrize("n", RANKS)
def test_bus_bandwidth_table(n):
    outs = run_ranks(n, "bandwidth", timeout=300)
    table = next(o for o in outs if "BUSBW" in o)
    report = Path(os.environ.get("GPU_PROOF_REPORT", "build/gpu-proof"))
    report.mkdir(parents=True, exist_ok=True)
    (report / f"busbw-{n}.txt").write_text(table)


@pytest.mark.parametrize("n", RANKS)
def test_start_up_recovery_and_latency_table(n):
    outs = run_ranks(n, "timing")
    table = next((o for o in outs if "TIMING" in o), "")
    assert table.count(f"TIMING n={n}") == 5, outs
    report = Path(os.environ.get("GPU_PROOF_REPORT", "build/gpu-proof"))
    report.mkdir(parents=True, exist_ok=True)
    (report / f"timing-{n}.txt").write_text(table)


@pytest.mark.parametrize("n", RANKS)
def test_launch_overhead_table(n):
    """Not a claim: where a small op's time goes (stock, the engine, bare NCCL calls)."""
    outs = run_ranks(n, "overhead")
    table = next((o for o in outs if "OVERHEAD" in o), "")
    assert table.count(f"OVERHEAD n={n}") == 17 and "PROFILE" in table, outs
    report = Path(os.environ.get("GPU_PROOF_REPORT", "build/gpu-proof"))
    report.mkdir(parents=True, exist_ok=True)
    (report / f"overhead-{n}.txt").write_text(table)


def test_a_blocking_launch_held_by_a_silent_peer_is_ended_at_the_op_timeout():
    """The risk of blocking comms (the default): a launch NCCL holds.  The last rank stops
    (SIGSTOP) after forming the comm; rank 0's first all_reduce waits in ncclGroupEnd for the lazy
    connect.  The watchdog must fail the group at the op timeout and its abort end the call."""
    outs = run_ranks(2, "held", timeout=90)
    line = next((ln for o in outs for ln in o.splitlines() if ln.startswith("HELD")), "")
    report = Path(os.environ.get("GPU_PROOF_REPORT", "build/gpu-proof"))
    report.mkdir(parents=True, exist_ok=True)
    (report / "held-2.txt").write_text(line + "\n")
    assert line, outs
    took = float(line.split(": ", 1)[1].split(" s", 1)[0])
    assert "unexpected" not in line and "Error" in line, line
    assert took < proof_settings.HELD_OP_TIMEOUT_S + proof_settings.HELD_SLACK_S, line


# DDP on CUDA through the hpct backend (its NCCL engine) against torch's own NCCL, and the
# in-process recovery of the CPU tier (tests/test_recovery.py) on the GPU: the same trainer.
STEPS, KILL_STEP = 20, 10


def ddp_job(out: Path, n: int, *args: str) -> Job:
    out.mkdir(parents=True, exist_ok=True)
    base = free_port_block(16 * n)
    # settings(): the same libnccl and one reduction order in both stacks, hence bit-identical
    # parameters; it carries HPCT_NCCL_LIBRARY too, which the agent would not pass on.
    env = {**settings(), "HPCT_CONNECT_TIMEOUT": "60",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_block(1, avoid=range(base, base + 16 * n)))}
    return Job(trainer_argv(out, "--device", "cuda", "--steps", str(STEPS), *args), n, base, out,
               time.monotonic() + 240.0, env=env)


def params(out: Path, n: int) -> list[dict]:
    return [torch.load(out / f"params-{r}.pt") for r in range(n)]


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].view(torch.uint8).equal(b[k].view(torch.uint8)) for k in a)


@pytest.mark.parametrize("n", RANKS)
def test_ddp_bit_identical_to_stock_nccl_and_survives_a_sigkilled_rank(n, tmp_path):
    runs = {}
    for name, args in (("stock", ("--stock",)), ("hpct", ())):
        with ddp_job(tmp_path / name, n, *args) as j:
            t0 = time.monotonic()
            j.start_all()
            assert j.wait_all() == {r: 0 for r in range(n)}, name
            runs[name] = (params(tmp_path / name, n), time.monotonic() - t0)
    stock, hpct = runs["stock"][0], runs["hpct"][0]
    assert all(identical(p, stock[0]) for p in stock + hpct), "DDP on hpct differs from stock NCCL"

    victim = n - 1
    out = tmp_path / "fault"
    with ddp_job(out, n, "--hang", f"{victim}:{KILL_STEP}:0") as j:
        j.start_all()
        survivors = {r: j.procs[r].pid for r in range(n) if r != victim}
        j.wait_file(out / f"hang-{victim}-0", 120)
        time.sleep(0.5)                       # the others are now in step KILL_STEP's allreduce
        t_kill = time.monotonic()
        j.kill(victim)
        j.start(victim, generation=1, extra=["--replacement"])
        assert j.wait_all() == {r: 0 for r in range(n)}
    recs = {}
    for rec in sorted(j.records(), key=lambda r: r["events"][0]["t"]):
        recs.setdefault(rec["rank"], []).append(rec)
    for r, pid in survivors.items():
        assert [rec["pid"] for rec in recs[r]] == [pid], f"survivor {r} was restarted"
        kinds = [e["what"] for e in recs[r][0]["events"]]
        assert kinds == ["start", "connected", "failure", "recovered", "done"], kinds
    got = params(out, n)
    assert all(identical(p, hpct[0]) for p in got), "recovered run differs from the fault-free run"
    recover_s = max(e["recover_s"] for r in survivors for e in recs[r][0]["events"] if e["what"] == "recovered")
    report = Path(os.environ.get("GPU_PROOF_REPORT", "build/gpu-proof"))
    report.mkdir(parents=True, exist_ok=True)
    (report / f"ddp-{n}.txt").write_text(
        f"DDP n={n}: {STEPS} steps bit-identical to stock NCCL; stock job {runs['stock'][1]:.2f} s, "
        f"hpct job {runs['hpct'][1]:.2f} s; SIGKILL of rank {victim} at step {KILL_STEP}: in-process "
        f"recovery {recover_s:.3f} s (slowest survivor), run {time.monotonic() - t_kill:.2f} s after the kill\n")
