"""recv from any source, as ProcessGroupGloo has it (issue 20, item 2).

``dist.recv(t)`` without ``src`` returns the sender's rank, ``irecv`` without ``src`` names it
through the Work once waited for, and messages from several senders each reach one receive,
whatever order the senders run in; a CUDA tensor (NCCL has no any-source receive) and several
tensors are refused at the call.
"""

from __future__ import annotations

import json

import pytest

from util import run_rank_script

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]

WORLD = 4

RANK = r'''
import json, os, sys, time
import torch, torch.distributed as dist
import hpct.distributed as hd

rank, out = int(os.environ["RANK"]), sys.argv[1]
hd.init_process_group(timeout=30)
res = {}
if rank == 0:
    got = []
    for _ in range(3):                       # one message from each other rank, any order
        t = torch.zeros(2, dtype=torch.int64)
        src = dist.recv(t)
        got.append([src, t.tolist()])
    t = torch.zeros(1)
    work = dist.irecv(t, tag=1)              # the Work names the sender once waited for
    work.wait()
    got.append([work._source_rank(), t.tolist()])
    res["got"] = got
    try:
        dist.group.WORLD.recv_anysource([torch.zeros(1), torch.zeros(1)], 0)
    except Exception as err:
        res["several"] = f"{type(err).__name__}: {err}"
else:
    time.sleep(0.2 * (NRANKS - rank))         # rank 3 first, then 2, then 1
    dist.send(torch.tensor([rank, 10 * rank]), 0)
    if rank == 2:
        dist.send(torch.tensor([42.0]), 0, tag=1)   # its own tag: a tag-0 receive could take it
with open(os.path.join(out, f"res-{rank}.json"), "w") as f:
    json.dump(res, f)
dist.barrier()
hd.shutdown_all()
'''.replace("NRANKS", str(WORLD))


def test_recv_from_any_source_names_each_sender(tmp_path):
    codes, outputs = run_rank_script(tmp_path, RANK, [str(tmp_path)], WORLD, 90, env={"HPCT_CONNECT_TIMEOUT": "30"})
    assert codes == {r: 0 for r in range(WORLD)}, "\n".join(outputs)
    res = json.loads((tmp_path / "res-0.json").read_text())
    got = res["got"]
    assert sorted(map(tuple, (tuple(g[1]) for g in got[:3]))) == [(1, 10), (2, 20), (3, 30)]
    assert all(src == values[0] for src, values in got[:3]), got      # each sender named rightly
    assert got[3] == [2, [42.0]]
    assert "requires a single-element tensor list" in res["several"], res
