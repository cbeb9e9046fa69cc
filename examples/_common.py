"""How examples/ddp.py and examples/fsdp2.py end, once they have trained: the process's record
written for whoever watches the job (the tests and benchmarks read it), then the process group
left the way its backend is left.  It sits beside them, so a script run by its path (hpct run,
torchrun, python) imports it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

import hpct.distributed as hd


def finish(out: str | None, rank: int, record: dict, backend: str) -> int:
    """Write ``record`` to ``out``/rank<rank>-pid<pid>.json (whole or not at all: a reader never
    sees half of one) when ``out`` is given, shut the backend down, and return the exit code."""
    if out:
        path = Path(out) / f"rank{rank}-pid{os.getpid()}.json"
        path.with_suffix(".tmp").write_text(json.dumps(record))
        path.with_suffix(".tmp").replace(path)
    if backend == "hpct":
        hd.shutdown_all()
    else:
        dist.destroy_process_group()
    return 0
