"""`hpct run` under a real Slurm: an sbatch job of 2 nodes, a worker SIGKILLed mid-training is
replaced by its node's agent and the job completes with every other process kept.

The cluster (tests/slurm_cluster.sh) is Debian's slurmctld, two slurmd and munge, each slurmd in
a network and UTS namespace of its own; node names resolve through the namespaces' /etc/hosts, so
the agents take their host list from SLURM_JOB_NODELIST and their node rank from SLURM_NODEID,
as on a real cluster.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpct.testing.cluster import parse_lines, progress, records
from hpct.testing.netns import unavailable_reason

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
CLUSTER = HERE / "slurm_cluster.sh"
EXAMPLE = HERE.parent / "examples" / "ddp.py"
LIMIT_S = 240


def _cluster(state: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLC_DIR": str(state), "SLC_NODES": "2", "SLC_TTL": str(LIMIT_S + 120)}
    return subprocess.run(["bash", str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout, env=env)


def _events(out: Path, node: int) -> list[dict]:
    path = out / f"events-{node}.jsonl"
    return parse_lines(path.read_text().splitlines()) if path.exists() else []


def test_sbatch_job_survives_a_killed_worker(tmp_path):
    if (why := unavailable_reason()) is not None:
        pytest.skip(why)
    if not all(shutil.which(p) for p in ("slurmctld", "slurmd", "sbatch", "munged")):
        pytest.skip("Slurm is not installed here; bash ci/setup.sh --tests installs it")
    out, state = tmp_path / "out", tmp_path / "slurm"
    out.mkdir()
    os.chmod(tmp_path, 0o755)
    node = tmp_path / "node.sh"
    node.write_text(f"""#!/bin/bash
exec {sys.executable} -c 'import sys; from hpct.cli import main; sys.exit(main())' run --nproc-per-node 2 \\
  --json {out}/events-$SLURM_NODEID.jsonl --log-dir {out}/logs {EXAMPLE} --steps 60 --step-time 0.03 --out {out}
""")
    job = tmp_path / "job.sh"
    # The srun flags that keep one node's failure from ending the step (docs/launch.md).
    job.write_text(f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --output={out}/slurm-%j.out
srun --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 bash {node}
exit $?
""")
    up = _cluster(state, "up")
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        env = {**os.environ, "SLURM_CONF": str(state / "etc" / "slurm.conf")}
        sbatch = subprocess.Popen(["ip", "netns", "exec", "hslurmctl", "sbatch", "--wait", str(job)],
                                  cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        end = time.monotonic() + LIMIT_S
        while progress(out, 3) < 10:
            assert time.monotonic() < end and sbatch.poll() is None, \
                (sbatch.poll(), [p.read_text()[-2000:] for p in out.glob("slurm-*.out")])
            time.sleep(0.05)
        victim = [e for e in _events(out, 1) if e["event"] == "start" and e["rank"] == 3][-1]["pid"]
        os.kill(victim, signal.SIGKILL)
        text, _ = sbatch.communicate(timeout=max(1, end - time.monotonic()))
        log = "".join(p.read_text() for p in out.glob("slurm-*.out"))
        assert sbatch.returncode == 0, text + log
    finally:
        down = _cluster(state, "down", timeout=60)
    assert down.returncode == 0, down.stderr
    recs = records(out)
    assert sorted(r["rank"] for r in recs) == [0, 1, 2, 3] and len({r["digest"] for r in recs}) == 1
    starts = [e for n in (0, 1) for e in _events(out, n) if e["event"] == "start"]
    assert [e["rank"] for e in starts if e["generation"] > 0] == [3], "only rank 3 restarted"
    for r in recs:                       # everyone else is the process started at generation 0
        first = [e["pid"] for e in starts if e["rank"] == r["rank"] and e["generation"] == 0][0]
        assert (r["pid"] != first) if r["rank"] == 3 else (r["pid"] == first)
    agent = [e for e in _events(out, 1) if e["event"] == "agent"][0]
    assert "SLURM_JOB_NODELIST" in agent["message"] and agent["hosts"] == ["node1", "node2"]
