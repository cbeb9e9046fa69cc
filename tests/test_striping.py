"""Striping over k connections per peer pair (hpct.distributed.training.striping, issue 18 item 6)."""

from __future__ import annotations

import json

import pytest

from util import run_rank_script

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = pytest.mark.serial

RANK = r'''
import json, os, sys
import torch, torch.distributed as dist
import hpct.distributed as hd
from hpct.distributed.training.striping import StripedGroup
out = sys.argv[1]
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
hd.init_process_group(timeout=60.0)
facts = {}
sg = StripedGroup(4)
# integers: exact whatever the split; 1001 values do not divide by 4 (a short last stripe)
a = torch.arange(1001, dtype=torch.int64) * (rank + 1)
want = torch.arange(1001, dtype=torch.int64) * sum(range(1, n + 1))
facts["int_sum_exact"] = bool(torch.equal(sg.all_reduce(a), want))
b = torch.full((3, 7), float(rank))
facts["max_exact"] = bool(torch.equal(sg.all_reduce(b, op=dist.ReduceOp.MAX), torch.full((3, 7), float(n - 1))))
c = torch.randn(5000, generator=torch.Generator().manual_seed(rank)) if rank == 1 else torch.zeros(5000)
sg.broadcast(c, src=1)
facts["broadcast"] = c[:4].tolist()
f = torch.randn(4097, generator=torch.Generator().manual_seed(10 + rank))
facts["float_sum_bytes"] = sg.all_reduce(f).view(torch.int32).sum().item()
tiny = torch.ones(2)                       # fewer values than stripes
facts["tiny"] = sg.all_reduce(tiny).tolist()
try:
    sg.all_reduce(torch.ones(4, 4).t())
except hd.HpctArgumentError as err:
    facts["noncontig"] = str(err)
sg.destroy()
open(os.path.join(out, f"facts-{rank}.json"), "w").write(json.dumps(facts))
hd.shutdown_all()
'''


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_striped_collectives_are_exact_and_identical_on_every_member(tmp_path, world):
    codes, outputs = run_rank_script(tmp_path, RANK, [str(tmp_path)], world, 120)
    assert codes == {r: 0 for r in range(world)}, "\n".join(outputs)
    facts = [json.loads((tmp_path / f"facts-{r}.json").read_text()) for r in range(world)]
    for f in facts:
        assert f["int_sum_exact"] and f["max_exact"], f
        assert f["tiny"] == [float(world)] * 2
        assert "must be contiguous" in f["noncontig"]
    assert len({json.dumps(f["broadcast"]) for f in facts}) == 1
    assert len({f["float_sum_bytes"] for f in facts}) == 1        # the same bits on every member


@pytest.mark.unit
@pytest.mark.parametrize("k", [0, 65, 2.5])
def test_a_bad_stripe_count_is_named(k):
    from hpct.distributed.training.striping import StripedGroup
    from hpct.errors import HpctArgumentError
    with pytest.raises(HpctArgumentError, match=r"k=.* must be an integer from 1 to 64"):
        StripedGroup(k)
