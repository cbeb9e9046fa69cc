"""A worker that `hpct run` forks from its fork server, whose first op runs on the NCCL engine over
the simulated library and CUDA runtime (hpct/testing/nccl_sim; tests/test_nccl_sim_forked.py).

    hpct run --nproc-per-node 2 tests/forked_engine_worker.py OUT

Before anything else it records what it inherited from the server: whether torch marked it a bad
fork (the server asked CUDA something: its first CUDA op would raise "Cannot re-initialize CUDA in
forked subprocess"; only a torch built with CUDA can tell), whether CUDA was initialised, and
whether hpct's backend was imported already (registering it asks CUDA whether it sees a GPU).
Then one all_reduce, and OUT/worker-<rank>.json.
"""

import json
import os
import sys
from pathlib import Path

import torch

inherited = {"bad_fork": torch.cuda._is_in_bad_fork(), "cuda_initialized": torch.cuda.is_initialized(),
             "backend_imported": "hpct.distributed" in sys.modules, "cuda_built": torch.backends.cuda.is_built()}

from hpct.testing import nccl_sim  # noqa: E402  (after the facts above: it imports hpct.distributed)

nccl_sim.install()
import torch.distributed as dist  # noqa: E402

import hpct.distributed as hd  # noqa: E402

hd.init_process_group(timeout=60)
rank = dist.get_rank()
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)               # the worker's first op on the NCCL engine
out = Path(sys.argv[1]) / f"worker-{rank}.json"
out.with_suffix(".tmp").write_text(json.dumps({**inherited, "rank": rank, "pid": os.getpid(), "sum": t.tolist()}))
out.with_suffix(".tmp").replace(out)
dist.barrier()
hd.shutdown_all()
