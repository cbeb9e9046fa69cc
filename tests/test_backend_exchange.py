"""all_to_all, gather and scatter move each pair's bytes point to point (issue 20, item 3).

Results equal ProcessGroupGloo's (tests/test_backend.py); here: sizes that two ranks disagree
on.  Only the pairs that disagree move nothing (Gloo patch 0020 drops the message), the rank
whose receive has the other size raises a ValueError naming both sizes, every other rank
completes with exact data, nobody waits for the op timeout, and the group goes on.
"""

from __future__ import annotations

import json

import pytest

from util import run_rank_script

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]

WORLD = 3
OP_TIMEOUT_S = 30          # a rank left waiting would take this long; the test allows a fraction

RANK = r'''
import json, os, sys, time
import torch, torch.distributed as dist
import hpct.distributed as hd

rank, out = int(os.environ["RANK"]), sys.argv[1]
hd.init_process_group(timeout=%(timeout)d)
res = {}


def outcome(name, fn):
    t0 = time.monotonic()
    try:
        value = fn()
        res[name] = {"ok": True, "value": value, "s": time.monotonic() - t0}
    except Exception as err:
        res[name] = {"ok": False, "error": f"{type(err).__name__}: {err}", "s": time.monotonic() - t0}
    dist.barrier()


def a2a():
    # rank 2 expects 2 rows from rank 0, which sends it 1: the 0 -> 2 pair disagrees
    inp = torch.arange(3, dtype=torch.float64) + 10 * rank
    out_splits = [2, 1, 1] if rank == 2 else [1, 1, 1]
    out = torch.full((sum(out_splits),), -1.0, dtype=torch.float64)
    dist.all_to_all_single(out, inp, out_splits, [1, 1, 1])
    return out.tolist()


def scatter_bad_root():
    # rank 0 expects 2 elements where the root (1) gives every rank 1 (the root's own call is
    # consistent: a root whose parts differ from its output is refused at the call, as by Gloo)
    out = torch.zeros(2 if rank == 0 else 1, dtype=torch.int64)
    ins = [torch.tensor([7]), torch.tensor([8]), torch.tensor([9])] if rank == 1 else None
    dist.scatter(out, ins, src=1)
    return out.tolist()


def scatter_big():
    # 800 kB to every rank where rank 0 expects half: the dropped message spans many of
    # Gloo's 64 KiB discard pieces, and the pair must be in step afterwards
    out = torch.zeros(50_000 if rank == 0 else 100_000, dtype=torch.int64)
    ins = [torch.arange(100_000) + j for j in range(3)] if rank == 1 else None
    dist.scatter(out, ins, src=1)
    return int(out.sum())


def gather_ok():
    out = [torch.zeros(2, dtype=torch.int32) for _ in range(3)] if rank == 0 else None
    dist.gather(torch.full((2,), rank, dtype=torch.int32), out, dst=0)
    return [t.tolist() for t in out] if out else None


def strided(values):
    # a (n, 2) view of a (2, n) tensor: not contiguous, so the op stages it
    return torch.tensor(values, dtype=torch.float64).reshape(2, -1).t()


def noncontiguous():
    # every form with strided inputs and outputs, checked against slices of the senders'
    # inputs rebuilt here; uneven splits put the parts at offsets other than k * part
    def mine(r):
        return strided([100 * r + i for i in range(12)])            # 6 rows
    splits = [1, 2, 3]
    out = torch.zeros(2, 3 * (rank + 1), dtype=torch.float64).t()
    dist.all_to_all_single(out, mine(rank), [rank + 1] * 3, splits)
    start = sum(splits[:rank])
    a2a = torch.equal(out, torch.cat([mine(r)[start:start + rank + 1] for r in range(3)]))

    outs = [torch.zeros(2, 2, dtype=torch.float64).t() for _ in range(3)]
    dist.all_to_all(outs, [strided([10 * rank + j + i for i in range(4)]) for j in range(3)])
    lists = all(torch.equal(outs[j], strided([10 * j + rank + i for i in range(4)])) for j in range(3))

    got = [torch.zeros(2, 2, dtype=torch.float64).t() for _ in range(3)] if rank == 0 else None
    dist.gather(strided([7 * rank + i for i in range(4)]), got, dst=0)
    gathered = rank != 0 or all(torch.equal(got[j], strided([7 * j + i for i in range(4)])) for j in range(3))

    part = torch.zeros(2, 2, dtype=torch.float64).t()
    dist.scatter(part, [strided([5 * j + i for i in range(4)]) for j in range(3)] if rank == 2 else None, src=2)
    scattered = torch.equal(part, strided([5 * rank + i for i in range(4)]))
    return {"all_to_all_single": a2a, "all_to_all": lists, "gather": gathered, "scatter": scattered}


outcome("a2a", a2a)
outcome("scatter", scatter_bad_root)
outcome("scatter_big", scatter_big)
outcome("gather", gather_ok)
outcome("noncontiguous", noncontiguous)
with open(os.path.join(out, f"res-{rank}.json"), "w") as f:
    json.dump(res, f)
dist.barrier()
hd.shutdown_all()
'''


def test_a_size_two_ranks_disagree_on_fails_only_there_and_at_once(tmp_path):
    codes, outputs = run_rank_script(tmp_path, RANK % {"timeout": OP_TIMEOUT_S}, [str(tmp_path)], WORLD, 120,
                                     env={"HPCT_CONNECT_TIMEOUT": "30"})
    assert codes == {r: 0 for r in range(WORLD)}, "\n".join(outputs)
    res = [json.loads((tmp_path / f"res-{r}.json").read_text()) for r in range(WORLD)]
    # all_to_all_single: rank 2's split from rank 0 is wrong; everything else arrives
    assert res[0]["a2a"] == {**res[0]["a2a"], "ok": True, "value": [0.0, 10.0, 20.0]}
    assert res[1]["a2a"] == {**res[1]["a2a"], "ok": True, "value": [1.0, 11.0, 21.0]}
    assert not res[2]["a2a"]["ok"]
    assert "all_to_all_single: an output split holds 16 bytes, received 8" in res[2]["a2a"]["error"], res[2]
    # scatter: the rank that expects another size raises; the root and rank 2 complete
    assert res[1]["scatter"] == {**res[1]["scatter"], "ok": True, "value": [8]}
    assert "scatter: the output tensor holds 16 bytes, received 8" in res[0]["scatter"]["error"]
    assert res[2]["scatter"] == {**res[2]["scatter"], "ok": True, "value": [9]}
    assert "scatter: the output tensor holds 400000 bytes, received 800000" in res[0]["scatter_big"]["error"]
    base = sum(range(100_000))
    assert [res[r]["scatter_big"].get("value") for r in (1, 2)] == [base + 100_000, base + 200_000]
    # the group is not failed by a size error: the next collective is exact
    assert res[0]["gather"]["value"] == [[0, 0], [1, 1], [2, 2]]
    # strided tensors everywhere are staged through contiguous copies and come out exact
    for r in range(WORLD):
        assert res[r]["noncontiguous"].get("value") == {"all_to_all_single": True, "all_to_all": True,
                                                         "gather": True, "scatter": True}, (r, res[r])
    for r in range(WORLD):
        for name in ("a2a", "scatter", "scatter_big", "gather"):
            assert res[r][name]["s"] < OP_TIMEOUT_S / 3, (r, name, res[r][name])
