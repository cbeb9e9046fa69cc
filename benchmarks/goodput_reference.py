"""The soak's fault-free reference digest, kept between runs.

benchmarks/goodput.py checks each system's final parameters against a fault-free stock run of the
same job.  That run is as long as the job itself (on 2 cores, 16 workers are CPU-bound even without
``--step-time``): a 30-minute soak paid 30 minutes more for it.  The digest depends only on what
this key hashes: examples/ddp.py's bytes (the model, the data, the seed), torch's version (its
kernels and Gloo's reduction order), the world's shape and the number of steps.  So a second soak
of the same job takes it from ``$XDG_CACHE_HOME/hpct/goodput-reference/<key>.json`` (default
``~/.cache``), and says so; ``--fresh-reference`` runs it again.  Only a clean run is stored: no
error and one digest over every rank.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

SCHEMA = 1


def folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpct" / "goodput-reference"


def key(script: Path, torch_version: str, nodes: int, nproc: int, steps: int) -> str:
    h = hashlib.sha256()
    h.update(script.read_bytes())
    h.update(json.dumps({"schema": SCHEMA, "torch": torch_version, "nodes": nodes, "nproc": nproc,
                         "steps": steps}, sort_keys=True).encode())
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


def cached_result(digests: list[str]) -> dict:
    """A stand-in for run()'s result, with the fields the report and the clean-up read."""
    return {"system": "stock", "folder": "(cached)", "error": None, "wall_s": 0.0, "digests": digests,
            "tmp": None, "cached": True}
