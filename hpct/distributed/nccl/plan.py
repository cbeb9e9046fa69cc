"""Where an NCCL engine listens and what it is called: the port plan's NCCL half, the job key.

``engine_for_group`` builds an engine from the Config and a group's facts (no GPU touched, no
socket opened): its rank listens on ``nccl_base + (slot mod S)*P + local rank`` of its node and
the ring's next is group rank + 1.  The job key hashes the same text as the patched torch
(``_hpct_rootless.job_key``), so both agree on a communicator's identity.
"""

from __future__ import annotations

import hashlib
import os
from typing import Sequence

def format_addr(host: str, port: int) -> str:
    """``host:port``, an IPv6 literal in brackets (what NCCL parses)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def job_key(cfg, run_id: str = "") -> int:
    """The 64-bit job key; the same text and hash as the patched torch (_hpct_rootless.job_key),
    so a patched ProcessGroupNCCL and this engine agree on a communicator's identity."""
    hosts = ",".join(cfg.hosts)
    text = "|".join(("hpct-nccl-job-1", f"run={run_id}", f"hosts={hosts}", f"nproc={cfg.nproc_per_node}",
                     f"slots={cfg.port_slots}", f"gloo={cfg.gloo_port_base}", f"nccl={cfg.nccl_port_base}"))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def nccl_addresses(cfg, slot: int, global_ranks: Sequence[int]) -> list[str]:
    """Each group member's NCCL listening address: hosts[r // P] : nccl_base + (slot mod S)*P + r % P."""
    from ...ports import host_of, port_of
    p = cfg.nproc_per_node
    return [format_addr(host_of(cfg.hosts, r, p), port_of(cfg.nccl_port_base, slot, r % p, p, cfg.port_slots))
            for r in global_ranks]


def engine_for_group(cfg, *, name: str, index: int, slot: int, group_rank: int, global_ranks: Sequence[int],
                     generation: int, op_timeout: float, run_id: str | None = None,
                     places: Sequence[int] | None = None, runtime=None, load=None):
    """An engine for one hpct group from the Config and the group's facts (no GPU touched)."""
    from .engine import NcclEngine
    addrs = nccl_addresses(cfg, slot, global_ranks if places is None else places)   # plan places (shrink)
    rid = os.environ.get("TORCHELASTIC_RUN_ID", "") if run_id is None else run_id
    return NcclEngine(rank=group_rank, size=len(global_ranks), global_ranks=list(global_ranks),
                      generation=generation, group_index=index, group_name=name,
                      listen_addr=addrs[group_rank], addresses=addrs, job_key=job_key(cfg, rid),
                      connect_timeout=cfg.connect_timeout, op_timeout=op_timeout,
                      retry_delay_ms=cfg.socket_retry_delay, runtime=runtime, load=load,
                      blocking_comm=cfg.nccl_blocking)


