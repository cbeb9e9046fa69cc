"""hpct.launch.hosts: Slurm hostlists, Slurm's environment, pod names, host files, the count check.

The expansion is checked against the examples in Slurm's own documentation (the libslurm and
Slurm::Hostlist man pages, slurm.conf's NodeName) and, where ``scontrol`` is installed, against
``scontrol show hostnames`` itself.  Every refusal is asserted by its message and its fix.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

import pytest

from hpct.errors import LaunchError
from hpct.launch.hosts import (MAX_HOSTS, NodeSource, check_hosts, expand_hostlist, from_hostfile,
                               from_pod_name, from_slurm)

pytestmark = pytest.mark.unit


def refused(call, *args, **kwargs) -> LaunchError:
    with pytest.raises(LaunchError) as info:
        call(*args, **kwargs)
    assert info.value.exit_code == 18
    return info.value


# --- expand_hostlist ---------------------------------------------------------------------------

DOCUMENTED = {
    # libslurm slurm_hostlist_create(3)
    "linux[1-3,6]": ["linux1", "linux2", "linux3", "linux6"],
    # Slurm::Hostlist(3pm)
    "tux[0-5,12,20-25]": [f"tux{i}" for i in (0, 1, 2, 3, 4, 5, 12, 20, 21, 22, 23, 24, 25)],
    "node1,node[2-5,12]": ["node1", "node2", "node3", "node4", "node5", "node12"],
    "node21,node[27-34]": ["node21"] + [f"node{i}" for i in range(27, 35)],
    # slurm.conf NodeName
    "lx[10-20]": [f"lx{i}" for i in range(10, 21)],
    "linux[0-64,128]": [f"linux{i}" for i in range(65)] + ["linux128"],
}


@pytest.mark.parametrize("expr", sorted(DOCUMENTED))
def test_slurm_documented_examples(expr):
    assert expand_hostlist(expr) == DOCUMENTED[expr]


def test_groups_multiply_in_slurms_order():
    assert expand_hostlist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    # Three or more groups: the last varies fastest, then the first, second, ... (as scontrol 22.05)
    assert expand_hostlist("a[1-2]b[3-4]c[5-6]") == \
        ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"]
    assert expand_hostlist("a[1-2]b[3-4]c[5-6]d[7-8]")[:6] == \
        ["a1b3c5d7", "a1b3c5d8", "a2b3c5d7", "a2b3c5d8", "a1b4c5d7", "a1b4c5d8"]
    assert expand_hostlist("a[1-2]b[3-4]c[5-6]d[7-8]")[8] == "a1b3c6d7"
    # slurm.conf's "rack[0-63]_blade[0-41]": 64 * 42 nodes
    hosts = expand_hostlist("rack[0-63]_blade[0-41]")
    assert len(hosts) == 64 * 42
    assert hosts[:2] == ["rack0_blade0", "rack0_blade1"] and hosts[41:43] == ["rack0_blade41", "rack1_blade0"]
    assert hosts[-1] == "rack63_blade41"


@pytest.mark.parametrize("expr, hosts", [
    ("node[001-004,007]", ["node001", "node002", "node003", "node004", "node007"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),           # padding from the low bound
    ("n[9-11]", ["n9", "n10", "n11"]),                    # no padding
    ("n[007]", ["n007"]),                                 # a single padded number
    ("n[001-10]", ["n001", "n002", "n003", "n004", "n005", "n006", "n007", "n008", "n009", "n010"]),
    ("n[1-010]", [f"n{i}" for i in range(1, 11)]),
    ("n[01-02,1-2]", ["n01", "n02", "n1", "n2"]),         # n01 and n1 are different names
    ("n1[1-2]", ["n11", "n12"]),
    ("n[1-2]-ib[1]", ["n1-ib1", "n2-ib1"]),               # text between groups
    ("[1-2]", ["1", "2"]),                                # a bracket first
    ("a[1,3],b,c[2]", ["a1", "a3", "b", "c2"]),           # commas inside brackets don't split
    ("a.example.org,b.example.org", ["a.example.org", "b.example.org"]),
    ("one", ["one"]),
    ("a b,\tc , d", ["a", "b", "c", "d"]),               # whitespace separates too
    ("  n[1-2]  ", ["n1", "n2"]),
])
def test_expansion(expr, hosts):
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize("expr, problem, fix", [
    ("n[1-3", "hostlist 'n[1-3': '[' at position 1 is never closed", "close each bracket: node[1-4]"),
    ("n1-3]", "hostlist 'n1-3]': ']' at position 4 closes no '['", "open each range with '[': node[1-4]"),
    ("n[[1]]", "hostlist 'n[[1]]': '[' at position 2 is inside another bracket", "brackets do not nest"),
    ("n[]", "hostlist 'n[]': empty range in '[]'", "node[001-004,007]"),
    ("n[1,,3]", "hostlist 'n[1,,3]': empty range in '[1,,3]'", "numbers and ranges of numbers"),
    ("n[5-3]", "hostlist 'n[5-3]': range '5-3' runs backwards", "write the lower number first: [3-5]"),
    ("n[a-c]", "hostlist 'n[a-c]': 'a-c' in '[a-c]' is not a number or a range of numbers",
     "inside brackets write numbers"),
    ("n[1-2-3]", "'1-2-3' in '[1-2-3]' is not a number", "node[001-004,007]"),
    ("bgl[123x456]", "'123x456' in '[123x456]' is not a number", "node[001-004,007]"),
    ("n[1, 2]", "' 2' in '[1, 2]' is not a number", "node[001-004,007]"),
    ("gpu[1-2]-ib", "hostlist 'gpu[1-2]-ib': '-ib' follows the last ']' of 'gpu[1-2]-ib'",
     "end a bracketed item with ']' as Slurm does, or list the names: n1-ib,n2-ib"),
    ("a,[1-2]x", "'x' follows the last ']' of '[1-2]x'", "end a bracketed item with ']'"),
    ("a,,b", "hostlist 'a,,b' has an empty item at position 2", "separate host names by single commas"),
    (",a", "hostlist ',a' has an empty item at position 0", "node1,node2"),
    ("a,", "hostlist 'a,' has an empty item at position 1", "node1,node2"),
    ("a, ,b", "has an empty item at position 3", "node1,node2"),
    ("", "the hostlist is empty", "name at least one host"),
    ("   ", "the hostlist is empty", "node[1-4]"),
])
def test_bad_expressions(expr, problem, fix):
    err = refused(expand_hostlist, expr)
    assert problem in err.problem and fix in err.fix
    assert str(err) == f"{err.problem}\n  fix: {err.fix}"


@pytest.mark.parametrize("expr, twice", [("n[1-3],n2", "n2"), ("a,a", "a"), ("n[1,1]", "n1"),
                                         ("node[1-4,3]", "node3"), ("a b a", "a")])
def test_duplicates(expr, twice):
    err = refused(expand_hostlist, expr)
    assert err.problem == f"hostlist {expr!r} names host {twice!r} more than once"
    assert err.fix == "list each node once"


def test_cap():
    assert MAX_HOSTS == 65536
    assert len(expand_hostlist("n[1-65536]")) == MAX_HOSTS
    for expr, item in (("n[0-65536]", "n[0-65536]"), ("n[0-999999999999999]", "n[0-999999999999999]"),
                       ("a[1-40000],b[1-40000]", "b[1-40000]"), ("r[0-999]x[0-999]", "r[0-999]x[0-999]")):
        err = refused(expand_hostlist, expr)
        assert err.problem == f"hostlist {expr!r} names more than 65536 hosts (at {item!r})"
        assert "a job spans at most 65536 nodes" in err.fix


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory):
    """``scontrol show hostnames`` as a function; it needs a slurm.conf, not a cluster."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol (Slurm) is not installed here")
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=hpcttest\nSlurmctldHost=localhost\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}

    def show(expr: str) -> list[str] | None:
        proc = subprocess.run(["scontrol", "show", "hostnames", expr], capture_output=True, text=True,
                              env=env, timeout=30)
        if "Invalid hostlist" in proc.stdout + proc.stderr:
            return None
        if proc.returncode != 0:
            pytest.skip(f"scontrol does not run here: {proc.stderr.strip().splitlines()[-1:]}")
        return proc.stdout.split()
    return show


SCONTROL_VALID = ["node[001-004,007]", "rack[1-2]-n[1-2]", "tux[0-5,12,20-25]", "n[08-11]", "n[9-11]",
                  "n[001-10]", "n[1-010]", "a[1,3],b,c[2]", "rack[0-3]_blade[0-2]", "a[1-2]b[3-4]c[5-6]",
                  "a[1-3]b[4-5]c[6-7]d[8-9]", "n[1-2]-ib[1]", "[1-2]", "x.y[1-2] z", "n[0010-0012],m[99-101]"]
SCONTROL_INVALID = ["n[5-3]", "n[a]", "n[]", "n[1,,2]", "n[[1]]", "n[1-2]-ib", "[1-2]x", "bgl[123x124]"]


@pytest.mark.parametrize("expr", SCONTROL_VALID)
def test_matches_scontrol(expr, scontrol):
    assert expand_hostlist(expr) == scontrol(expr)


@pytest.mark.parametrize("expr", SCONTROL_INVALID)
def test_refused_like_scontrol(expr, scontrol):
    assert scontrol(expr) is None
    refused(expand_hostlist, expr)


# --- NodeSource and from_slurm -------------------------------------------------------------------

def test_node_source_is_frozen():
    src = NodeSource(("a",), 0, None, "--hosts")
    with pytest.raises(dataclasses.FrozenInstanceError):
        src.node_rank = 1   # type: ignore[misc]


def test_slurm_absent():
    assert from_slurm({}) is None
    assert from_slurm({"SLURM_JOB_NODELIST": "  ", "SLURM_NODEID": "0"}) is None


def test_slurm_job_nodelist():
    env = {"SLURM_JOB_NODELIST": "gnode[10,20,25,37]", "SLURM_NODELIST": "ignored", "SLURM_NNODES": "4",
           "SLURM_NODEID": "2", "SLURM_NTASKS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "8"}
    assert from_slurm(env) == NodeSource(("gnode10", "gnode20", "gnode25", "gnode37"), 2, 4, "SLURM_JOB_NODELIST")


def test_slurm_nodelist_fallback_and_no_rank():
    assert from_slurm({"SLURM_NODELIST": "n[1-2]"}) == NodeSource(("n1", "n2"), None, None, "SLURM_NODELIST")


@pytest.mark.parametrize("tasks, gpus, nproc", [
    ("1", "8", 8),          # srun --ntasks-per-node=1: one agent, the GPUs say the workers
    ("1", None, None),
    (None, "4", 4),
    ("2(x3)", "2", 2),      # not a plain number
    ("3", None, 3),
    ("1", "0", None),
    (None, "n/a", None),
])
def test_slurm_nproc_per_node(tasks, gpus, nproc):
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "0"}
    env.update({k: v for k, v in (("SLURM_NTASKS_PER_NODE", tasks), ("SLURM_GPUS_ON_NODE", gpus)) if v})
    assert from_slurm(env).nproc_per_node == nproc


def test_slurm_refusals():
    err = refused(from_slurm, {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NNODES": "4"})
    assert err.problem == "SLURM_NNODES=4 but SLURM_JOB_NODELIST=n[1-3] names 3 hosts"
    assert "srun -N $SLURM_JOB_NUM_NODES --ntasks-per-node=1 hpct run" in err.fix
    err = refused(from_slurm, {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NODEID": "3"})
    assert err.problem == "SLURM_NODEID=3 is outside the 3 hosts of SLURM_JOB_NODELIST=n[1-3]"
    assert "srun inside the allocation" in err.fix
    err = refused(from_slurm, {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NODEID": "-1"})
    assert err.problem == "SLURM_NODEID='-1' is not a whole number"
    err = refused(from_slurm, {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NNODES": "three"})
    assert err.problem == "SLURM_NNODES='three' is not a whole number" and "srun" in err.fix
    err = refused(from_slurm, {"SLURM_NODELIST": "n[3-1]"})
    assert err.problem == "SLURM_NODELIST: hostlist 'n[3-1]': range '3-1' runs backwards"
    assert err.fix == "write the lower number first: [1-3]"


# --- from_pod_name ----------------------------------------------------------------------------------

@pytest.fixture
def no_master_addr(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)


def test_pod_workers_only(no_master_addr):
    src = from_pod_name("trainer-worker-3", 4)
    assert src == NodeSource(tuple(f"trainer-worker-{i}" for i in range(4)), 3, None, "pod name trainer-worker-3")


def test_pod_master_layout(no_master_addr, monkeypatch):
    hosts = ("job-master-0", "job-worker-0", "job-worker-1")
    assert from_pod_name("job-master-0", 3) == NodeSource(hosts, 0, None, "pod name job-master-0")
    assert from_pod_name("job-worker-1", 3, master=True).node_rank == 2
    assert from_pod_name("job-worker-1", 3, master=True).hosts == hosts
    assert from_pod_name("job-master-0", 1).hosts == ("job-master-0",)
    monkeypatch.setenv("MASTER_ADDR", "job-master-0")          # PyTorchJob with a Master replica
    assert (from_pod_name("job-worker-0", 3).node_rank, from_pod_name("job-worker-0", 3).hosts) == (1, hosts)
    assert from_pod_name("job-worker-0", 3, master=False).node_rank == 0
    monkeypatch.setenv("MASTER_ADDR", "other-master-0")        # another job's master: workers only
    assert from_pod_name("job-worker-0", 3).hosts == ("job-worker-0", "job-worker-1", "job-worker-2")


def test_pod_service_and_fqdn(no_master_addr):
    src = from_pod_name("my-job-worker-0.my-job.default.svc.cluster.local", 2, service="my-job")
    assert src.hosts == ("my-job-worker-0.my-job", "my-job-worker-1.my-job")
    assert src.source == "pod name my-job-worker-0" and src.node_rank == 0


def test_pod_jobset_trainer_v2():
    src = from_pod_name("llm-node-0-2", 4, service="llm")
    assert src == NodeSource(tuple(f"llm-node-0-{i}.llm" for i in range(4)), 2, None, "pod name llm-node-0-2")
    assert from_pod_name("a-b-trainer-node-0-0", 2).hosts == ("a-b-trainer-node-0-0", "a-b-trainer-node-0-1")


@pytest.mark.parametrize("name", ["myhost", "worker-3", "job-worker-a", "job-worker-03", "job-chief-0",
                                  "node-0-1", "job-node-0-01", "localhost.localdomain"])
def test_pod_no_pattern(name, no_master_addr):
    assert from_pod_name(name, 2) is None


def test_pod_refusals(no_master_addr):
    err = refused(from_pod_name, "job-master-1", 3)
    assert err.problem == "pod 'job-master-1' is master 1, but a PyTorchJob has one master, job-master-0"
    assert "Master replicas to 1" in err.fix
    err = refused(from_pod_name, "job-worker-4", 4)
    assert err.problem == "pod 'job-worker-4' is node 4 (workers only), outside --nnodes 4"
    assert err.fix == "set --nnodes to the job's number of pods"
    err = refused(from_pod_name, "job-worker-2", 3, master=True)
    assert err.problem == "pod 'job-worker-2' is node 3 (master plus workers), outside --nnodes 3"
    err = refused(from_pod_name, "llm-node-0-5", 4)
    assert err.problem == "pod 'llm-node-0-5' is node 5 (one indexed Job), outside --nnodes 4"
    err = refused(from_pod_name, "js-workers-2-0", 4)
    assert err.problem.startswith("pod 'js-workers-2-0' is in Job 2 of its replicated job")
    assert "parallelism = --nnodes" in err.fix
    err = refused(from_pod_name, "job-worker-0", 0)
    assert err.problem == "--nnodes 0 is not a positive number of nodes"


# --- from_hostfile --------------------------------------------------------------------------------

def test_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the job's nodes\n\nnode1 slots=8\n  node2   # spare\nnode3 slots=8 max_slots=8\n")
    assert from_hostfile(path) == ("node1", "node2", "node3")
    assert from_hostfile(str(path)) == ("node1", "node2", "node3")


def test_hostfile_refusals(tmp_path):
    missing = tmp_path / "nope"
    err = refused(from_hostfile, missing)
    assert err.problem == f"cannot read host file {missing}: No such file or directory"
    assert err.fix == "give a readable text file with one host name per line"
    err = refused(from_hostfile, tmp_path)
    assert err.problem.startswith(f"cannot read host file {tmp_path}: ")
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe node1\n")
    assert refused(from_hostfile, binary).problem.startswith(f"cannot read host file {binary}: ")
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n   \n")
    err = refused(from_hostfile, empty)
    assert err.problem == f"host file {empty} names no hosts" and "one host per line" in err.fix
    twice = tmp_path / "twice"
    twice.write_text("a slots=4\nb\na slots=4\n")
    err = refused(from_hostfile, twice)
    assert err.problem == f"host file {twice} names 'a' on lines 1 and 3" and "list each node once" in err.fix


# --- check_hosts ----------------------------------------------------------------------------------

def test_check_hosts():
    assert check_hosts(["a", "b"], 2) == ("a", "b")
    assert check_hosts(NodeSource(("a",), 0, None, "SLURM_JOB_NODELIST"), 1) == ("a",)
    err = refused(check_hosts, ["a", "b", "c"], 2, "--hosts")
    assert err.problem == "--hosts names 3 host(s) but --nnodes is 2"
    assert err.fix == "pass --nnodes 3, or a host list of 2 nodes"
    err = refused(check_hosts, NodeSource(("a",), 0, None, "host file /x"), 4)
    assert err.problem == "host file /x names 1 host(s) but --nnodes is 4" and "--nnodes 1" in err.fix
    assert refused(check_hosts, (), 1).problem == "the host list names 0 host(s) but --nnodes is 1"
    err = refused(check_hosts, ["a", "b", "c"], 3, "--hosts", 1)
    assert err.problem == "--hosts names 3 host(s) but --nnodes 3 plus --spare-nodes 1"
    assert err.fix == "pass --nnodes 2, or a host list of 4 nodes (the active nodes first, then the spares)"
    assert check_hosts(["a", "b", "c"], 2, "--hosts", 1) == ("a", "b", "c")
