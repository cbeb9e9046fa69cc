"""The PyTorch 2.6.0 series: its rootless logic, the form of its changes, and that they compile.

The pure-Python part of the rootless path lives in a new, standalone module
(``torch/distributed/_hpct_rootless.py``); it is imported here straight from
the patched tree, never through a torch install.  Its port plan must agree
with the shared vectors (tests/vectors/port_plan.json) that hpct.ports and
every C++ implementation reproduce.

The ``slow`` tests compile every C++ translation unit the series changes
against the headers of the ``torch==2.6.0`` wheel and the patched Gloo, and
need ``third_party/cache/torch-2.6.0-include`` (see docs/pytorch-build.md).
"""

from __future__ import annotations

import ast
import py_compile
import sys
import time

import pytest

from pytorch_series import (  # noqa: F401  (fixtures are used by name)
    GLOO_PATCHED, GLOO_PRISTINE, MODULE, VECTORS, _error_names, _series_files, changed_files, changed_units,
    compile_env, compile_unit, patched_tree, rl,
)
from util import unguarded_calls

# ------------------------------------------------------------ form of the series

@pytest.mark.unit
def test_series_has_why_lines_and_dep3_fields():
    from hpct.builder.patches import lint_patch
    files = _series_files()
    assert len(files) >= 4
    for p in files:
        assert lint_patch(p) == [], p.name
        text = p.read_text()
        assert "Origin: vendor, hpct" in text and "Forwarded: no" in text, p.name
        assert text.startswith("From 0000000000000000000000000000000000000000 "), p.name


@pytest.mark.unit
def test_series_touches_only_c10d_and_its_bindings():
    allowed = ("torch/distributed/", "torch/csrc/distributed/c10d/")
    for path in changed_files():
        assert path.startswith(allowed), path


@pytest.mark.unit
def test_new_module_imports_only_the_standard_library(patched_tree):
    tree = ast.parse((patched_tree / MODULE).read_text())
    top = set()
    for node in tree.body:          # module level only: torch is imported lazily inside a function
        if isinstance(node, ast.Import):
            top.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            top.add(node.module.split(".")[0])
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    assert top <= stdlib, top - stdlib
    assert "hpct" not in top


@pytest.mark.unit
def test_changed_python_modules_byte_compile(patched_tree, tmp_path):
    py = [f for f in changed_files() if f.endswith(".py")]
    assert MODULE in py and "torch/distributed/distributed_c10d.py" in py
    for rel in py:
        py_compile.compile(str(patched_tree / rel), cfile=str(tmp_path / "x.pyc"), doraise=True)


def _is_rootless_call(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and ast.unparse(f.value) == "_hpct_rootless"
            and f.attr != "enabled") or ast.unparse(f).startswith(("_hpct_rootless_", "_hpct_gloo"))


@pytest.mark.unit
def test_every_rootless_call_in_c10d_is_behind_the_switch(patched_tree):
    """With HPCT_USE_ROOTLESS unset, distributed_c10d runs only stock code."""
    calls, unguarded = unguarded_calls((patched_tree / "torch/distributed/distributed_c10d.py").read_text(),
                                       _is_rootless_call)
    assert calls >= 10
    assert unguarded == []
    # The check is real: an unguarded call is found.
    _, bad = unguarded_calls("def f(pg):\n    _hpct_rootless.connect(pg)\n", _is_rootless_call)
    assert bad == ["line 2: _hpct_rootless.connect"]


# ------------------------------------------------------------ the port plan (shared vectors)

@pytest.mark.unit
@pytest.mark.parametrize("case", VECTORS["port_of"], ids=lambda c: c["name"])
def test_port_of_matches_the_vectors(rl, case):
    args = {k: case[k] for k in ("block_base", "group", "local_rank", "nproc_per_node", "slots")}
    assert rl.port_of(**args) == case["expect"]


@pytest.mark.unit
@pytest.mark.parametrize("case", VECTORS["invalid_port_of"], ids=lambda c: c["name"])
def test_invalid_port_of_is_refused(rl, case):
    args = {k: case[k] for k in ("block_base", "group", "local_rank", "nproc_per_node", "slots")}
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.port_of(**args)
    assert "fix:" in str(err.value)


@pytest.mark.unit
@pytest.mark.parametrize("case", VECTORS["peer_table"], ids=lambda c: c["name"])
def test_peer_table_matches_the_vectors(rl, case):
    args = {k: case[k] for k in ("hosts", "block_base", "group", "world_size", "nproc_per_node", "slots")}
    assert [list(x) for x in rl.peer_table(**args)] == case["expect"]


@pytest.mark.unit
@pytest.mark.parametrize("case", VECTORS["peer_table"], ids=lambda c: c["name"])
def test_gloo_setup_of_the_whole_world_matches_the_peer_table(rl, case):
    env = {"TORCH_GLOO_GET_PORT_BASE": str(case["block_base"]), "N_PROC_PER_NODE": str(case["nproc_per_node"]),
           "HPCT_PORT_SLOTS": str(case["slots"]), "HPCT_HOSTS": ",".join(case["hosts"]),
           "TORCH_NCCL_GET_PORT_BASE": "1024"}
    plan = rl.load_plan(env)
    w = case["world_size"]
    for rank in range(w):
        s = rl.gloo_setup(plan, case["group"], rank, list(range(w)), w)
        assert [list(x) for x in zip(s.hosts, s.ports)] == case["expect"]
        assert [s.self_host, s.self_port] == case["expect"][rank]


@pytest.mark.unit
@pytest.mark.parametrize("case", VECTORS["defaults"], ids=lambda c: c["name"])
def test_defaults_match_the_vectors(rl, case):
    plan = rl.load_plan(case["env"])
    want = case["expect"]
    assert (plan.nproc_per_node, plan.slots, plan.gloo_base, plan.nccl_base) == \
        (want["nproc_per_node"], want["slots"], want["gloo_base"], want["nccl_base"])


@pytest.mark.unit
def test_subgroup_uses_the_global_ranks_of_its_members(rl):
    plan = rl.load_plan({"HPCT_HOSTS": "10.0.0.1,10.0.0.2", "N_PROC_PER_NODE": "2"})
    # Members 1 and 2 of a 4-rank world: group ranks 0 and 1, group index 3.
    s = rl.gloo_setup(plan, 3, 1, [1, 2], 4)
    assert list(zip(s.hosts, s.ports)) == [("10.0.0.1", 12000 + 3 * 2 + 1), ("10.0.0.2", 12006)]
    assert (s.self_host, s.self_port, s.group_index) == ("10.0.0.2", 12006, 3)
    assert s.connect_timeout == 300.0 and s.generation == 0


# ------------------------------------------------------------ the switch and the variables

@pytest.mark.unit
@pytest.mark.parametrize("value,expect", [(None, False), ("", False), ("0", False), ("1", True)])
def test_switch(rl, value, expect):
    env = {} if value is None else {"HPCT_USE_ROOTLESS": value}
    assert rl.enabled(env) is expect


@pytest.mark.unit
@pytest.mark.parametrize("value", ["yes", "true", "2", "on"])
def test_switch_rejects_anything_but_0_or_1(rl, value):
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.enabled({"HPCT_USE_ROOTLESS": value})
    _error_names(err.value, "HPCT_USE_ROOTLESS", "0 or 1")


@pytest.mark.unit
@pytest.mark.parametrize("env,names", [
    ({"HPCT_PORT_SLOTS": "0"}, ["HPCT_PORT_SLOTS"]),
    ({"HPCT_PORT_BASE": "80"}, ["HPCT_PORT_BASE"]),
    ({"TORCH_GLOO_GET_PORT_BASE": "7000x"}, ["TORCH_GLOO_GET_PORT_BASE", "integer"]),
    ({"TORCH_GLOO_GET_PORT_BASE": "65530"}, ["TORCH_GLOO_GET_PORT_BASE", "65535"]),
    ({"TORCH_GLOO_GET_PORT_BASE": "12000", "TORCH_NCCL_GET_PORT_BASE": "12004"},
     ["TORCH_NCCL_GET_PORT_BASE", "overlaps"]),
    ({"N_PROC_PER_NODE": "4", "LOCAL_WORLD_SIZE": "8"}, ["LOCAL_WORLD_SIZE", "N_PROC_PER_NODE"]),
    ({"HPCT_CONNECT_TIMEOUT": "-1"}, ["HPCT_CONNECT_TIMEOUT"]),
    ({"HPCT_CONNECT_TIMEOUT": "nan"}, ["HPCT_CONNECT_TIMEOUT"]),
    ({"TORCH_DIST_INIT_BARRIER": "yes"}, ["TORCH_DIST_INIT_BARRIER"]),
    ({"HPCT_HOSTS": "a,,b"}, ["HPCT_HOSTS"]),
    ({"HPCT_HOSTS": "a,b,a"}, ["HPCT_HOSTS", "twice"]),
    ({"HPCT_HOSTS": "a", "HPCT_HOSTFILE": "/x"}, ["HPCT_HOSTS", "HPCT_HOSTFILE"]),
    ({"HPCT_HOSTFILE": "/nonexistent/hosts"}, ["HPCT_HOSTFILE"]),
], ids=lambda x: ",".join(x) if isinstance(x, dict) else None)
def test_bad_variables_fail_with_the_variable_and_the_fix(rl, env, names):
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.load_plan(env)
    _error_names(err.value, *names)


@pytest.mark.unit
def test_empty_values_count_as_unset(rl):
    plan = rl.load_plan({"HPCT_PORT_BASE": "", "N_PROC_PER_NODE": " ", "HPCT_HOSTS": ""})
    assert (plan.gloo_base, plan.nproc_per_node, plan.hosts) == (12000, 1, None)


@pytest.mark.unit
def test_hostfile_with_comments(rl, tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# the job's nodes\n10.0.0.1\n\n10.0.0.2  # node 1\n")
    plan = rl.load_plan({"HPCT_HOSTFILE": str(f), "N_PROC_PER_NODE": "2"})
    assert plan.hosts == ("10.0.0.1", "10.0.0.2")
    assert plan.host_list(4) == ("10.0.0.1", "10.0.0.2")


@pytest.mark.unit
def test_single_node_defaults_to_loopback(rl):
    plan = rl.load_plan({"LOCAL_WORLD_SIZE": "4"})
    assert plan.host_list(4) == ("127.0.0.1",)
    assert rl.load_plan({}).host_list(1) == ("127.0.0.1",)


@pytest.mark.unit
def test_multi_node_world_without_a_host_list(rl):
    plan = rl.load_plan({"N_PROC_PER_NODE": "8"})
    with pytest.raises(rl.RootlessConfigError) as err:
        plan.host_list(16)
    _error_names(err.value, "HPCT_HOSTS", "HPCT_HOSTFILE", "N_PROC_PER_NODE", "16")


@pytest.mark.unit
def test_world_size_that_does_not_fit_the_host_list(rl):
    plan = rl.load_plan({"N_PROC_PER_NODE": "2", "HPCT_HOSTS": "a,b"})
    assert plan.host_list(4) == ("a", "b")
    with pytest.raises(rl.RootlessConfigError) as err:
        plan.host_list(5)
    _error_names(err.value, "HPCT_HOSTS", "N_PROC_PER_NODE", "world size 5")


@pytest.mark.unit
def test_local_rank_must_follow_block_placement(rl):
    plan = rl.load_plan({"N_PROC_PER_NODE": "2", "HPCT_HOSTS": "a,b"})
    rl.check_rank_placement(plan, 3, {"LOCAL_RANK": "1"})
    rl.check_rank_placement(plan, 3, {})
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.check_rank_placement(plan, 3, {"LOCAL_RANK": "0"})
    _error_names(err.value, "LOCAL_RANK", "N_PROC_PER_NODE")


# ------------------------------------------------------------ rank and world size without a store

@pytest.mark.unit
def test_rank_and_world_size_from_the_arguments_need_no_master(rl):
    assert rl.resolve_rank_and_world_size(None, 1, 4, {}) == (1, 4)
    assert rl.resolve_rank_and_world_size("env://", 0, 2, {}) == (0, 2)


@pytest.mark.unit
def test_rank_and_world_size_from_the_environment(rl):
    env = {"RANK": "3", "WORLD_SIZE": "8"}       # no MASTER_ADDR / MASTER_PORT
    assert rl.resolve_rank_and_world_size("env://", -1, -1, env) == (3, 8)
    assert rl.resolve_rank_and_world_size(None, -1, -1, env) == (3, 8)
    assert rl.resolve_rank_and_world_size(None, 5, -1, env) == (5, 8)


@pytest.mark.unit
def test_rank_and_world_size_from_a_tcp_url(rl):
    url = "tcp://10.0.0.1:29500?rank=2&world_size=4"
    assert rl.resolve_rank_and_world_size(url, -1, -1, {"RANK": "0", "WORLD_SIZE": "9"}) == (2, 4)


@pytest.mark.unit
@pytest.mark.parametrize("env,names", [
    ({"WORLD_SIZE": "2"}, ["RANK", "rank"]),
    ({"RANK": "0"}, ["WORLD_SIZE"]),
    ({"RANK": "2", "WORLD_SIZE": "2"}, ["RANK", "0..1"]),
    ({"RANK": "x", "WORLD_SIZE": "2"}, ["RANK", "integer"]),
])
def test_missing_or_bad_rank_and_world_size(rl, env, names):
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.resolve_rank_and_world_size("env://", -1, -1, env)
    _error_names(err.value, *names)


@pytest.mark.unit
def test_other_init_methods_are_refused(rl):
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.resolve_rank_and_world_size("file:///tmp/x", 0, 1, {})
    _error_names(err.value, "env://", "HPCT_USE_ROOTLESS")


# ------------------------------------------------------------ the ephemeral port floor

@pytest.mark.unit
def test_block_below_the_floor_passes(rl):
    plan = rl.load_plan({"N_PROC_PER_NODE": "8"})           # gloo block 12000-12063
    rl.check_ephemeral_range(plan, (20000, 65535), set())


@pytest.mark.unit
def test_block_over_the_floor_fails_naming_the_variable_and_the_sysctl(rl):
    plan = rl.load_plan({"TORCH_GLOO_GET_PORT_BASE": "30000"})
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.check_ephemeral_range(plan, (20000, 65535), set())
    _error_names(err.value, "TORCH_GLOO_GET_PORT_BASE", "ip_local_port_range", "30000-30007")


@pytest.mark.unit
def test_reserved_block_passes(rl):
    plan = rl.load_plan({"TORCH_GLOO_GET_PORT_BASE": "30000"})
    rl.check_ephemeral_range(plan, (20000, 65535), set(range(30000, 30008)))
    with pytest.raises(rl.RootlessConfigError):
        rl.check_ephemeral_range(plan, (20000, 65535), set(range(30000, 30007)))


@pytest.mark.unit
def test_reserved_ports_syntax(rl):
    assert rl._parse_reserved("30000-30002,31000\n") == {30000, 30001, 30002, 31000}
    assert rl._parse_reserved("") == set()


@pytest.mark.unit
def test_kernel_values_are_read_when_not_given(rl, monkeypatch):
    reads = {"/proc/sys/net/ipv4/ip_local_port_range": "32768\t60999\n",
             "/proc/sys/net/ipv4/ip_local_reserved_ports": "40000-40007\n"}
    monkeypatch.setattr(rl, "_read_proc", reads.get)
    rl.check_ephemeral_range(rl.load_plan({"TORCH_GLOO_GET_PORT_BASE": "40000"}))
    with pytest.raises(rl.RootlessConfigError):
        rl.check_ephemeral_range(rl.load_plan({"TORCH_GLOO_GET_PORT_BASE": "41000"}))
    monkeypatch.setattr(rl, "_read_proc", lambda path: None)       # no /proc: nothing to check
    rl.check_ephemeral_range(rl.load_plan({"TORCH_GLOO_GET_PORT_BASE": "41000"}))


# ------------------------------------------------------------ group indices

@pytest.mark.unit
def test_counter_names_are_the_group_index(rl):
    assert rl.index_of_group("0") == 0
    assert rl.index_of_group("17") == 17


@pytest.mark.unit
def test_custom_or_hashed_name_without_an_index(rl):
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.index_of_group("my_group")
    _error_names(err.value, "group counter")


@pytest.mark.unit
def test_local_synchronization_without_a_slot_fails(rl):
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.take_local_sync_index("a3f9")
    _error_names(err.value, "use_local_synchronization", "group_index(N)")


@pytest.mark.unit
def test_local_synchronization_with_an_explicit_slot(rl):
    with rl.group_index(100):
        assert rl.take_local_sync_index("a3f9") == 100
        with rl.group_index(7):                           # the innermost wins
            assert rl.take_local_sync_index("b001") == 7
    assert rl.index_of_group("a3f9") == 100 and rl.index_of_group("b001") == 7
    with pytest.raises(rl.RootlessConfigError):           # the context is gone
        rl.take_local_sync_index("c002")
    rl.forget_group("a3f9")
    with pytest.raises(rl.RootlessConfigError):
        rl.index_of_group("a3f9")


@pytest.mark.unit
@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
def test_group_index_must_be_a_non_negative_int(rl, bad):
    with pytest.raises(rl.RootlessConfigError):
        with rl.group_index(bad):
            pass


@pytest.mark.unit
def test_debug_wrapper_has_its_own_reserved_index(rl):
    rl.reserve_wrapper_index("0", 1)
    rl.reserve_wrapper_index("2", 3)
    assert (rl.index_of_group("0"), rl.index_of_group("0", wrapper=True)) == (0, 1)
    assert rl.index_of_group("2", wrapper=True) == 3
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.index_of_group("4", wrapper=True)
    _error_names(err.value, "TORCH_DISTRIBUTED_DEBUG")


@pytest.mark.unit
def test_debug_wrapper_of_a_local_synchronization_group_is_refused(rl):
    rl.check_local_sync_wrapper(False)
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.check_local_sync_wrapper(True)
    _error_names(err.value, "TORCH_DISTRIBUTED_DEBUG", "use_local_synchronization")


@pytest.mark.unit
def test_only_gloo_and_nccl_have_a_rootless_path(rl):
    rl.check_backends({"cpu": "gloo"})
    rl.check_backends({"cpu": "gloo", "cuda": "nccl"})      # NCCL: patches 0008-0011, tests/test_pytorch_nccl.py
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.check_backends({"cpu": "gloo", "cuda": "ucc"})
    _error_names(err.value, "ucc for cuda", "backend='gloo'", "HPCT_USE_ROOTLESS")


# ------------------------------------------------------------ generation across destroy and re-init

@pytest.mark.unit
def test_generation_starts_at_zero_or_hpct_generation(rl):
    assert rl.generation({}) == 0
    rl._generation = None
    assert rl.generation({"HPCT_GENERATION": "5"}) == 5


@pytest.mark.unit
def test_world_reset_advances_the_generation_and_forgets_indices(rl):
    assert rl.generation({}) == 0
    with rl.group_index(9):
        rl.take_local_sync_index("h")
    rl.reserve_wrapper_index("0", 1)
    assert rl.advance_generation() == 1
    assert rl.generation() == 1
    with pytest.raises(rl.RootlessConfigError):
        rl.index_of_group("h")
    with pytest.raises(rl.RootlessConfigError):
        rl.index_of_group("0", wrapper=True)
    plan = rl.load_plan({})
    assert rl.gloo_setup(plan, 0, 0, [0], 1).generation == 1


@pytest.mark.unit
def test_generation_wraps_below_two_to_the_31(rl):
    rl.set_generation(rl.MAX_GENERATION)
    assert rl.advance_generation() == 0


@pytest.mark.unit
@pytest.mark.parametrize("bad", [-1, 2 ** 31, "1", True])
def test_bad_generation(rl, bad):
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.set_generation(bad)
    _error_names(err.value, "generation")


@pytest.mark.unit
def test_bad_hpct_generation_names_the_variable(rl):
    with pytest.raises(rl.RootlessConfigError) as err:
        rl.generation({"HPCT_GENERATION": "-3"})
    _error_names(err.value, "HPCT_GENERATION")


@pytest.mark.unit
def test_placeholder_store_fails_every_operation_with_the_reason(rl):
    pytest.importorskip("torch.distributed")
    store = rl.placeholder_store()
    for op, call in (("set", lambda: store.set("k", "v")), ("get", lambda: store.get("k")),
                     ("add", lambda: store.add("k", 1)), ("wait", lambda: store.wait(["k"]))):
        with pytest.raises(RuntimeError) as err:
            call()
        assert f"{op}()" in str(err.value) and "HPCT_USE_ROOTLESS" in str(err.value)


@pytest.mark.unit
def test_the_placeholder_store_answers_through_cpp_after_its_caller_lets_go(rl):
    """torch keeps no Python reference to the default store: C++ (a PrefixStore, the NCCL
    watchdog) must still find the placeholder's methods, so the module keeps the one instance."""
    import gc
    dist = pytest.importorskip("torch.distributed")
    store = dist.PrefixStore("default_pg/", rl.placeholder_store())
    gc.collect()
    with pytest.raises(RuntimeError) as err:
        store.get("any")
    assert "HPCT_USE_ROOTLESS" in str(err.value)
    assert rl.placeholder_store() is rl.placeholder_store()


@pytest.mark.slow
def test_series_changes_the_expected_units():
    # The out-of-tree wheel builds all of them but init.cpp (the bindings of torch._C, which the
    # wheel's src/torch_c10d/bindings.cpp stand in for).
    assert changed_units() == ["torch/csrc/distributed/c10d/GlooDeviceFactory.cpp",
                               "torch/csrc/distributed/c10d/ProcessGroupGloo.cpp",
                               "torch/csrc/distributed/c10d/init.cpp",
                               "torch/csrc/distributed/c10d/NCCLUtils.cpp",
                               "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp"]


# hpct-build wheel torch=2.6.0 compiles and links the other changed units for real, and
# tests/test_patched_torch.py runs them; init.cpp is compiled only by a full source build.
IN_TREE_ONLY = ["torch/csrc/distributed/c10d/init.cpp"]


@pytest.mark.slow
@pytest.mark.parametrize("unit", IN_TREE_ONLY)
def test_changed_unit_compiles_against_torch_2_6_0_and_the_patched_gloo(compile_env, patched_tree, unit):
    started = time.monotonic()
    proc = compile_unit(patched_tree, unit, GLOO_PATCHED, compile_env)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, f"{unit} does not compile:\n{proc.stderr[-6000:]}"
    print(f"{unit}: compiled in {elapsed:.1f} s")


@pytest.mark.slow
def test_the_compile_check_sees_the_gloo_api(compile_env, patched_tree):
    """Against the *pristine* Gloo headers the storeless/abort calls must fail: the check is real."""
    proc = compile_unit(patched_tree, "torch/csrc/distributed/c10d/ProcessGroupGloo.cpp", GLOO_PRISTINE,
                        compile_env)
    assert proc.returncode != 0
    assert "StorelessOptions" in proc.stderr or "connectFullMeshStoreless" in proc.stderr, proc.stderr[-3000:]
