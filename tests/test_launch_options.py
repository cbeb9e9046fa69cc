"""`hpct run`'s options from the command line and the scheduler's environment (in process)."""

from __future__ import annotations

import argparse

import pytest

from hpct.errors import LaunchError
from hpct.launch.options import RunOptions, configure_parser

pytestmark = pytest.mark.unit


def options(argv: list[str], env: dict | None = None) -> RunOptions:
    p = argparse.ArgumentParser()
    configure_parser(p)
    return RunOptions.from_mapping(vars(p.parse_args(argv)), env or {})


def test_torchruns_spellings_both_work(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    logs = ["--log-dir", str(tmp_path / "logs")]
    a = options(["--nproc_per_node", "4", "--max_restarts", "2", "--standalone", *logs, str(script), "--lr", "1"])
    b = options(["--nproc-per-node", "4", "--max-restarts", "2", "--standalone", *logs, str(script), "--lr", "1"])
    assert a == b
    assert a.nproc_per_node == 4 and a.max_restarts == 2 and a.world_size == 4
    assert a.command == (str(script), "--lr", "1") and a.hosts == ("127.0.0.1",)


def test_slurm_gives_hosts_node_rank_and_the_job_id(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    env = {"SLURM_JOB_NODELIST": "gpu[001-002,010]", "SLURM_NODEID": "2", "SLURM_NNODES": "3",
           "SLURM_JOB_ID": "4242", "SLURM_NTASKS_PER_NODE": "1"}
    o = options(["--nproc-per-node", "8", str(script)], env)
    assert o.hosts == ("gpu001", "gpu002", "gpu010") and o.nnodes == 3 and o.node_rank == 2
    assert o.run_id == "4242" and o.nproc_per_node == 8 and o.host_source == "SLURM_JOB_NODELIST"
    with pytest.raises(LaunchError, match="3"):
        options(["--nnodes", "2", str(script)], env)


def test_pet_variables_are_defaults_as_for_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "3", "PET_NODE_RANK": "1", "PET_MAX_RESTARTS": "4",
           "HPCT_HOSTS": "10.0.0.1,10.0.0.2"}
    o = options([str(script)], env)
    assert (o.nnodes, o.nproc_per_node, o.node_rank, o.max_restarts) == (2, 3, 1, 4)
    assert options(["--node-rank", "0", str(script)], env).node_rank == 0, "a flag beats PET_*"
    with pytest.raises(LaunchError, match="PET_NODE_RANK='x' is not a whole number"):
        options([str(script)], {**env, "PET_NODE_RANK": "x"})


def test_module_and_program_commands(tmp_path):
    assert options(["--standalone", "-m", "pkg.train", "--x"]).command == ("-m", "pkg.train", "--x")
    o = options(["--standalone", "--no-python", "nvidia-smi", "-L"])
    assert o.command == ("nvidia-smi", "-L") and not o.python_script


def test_hpcts_own_host_variables_read_as_everywhere_else_in_hpct(tmp_path):
    from hpct.errors import ConfigError
    script = tmp_path / "train.py"
    script.write_text("")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the job's nodes\n10.0.0.1\n10.0.0.2  # node 1\n")
    o = options(["--node-rank", "1", str(script)], {"HPCT_HOSTFILE": str(hostfile)})
    assert o.hosts == ("10.0.0.1", "10.0.0.2") and o.nnodes == 2 and o.host_source.startswith("HPCT_HOSTFILE=")
    with pytest.raises(ConfigError, match="both HPCT_HOSTS and HPCT_HOSTFILE are set"):
        options(["--node-rank", "0", str(script)], {"HPCT_HOSTFILE": str(hostfile), "HPCT_HOSTS": "10.0.0.1"})
    with pytest.raises(ConfigError, match="host 10.0.0.1 listed twice"):
        options(["--node-rank", "0", str(script)], {"HPCT_HOSTS": "10.0.0.1,10.0.0.1"})


def test_spare_nodes_follow_the_active_ones_in_the_host_list(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    env = {"SLURM_JOB_NODELIST": "gpu[001-004]", "SLURM_NODEID": "3", "SLURM_JOB_ID": "7"}
    o = options(["--spare-nodes", "1", str(script)], env)
    assert (o.nnodes, o.spare_nodes, o.all_nodes, o.node_rank) == (3, 1, 4, 3), "node 3 is the spare"
    assert o.world_size == 3, "spares hold no rank until they take a slot"
    assert options(["--nnodes", "3", "--spare-nodes", "1", str(script)], env).nnodes == 3
    with pytest.raises(LaunchError, match=r"names 4 host\(s\) but --nnodes 4 plus --spare-nodes 1"):
        options(["--nnodes", "4", "--spare-nodes", "1", str(script)], env)
    with pytest.raises(LaunchError, match="--spare-nodes 4 leaves no active node of the 4 listed"):
        options(["--spare-nodes", "4", str(script)], env)
    with pytest.raises(LaunchError, match="--spare-nodes -1 is negative"):
        options(["--spare-nodes", "-1", str(script)], env)
    assert o.slow_link_ms == 10.0 and options(["--slow-link-ms", "0", str(script)], env).slow_link_ms == 0
    with pytest.raises(LaunchError, match="--slow-link-ms -5.0 is negative"):
        options(["--slow-link-ms", "-5", str(script)], env)
    with pytest.raises(LaunchError, match="--node-rank 4 is not below --nnodes 3 plus --spare-nodes 1"):
        options(["--node-rank", "4", "--spare-nodes", "1", str(script)], env)


def test_a_python_script_is_forked_from_the_fork_server_unless_told_not_to(tmp_path):
    """--fork-server is hpct run's default for a Python script (-m too); --no-fork-server opts out,
    --no-python has none, and asking for one with --no-python is refused (tests/test_launch.py)."""
    script = tmp_path / "train.py"
    script.write_text("")
    assert options(["--standalone", str(script)]).fork_server is True
    assert options(["--standalone", "-m", "pkg.train"]).fork_server is True
    assert options(["--standalone", "--fork-server", str(script)]).fork_server is True
    assert options(["--standalone", "--no-fork-server", str(script)]).fork_server is False
    assert options(["--standalone", "--no_fork_server", str(script)]).fork_server is False
    assert options(["--standalone", "--no-python", "nvidia-smi"]).fork_server is False
    assert options(["--standalone", "--no-python", "--no-fork-server", "nvidia-smi"]).fork_server is False
