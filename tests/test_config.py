"""hpct.config: every variable, every default, every cross-field rule, every message."""

from __future__ import annotations

import dataclasses
import re

import pytest

from hpct.config import VARIABLES, Config, describe_variables
from hpct.errors import ConfigError

pytestmark = pytest.mark.unit


def test_defaults():
    c = Config.from_mapping({})
    assert c == Config()
    assert (c.use_rootless, c.port_base, c.nproc_per_node, c.port_slots) == (False, 12000, 1, 8)
    assert (c.gloo_port_base, c.nccl_port_base) == (12000, 12008)
    assert (c.socket_retry_delay, c.init_barrier, c.connect_timeout) == (100, False, 300.0)
    assert c.hosts == ("127.0.0.1",)
    assert (c.rank, c.local_rank, c.world_size, c.local_world_size) == (None, None, None, None)
    assert c.blocks == {"gloo": range(12000, 12008), "nccl": range(12008, 12016)}


def test_every_variable_parsed():
    env = {"HPCT_USE_ROOTLESS": "1", "HPCT_PORT_BASE": "14000", "N_PROC_PER_NODE": "4",
           "HPCT_PORT_SLOTS": "2", "TORCH_GLOO_GET_PORT_BASE": "15000", "TORCH_NCCL_GET_PORT_BASE": "16000",
           "NCCL_SOCKET_RETRY_DELAY": "250", "TORCH_DIST_INIT_BARRIER": "1",
           "HPCT_HOSTS": " 10.0.0.1 , 10.0.0.2 ", "HPCT_CONNECT_TIMEOUT": "2.5", "RANK": "5",
           "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    c = Config.from_mapping(env)
    assert c == Config(use_rootless=True, port_base=14000, nproc_per_node=4, port_slots=2,
                       gloo_port_base=15000, nccl_port_base=16000, socket_retry_delay=250,
                       init_barrier=True, hosts=("10.0.0.1", "10.0.0.2"), connect_timeout=2.5,
                       rank=5, local_rank=1, world_size=8, local_world_size=4)


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("HPCT_PORT_SLOTS", "3")
    assert Config.from_mapping().port_slots == 3
    assert Config.from_mapping(None).port_slots == 3


def test_empty_value_counts_as_unset():
    assert Config.from_mapping({"HPCT_PORT_BASE": "", "HPCT_HOSTS": "", "RANK": ""}) == Config()


def test_frozen_and_checked_on_direct_construction():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().port_base = 1
    with pytest.raises(ConfigError, match="overlaps"):
        Config(gloo_port_base=12000, nccl_port_base=12001)


def test_nproc_defaults_from_local_world_size():
    assert Config.from_mapping({"LOCAL_WORLD_SIZE": "8"}).nproc_per_node == 8


def test_variable_table_defines_each_name_once():
    names = [v.name for v in VARIABLES]
    assert len(names) == len(set(names))
    fields = {f.name for f in dataclasses.fields(Config)}
    assert {v.field for v in VARIABLES} == fields
    table = describe_variables()
    assert all(f"`{n}`" in table for n in names)


# (environment, the message as a regex, a piece of the fix)
BAD_VALUES = [
    ({"HPCT_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"},
     r"^HPCT_NCCL_LIBRARY='/nonexistent/libnccl.so.2': no such file$", "an existing file"),
    ({"HPCT_USE_ROOTLESS": "yes"}, r"^HPCT_USE_ROOTLESS='yes': expected 0 or 1$", "HPCT_USE_ROOTLESS=0 or"),
    ({"TORCH_DIST_INIT_BARRIER": "true"}, r"^TORCH_DIST_INIT_BARRIER='true': expected 0 or 1$", "=1"),
    ({"HPCT_PORT_BASE": "12k"}, r"^HPCT_PORT_BASE='12k': not an integer$", "between 1024 and 65535"),
    ({"HPCT_PORT_BASE": "80"}, r"^HPCT_PORT_BASE='80': out of range \(between 1024 and 65535\)$", "1024"),
    ({"HPCT_PORT_BASE": "70000"}, r"^HPCT_PORT_BASE='70000': out of range", "65535"),
    ({"N_PROC_PER_NODE": "0"}, r"^N_PROC_PER_NODE='0': out of range \(between 1 and 1024\)$", "N_PROC_PER_NODE"),
    ({"N_PROC_PER_NODE": "2.0"}, r"^N_PROC_PER_NODE='2.0': not an integer$", "an integer"),
    ({"HPCT_PORT_SLOTS": "1_0"}, r"^HPCT_PORT_SLOTS='1_0': not an integer$", "an integer"),
    ({"HPCT_PORT_SLOTS": "0"}, r"^HPCT_PORT_SLOTS='0': out of range \(between 1 and 4096\)$", "HPCT_PORT_SLOTS"),
    ({"TORCH_GLOO_GET_PORT_BASE": "-1"}, r"^TORCH_GLOO_GET_PORT_BASE='-1': out of range", "1024"),
    ({"TORCH_NCCL_GET_PORT_BASE": "x"}, r"^TORCH_NCCL_GET_PORT_BASE='x': not an integer$", "1024"),
    ({"NCCL_SOCKET_RETRY_DELAY": "0"}, r"^NCCL_SOCKET_RETRY_DELAY='0': out of range \(between 1 and 60000\)$",
     "NCCL_SOCKET_RETRY_DELAY"),
    ({"NCCL_SOCKET_RETRY_DELAY": "1.5"}, r"^NCCL_SOCKET_RETRY_DELAY='1.5': not an integer$", "integer"),
    ({"HPCT_CONNECT_TIMEOUT": "soon"}, r"^HPCT_CONNECT_TIMEOUT='soon': not a number$", "a number"),
    ({"HPCT_CONNECT_TIMEOUT": "0"}, r"^HPCT_CONNECT_TIMEOUT='0': out of range \(between 0.001 and 86400\)$", "0.001"),
    ({"HPCT_CONNECT_TIMEOUT": "nan"}, r"^HPCT_CONNECT_TIMEOUT='nan': out of range", "86400"),
    ({"RANK": "-1"}, r"^RANK='-1': out of range", "RANK"),
    ({"LOCAL_RANK": "one"}, r"^LOCAL_RANK='one': not an integer$", "LOCAL_RANK"),
    ({"WORLD_SIZE": "0"}, r"^WORLD_SIZE='0': out of range", "WORLD_SIZE"),
    ({"LOCAL_WORLD_SIZE": "0"}, r"^LOCAL_WORLD_SIZE='0': out of range", "LOCAL_WORLD_SIZE"),
    ({"HPCT_HOSTS": "a,,b"}, r"^HPCT_HOSTS='a,,b': bad host entry ''$", "separated by commas"),
    ({"HPCT_HOSTS": "a b,c"}, r"^HPCT_HOSTS='a b,c': bad host entry 'a b'$", "no blanks"),
    ({"HPCT_HOSTS": "a,b,a"}, r"^HPCT_HOSTS='a,b,a': host a listed twice$", "each node once"),
    ({"HPCT_PLAN_PLACES": "0,x"}, r"^HPCT_PLAN_PLACES='0,x': not a comma list of integers$", "one plan place"),
    ({"HPCT_PLAN_PLACES": "0,-2"}, r"^HPCT_PLAN_PLACES='0,-2': negative place -2$", "count from 0"),
    ({"HPCT_PLAN_PLACES": "0,4,4"}, r"^HPCT_PLAN_PLACES='0,4,4': place 4 listed twice$", "its own place"),
    ({"HPCT_HOSTS": "a", "HPCT_HOSTFILE": "/x"}, r"^both HPCT_HOSTS and HPCT_HOSTFILE are set$", "unset one"),
    ({"HPCT_HOSTFILE": "/nonexistent/hosts"},
     r"^HPCT_HOSTFILE='/nonexistent/hosts': cannot read the file \(No such file or directory\)$", "readable file"),
    ({"HPCT_HOSTS": "[::1]"}, r"^HPCT_HOSTS='\[::1\]': host entry '\[::1\]' is bracketed$", "without brackets"),
    ({"HPCT_HOSTS": "10.0.0.1,fd00::2"}, r"^HPCT_HOSTS='10.0.0.1,fd00::2': IPv4 and IPv6 addresses mixed$",
     "one family"),
]


def test_hostfile_that_is_not_utf8_is_named_not_a_traceback(tmp_path):
    f = tmp_path / "hosts"
    f.write_bytes(b"10.0.0.1\n\xff\xfe10.0.0.2\n")
    with pytest.raises(ConfigError) as err:
        Config.from_mapping({"HPCT_HOSTFILE": str(f)})
    assert err.value.problem == f"HPCT_HOSTFILE={str(f)!r}: not UTF-8 text (byte 9)"
    assert "plain text" in err.value.fix and err.value.exit_code == 2


def test_ipv6_hosts_of_one_family_and_host_names_are_accepted():
    assert Config.from_mapping({"HPCT_HOSTS": "::1,fd00::2"}).hosts == ("::1", "fd00::2")
    assert Config.from_mapping({"HPCT_HOSTS": "node-a,10.0.0.2"}).hosts == ("node-a", "10.0.0.2")


@pytest.mark.parametrize("env,message,fix", BAD_VALUES, ids=[next(iter(e)) + "=" + next(iter(e.values()))
                                                             for e, _, _ in BAD_VALUES])
def test_bad_values(env, message, fix):
    with pytest.raises(ConfigError) as err:
        Config.from_mapping(env)
    assert re.search(message, err.value.problem), err.value.problem
    assert fix in err.value.fix
    assert err.value.exit_code == 2


RULES = [
    ({"TORCH_NCCL_GET_PORT_BASE": "12004"},
     "the gloo block 12000-12007 (TORCH_GLOO_GET_PORT_BASE=12000) overlaps the nccl block 12004-12011 "
     "(TORCH_NCCL_GET_PORT_BASE=12004)", "TORCH_NCCL_GET_PORT_BASE to at least 12008"),
    ({"TORCH_GLOO_GET_PORT_BASE": "12010", "TORCH_NCCL_GET_PORT_BASE": "12005"},
     "overlaps the nccl block 12005-12012", "at least 12018"),
    ({"HPCT_PORT_BASE": "65530"},
     "the gloo block 65530-65537 (TORCH_GLOO_GET_PORT_BASE=65530, HPCT_PORT_SLOTS=8 x N_PROC_PER_NODE=1 ports) "
     "ends above 65535", "at most 65528"),
    ({"HPCT_PORT_BASE": "65500", "HPCT_PORT_SLOTS": "4", "N_PROC_PER_NODE": "8"},
     "the nccl block 65532-65563", "lower TORCH_NCCL_GET_PORT_BASE"),
    ({"N_PROC_PER_NODE": "8", "LOCAL_WORLD_SIZE": "4"},
     "LOCAL_WORLD_SIZE=4 differs from N_PROC_PER_NODE=8", "N_PROC_PER_NODE"),
    ({"N_PROC_PER_NODE": "2", "LOCAL_RANK": "2"}, "LOCAL_RANK=2 is not below N_PROC_PER_NODE=2", "more than 2"),
    ({"WORLD_SIZE": "16", "N_PROC_PER_NODE": "8"},
     "WORLD_SIZE=16 spans more than one node (N_PROC_PER_NODE=8) but no host list is set", "HPCT_HOSTS=addr0"),
    ({"WORLD_SIZE": "17", "N_PROC_PER_NODE": "8", "HPCT_HOSTS": "a,b"},
     "WORLD_SIZE=17 does not fit 2 hosts x N_PROC_PER_NODE=8 = 16", "list every node"),
    ({"WORLD_SIZE": "4", "RANK": "4", "N_PROC_PER_NODE": "4"}, "RANK=4 is not below WORLD_SIZE=4", "0..WORLD_SIZE-1"),
    ({"RANK": "2", "N_PROC_PER_NODE": "2"}, "RANK=2 is not below 1 hosts x N_PROC_PER_NODE=2", "RANK"),
    ({"RANK": "3", "LOCAL_RANK": "0", "N_PROC_PER_NODE": "2", "HPCT_HOSTS": "a,b"},
     "RANK=3 with N_PROC_PER_NODE=2 has local rank 1, but LOCAL_RANK=0", "block placement"),
]


@pytest.mark.parametrize("env,message,fix", RULES, ids=[m.split(" (")[0][:40] for _, m, _ in RULES])
def test_cross_field_rules(env, message, fix):
    with pytest.raises(ConfigError) as err:
        Config.from_mapping(env)
    assert message in err.value.problem
    assert fix in err.value.fix


def test_rules_accept_a_consistent_multi_node_job():
    env = {"WORLD_SIZE": "16", "RANK": "9", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
           "HPCT_HOSTS": "10.0.0.1,10.0.0.2"}
    c = Config.from_mapping(env)
    assert (c.nproc_per_node, c.world_size, c.rank) == (8, 16, 9)
    # A world smaller than the host list allows is fine (elastic jobs shrink).
    assert Config.from_mapping({"WORLD_SIZE": "3", "HPCT_HOSTS": "a,b", "N_PROC_PER_NODE": "2"}).world_size == 3


def test_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the job's nodes\n10.0.0.1\n\n  10.0.0.2   # second\n")
    assert Config.from_mapping({"HPCT_HOSTFILE": str(hostfile)}).hosts == ("10.0.0.1", "10.0.0.2")


def test_empty_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# nothing\n\n")
    with pytest.raises(ConfigError) as err:
        Config.from_mapping({"HPCT_HOSTFILE": str(hostfile)})
    assert err.value.problem == f"HPCT_HOSTFILE={str(hostfile)!r}: no host addresses"


def test_unknown_hpct_name_with_hint():
    with pytest.raises(ConfigError) as err:
        Config.from_mapping({"HPCT_PORT_BSE": "12000"})
    assert err.value.problem == "unknown variable HPCT_PORT_BSE='12000'"
    assert err.value.fix.startswith("did you mean HPCT_PORT_BASE? hpct reads only: ")
    assert "HPCT_USE_ROOTLESS" in err.value.fix


def test_unknown_hpct_name_without_hint():
    with pytest.raises(ConfigError) as err:
        Config.from_mapping({"HPCT_ZZZ": "1"})
    assert err.value.fix.startswith("hpct reads only: ")


def test_other_names_are_ignored_and_build_names_accepted():
    env = {"PATH": "/bin", "NCCL_DEBUG": "INFO", "HPCT_GLOO_PREFIX": "/opt/gloo", "HPCT_GLOO_SERIES_ID": "abc",
           "HPCT_NCCL_SOURCE": "/tmp/nccl.tar.gz"}
    assert Config.from_mapping(env) == Config()


def test_message_renders_problem_and_fix():
    with pytest.raises(ConfigError) as err:
        Config.from_mapping({"HPCT_USE_ROOTLESS": "2"})
    assert str(err.value) == ("HPCT_USE_ROOTLESS='2': expected 0 or 1\n"
                              "  fix: set HPCT_USE_ROOTLESS=0 or HPCT_USE_ROOTLESS=1")


def test_the_cuda_halfs_library_variable_is_known_and_kept(tmp_path):
    # Naming hpct's libnccl must not make the rest of the configuration refuse the environment.
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"\x7fELF")
    assert Config.from_mapping({"HPCT_NCCL_LIBRARY": str(lib)}).nccl_library == str(lib)
    assert Config.from_mapping({}).nccl_library is None


def test_log_allreduce_is_the_group_size_from_which_float_sums_take_log_depth():
    """Default 16: below it a float all_reduce keeps stock Gloo's ring bits (DDP compares them)."""
    assert Config.from_mapping({}).log_allreduce_from == 16
    assert Config.from_mapping({"HPCT_LOG_ALLREDUCE": "0"}).log_allreduce_from == 0
    assert Config.from_mapping({"HPCT_LOG_ALLREDUCE": "1"}).log_allreduce_from == 1
    with pytest.raises(ConfigError) as err:
        Config.from_mapping({"HPCT_LOG_ALLREDUCE": "yes"})
    assert "HPCT_LOG_ALLREDUCE" in err.value.problem


def test_plan_places_place_the_first_world_only_and_must_match_its_size():
    from hpct.distributed.membership.world_state import WorldState
    world = WorldState()
    cfg = Config.from_mapping({"HPCT_PLAN_PLACES": "0,2"})
    assert cfg.plan_places == (0, 2)
    assert world.start_places(cfg, 2) == [0, 2]
    with pytest.raises(ConfigError) as info:
        world.start_places(cfg, 3)
    assert info.value.problem == "HPCT_PLAN_PLACES lists 2 places, but WORLD_SIZE is 3"
    assert world.start_places(Config.from_mapping({}), 3) is None
    world.world_formed(0, 0.1, rank=0, world_size=2, timeout=None)
    assert world.start_places(cfg, 2) is None, "a later world takes its places from recover()"


def test_processes_per_node_follow_the_world_on_the_default_single_host():
    """Issue 41: a notebook's or a test harness's init_process_group("hpct", rank=r, world_size=n)
    sets no hpct variable: on the default single host the world fits on it."""
    from hpct.config import NPROC_DEFAULT, NPROC_FROM_LOCAL, NPROC_FROM_WORLD, NPROC_GIVEN, nproc_source
    assert (Config.from_mapping({}).nproc_per_node, nproc_source({})) == (1, NPROC_DEFAULT)
    assert Config.from_mapping({}, world_size=3).nproc_per_node == 3
    assert (Config.from_mapping({"WORLD_SIZE": "4"}).nproc_per_node, nproc_source({"WORLD_SIZE": "4"})) == \
        (4, NPROC_FROM_WORLD)
    two_nodes = {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "HPCT_HOSTS": "10.0.0.1,10.0.0.2"}
    assert (Config.from_mapping(two_nodes).nproc_per_node, nproc_source(two_nodes)) == (2, NPROC_FROM_LOCAL)
    assert Config.from_mapping({"N_PROC_PER_NODE": "2"}, world_size=3).nproc_per_node == 2
    assert nproc_source({"N_PROC_PER_NODE": "2"}) == NPROC_GIVEN
    # A host list says the world spans nodes: nothing is guessed, the error names what would work.
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=4 does not fit 2 hosts x N_PROC_PER_NODE=1"):
        Config.from_mapping({"HPCT_HOSTS": "10.0.0.1,10.0.0.2", "WORLD_SIZE": "4"})
    with pytest.raises(ConfigError) as info:
        Config.from_mapping({"N_PROC_PER_NODE": "1", "WORLD_SIZE": "4"})
    assert "on one host, set N_PROC_PER_NODE=4" in info.value.fix
