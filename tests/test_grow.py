"""Grow (hd.grow, issue 18 item 2): joiners enter a running job at a step boundary."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from hpct.demo.agent import free_port_block
from util import forked_job

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]
WORKER = Path(__file__).with_name("grow_worker.py")


def test_two_members_admit_two_joiners_who_take_the_state_and_train(tmp_path):
    # N_PROC_PER_NODE = 4 (the agent's): one node holds the grown world's plan places 0..3.
    j = forked_job([sys.executable, str(WORKER), str(tmp_path)], 4, free_port_block(32), tmp_path,
                   time.monotonic() + 150, env={"HPCT_CONNECT_TIMEOUT": "30"})
    with j:
        for r in (0, 1):
            j.start(r, extra=["member"])
        for r in (0, 1):
            j.wait_file(tmp_path / f"boundary-{r}", 90)
        for r in (2, 3):
            j.start(r, generation=1, extra=["joiner"])
        (tmp_path / "go").write_text("")
        assert j.wait_all() == {r: 0 for r in range(4)}, "\n".join(j.output(r) for r in range(4))
    got = [json.loads((tmp_path / f"grow-{r}.json").read_text()) for r in range(4)]
    for f in got[:2]:
        assert f["same_size"].startswith("HpctArgumentError: grow: world_size=2 must be an integer above"), f
        assert "joiner rank 4 (plan place 4) has no address in the plan, nothing changed" in f["no_address"], f
        assert f["still_two"] == 2.0
    assert len({f["state_at_join"] for f in got}) == 1          # the joiners took the members' state
    assert len({f["final"] for f in got}) == 1                  # and train in step with them
    assert all(f["world"] == 4 and f["generation"] == 1 for f in got)
    print({r: {k: round(f[k], 3) for k in ("admit_s", "state_s", "first_step_s")} for r, f in enumerate(got)})


def test_a_joiner_at_a_stale_generation_is_refused_naming_it(tmp_path):
    rank_script = tmp_path / "stale.py"
    rank_script.write_text(
        "import hpct.distributed as hd, sys\n"
        "try:\n    hd.init_process_group(timeout=10.0)\n"
        "except hd.HpctError as err:\n    print('REFUSED', err); sys.exit(0)\n"
        "sys.exit(1)\n")
    # Members already at generation 1 (after a grow or a recovery); the joiner comes at 0.
    member = tmp_path / "member.py"
    member.write_text(
        "import hpct.distributed as hd, time, sys, pathlib\n"
        "hd.init_process_group(timeout=10.0)\n"
        "pathlib.Path(sys.argv[1], 'up').write_text('')\n"
        "time.sleep(8)\n")
    j = forked_job([sys.executable], 3, free_port_block(24), tmp_path, time.monotonic() + 60,
                   env={"HPCT_CONNECT_TIMEOUT": "4"})
    with j:
        j.start(0, generation=1, extra=[str(member), str(tmp_path)])
        j.start(1, generation=1, extra=[str(member), str(tmp_path)])
        j.start(2, generation=0, extra=[str(rank_script)])
        assert j.procs[2].wait(timeout=40) == 0, j.output(2)
        text = j.output(2)
    assert "REFUSED" in text and "generation 0 is older than a peer's (1)" in text, text
