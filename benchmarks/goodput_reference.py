"""The soak's fault-free reference digest, kept between runs.

benchmarks/goodput.py checks each system's final parameters against a fault-free stock run of the
same job.  That run is as long as the job itself (on 2 cores, 16 workers are CPU-bound even without
``--step-time``): a 30-minute soak paid 30 minutes more for it.  The digest depends only on what
this key hashes: examples/ddp.py's bytes (the model, the data, the seed), torch's version (its
kernels and Gloo's reduction order), the world's shape, the number of steps and the reduction
order of the run (``order``).  So a second soak of the same job takes it from
``$XDG_CACHE_HOME/hpct/goodput-reference/<key>.json`` (default ``~/.cache``), and says so;
``--fresh-reference`` runs it again.  Only a clean run is stored: no error and one digest over
every rank.

hpct's small float all_reduce is Gloo's ring below HPCT_LOG_ALLREDUCE ranks (16 by default) and
recursive doubling from there (docs/distributed.md): from that size on, hpct's fault-free run
ends with other bits than stock's, so hpct is checked against a fault-free run of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

SCHEMA = 2


def order(system: str, world: int, env=os.environ) -> str:
    """The reduction order a system's job of ``world`` ranks sums its gradients in: stock's ring
    ("gloo"), or hpct's recursive doubling ("hpct-log<N>") from the group size HPCT_LOG_ALLREDUCE
    (0: never).  Runs of one order end with the same bits."""
    if system != "hpct":
        return "gloo"
    from hpct.config import Config
    cfg = Config.from_mapping({k: v for k, v in env.items() if k == "HPCT_LOG_ALLREDUCE"})
    return f"hpct-log{cfg.log_allreduce_from}" if cfg.float_doubling(world) else "gloo"


def folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpct" / "goodput-reference"


def key(script: Path, torch_version: str, nodes: int, nproc: int, steps: int, reduction: str = "gloo") -> str:
    h = hashlib.sha256()
    h.update(script.read_bytes())
    h.update(json.dumps({"schema": SCHEMA, "torch": torch_version, "nodes": nodes, "nproc": nproc,
                         "steps": steps, "order": reduction}, sort_keys=True).encode())
    return h.hexdigest()[:24]


def load(k: str) -> list[str] | None:
    """The stored digests of this key, or None (no entry, or one that does not read back whole)."""
    try:
        doc = json.loads((folder() / f"{k}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("key") != k:
        return None
    digests = doc.get("digests")
    return digests if isinstance(digests, list) and len(digests) == 1 else None


def store(k: str, result: dict) -> bool:
    """Keep a clean reference run's digest (written to a temporary file, then renamed)."""
    if result.get("error") is not None or len(result.get("digests") or []) != 1:
        return False
    folder().mkdir(parents=True, exist_ok=True)
    tmp = folder() / f"{k}.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"key": k, "digests": result["digests"], "wall_s": result.get("wall_s")}) + "\n")
    os.replace(tmp, folder() / f"{k}.json")
    return True


def cached_result(digests: list[str], system: str = "stock") -> dict:
    """A stand-in for run()'s result, with the fields the report and the clean-up read."""
    return {"system": system, "folder": "(cached)", "error": None, "wall_s": 0.0, "digests": digests,
            "tmp": None, "cached": True}
