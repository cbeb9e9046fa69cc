"""torch's reconfigure API on the hpct backend (issue 28, item 2): hpct's own cases.

One job of 4 rootless ranks (tests/reconfigure_worker.py) goes through bad input, a shrink by a
set of handles, a subgroup over the shrunk world, a grow, abort() and its hooks, an op timeout
and its hooks, a member that never calls and a member that dies.  It runs on every torch the
suite runs on (before 2.14 the group's reconfigure() is called directly); PyTorch's own suite
runs in test_fault_tolerance.py on torch >= 2.14.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from hpct.demo.agent import free_port_block
from util import forked_job
from util import REPO

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = pytest.mark.serial

WORKER = REPO / "tests" / "reconfigure_worker.py"
SIM_RUN = REPO / "tests" / "nccl_sim_run.py"
DEADLINE = 180.0


@pytest.fixture(scope="module", params=["gloo", pytest.param("nccl_sim", marks=pytest.mark.nccl_sim)])
def res(request, tmp_path_factory) -> list[dict]:
    """The job's results; "nccl_sim": the same job with every op on the NCCL engine over the
    simulated library (hpct/testing/nccl_sim), so a reconfigure also rebuilds the NCCL engine."""
    out = tmp_path_factory.mktemp(f"reconfigure-{request.param}")
    argv = [str(WORKER)] if request.param == "gloo" else [str(SIM_RUN), "-m", "reconfigure_worker"]
    job = forked_job([sys.executable, *argv, str(out), str(out / "store")], 4, free_port_block(8 * 4), out,
                     time.monotonic() + DEADLINE, env={"HPCT_CONNECT_TIMEOUT": "30"})
    with job:
        job.start_all()
        codes = job.wait_all()
        logs = [job.output(r) for r in range(4)]
    assert codes == {r: 0 for r in range(4)}, "\n".join(logs)
    return [json.loads((out / f"res-{r}.json").read_text()) for r in range(4)]


def steps(r: dict) -> dict:
    return {name: rest for name, *rest in r["steps"]}


@pytest.mark.multiprocess
def test_bad_input_is_refused_by_name_and_changes_nothing(res):
    for r, got in enumerate(res):
        assert got["supports"] is True
        assert "is not an hpct reconfigure handle" in got["not_a_handle"]
        assert "this process's handle" in got["without_me"] and "is not among the 3 handles" in got["without_me"]
        assert "name the same process" in got["twice"]
        assert "is of another job" in got["other_job"]
        assert "hpct reconfigures the default group only" in got["subgroup"]
        for name in ("not_a_handle", "without_me", "twice", "other_job", "subgroup"):
            assert got[name].startswith("HpctArgumentError: hpct reconfigure refused, nothing changed"), got[name]
        # nothing changed: the same world, same generation, all four in the sum
        assert steps(got)["after_refusals"] == [r, 4, 10.0, 0]


@pytest.mark.multiprocess
def test_shrink_by_a_set_ranks_follow_the_plan_and_subgroups_use_the_new_world(res):
    for r in (0, 2, 3):
        rank, size, total, gen = steps(res[r])["shrunk"]
        assert (rank, size, total, gen) == ({0: 0, 2: 1, 3: 2}[r], 3, 1.0 + 3.0 + 4.0, 1)
    assert res[0]["subgroup_sum"] == res[2]["subgroup_sum"] == 1.0 + 3.0
    assert "subgroup_sum" not in res[3]
    for r in (0, 2, 3):
        assert "uuid 10 already used" in res[r]["reused_uuid"]
        assert "the handles are of generation 0 or older, but this group is at generation 1" in res[r]["stale_handles"]


@pytest.mark.multiprocess
def test_grow_abort_and_timeout_hooks_then_recovery(res):
    # someone's timer fired: the op timeout is what failed the group
    assert "ErrorType.TIMEOUT" in [got.get("error_after_timeout") for got in res[1:]], res
    for r, got in enumerate(res):
        s = steps(got)
        assert s["grown"][:3] == [r, 4, 10.0]
        assert got["abort_hook"] == ["abort"]
        assert got["error_after_abort"] == "ErrorType.SUCCESS"
        assert "aborted" in got["op_after_abort"]
        assert s["after_abort"][:3] == [r, 4, 10.0]
        assert s["after_timeout"][:3] == [r, 4, 10.0]
        if r != 0:
            assert got["timeout_hook"] is True, got
            # This rank's own timer, or (on a loaded machine) a peer whose timer fired first
            # and closed the link: get_error() agrees with what the op said.
            wait = got["timed_out_wait"]
            if got["error_after_timeout"] == "ErrorType.TIMEOUT":
                # CollectiveError (Gloo engine) or its NcclOpTimeoutError (NCCL engine)
                assert "Timed out waiting 1500ms" in wait or \
                    "did not complete within the op timeout (1.5 s)" in wait, wait
            else:
                assert got["error_after_timeout"] == "ErrorType.REMOTE_ERROR", got
                assert "PeerError" in wait or "ncclRemoteError" in wait, wait
        # every reconfigure moves to a newer generation
        gens = [g for *_, g in got["steps"]]
        assert gens == sorted(gens)


@pytest.mark.multiprocess
def test_a_missing_member_fails_at_the_deadline_and_a_dead_one_is_left_out(res):
    for r in (0, 1, 2):
        got = res[r]
        assert got["missing_member"].startswith("RendezvousError"), got["missing_member"]
        assert "the reconfigure's timeout=1 s" in got["missing_member"]
        assert got["missing_member_s"] < 5.0
        assert "has no members: its last reconfigure failed" in got["op_before_reconfigure"]
        assert steps(got)["after_missing"][:3] == [r, 4, 10.0]
        # Gloo's PeerError, or NCCL's ncclRemoteError, inside a CollectiveError (or its NCCL subclass)
        assert "PeerError" in got["op_with_dead_peer"] or "ncclRemoteError" in got["op_with_dead_peer"]
        assert got["error_after_peer_loss"] in ("ErrorType.REMOTE_ERROR", "ErrorType.COMM_ERROR")
        assert steps(got)["without_dead"][:3] == [r, 3, 6.0]
