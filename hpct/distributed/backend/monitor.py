"""A monitored barrier for hpct groups (torch's ``dist.monitored_barrier`` accepts only Gloo groups).

Group rank 0 waits, up to ``timeout``, for a message from every other rank, then releases
them; a rank that has not arrived by then is named in the error, on rank 0, as Gloo's
monitored barrier does ("Rank 1 failed to pass monitoredBarrier in 500 ms").  A missing
rank is a fault: rank 0 then aborts the group, so every waiting rank fails at once instead
of waiting for its own timeout, and the caller recovers (``hpct.distributed.recover``).

The messages use two tags above every tag an application is expected to use (tags are
per pair, so they never meet a collective).
"""

from __future__ import annotations

import datetime
import time

import torch

from ...errors import CollectiveError

ARRIVE_TAG = (1 << 30) + 17
RELEASE_TAG = (1 << 30) + 18
POLL_S = 0.005


def _seconds(timeout, pg) -> float:
    if timeout is None:
        return float(pg.context.timeout)
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def monitored_barrier(pg, timeout=None, wait_all_ranks: bool = False) -> None:
    """Block until every rank of ``pg`` arrived, or fail naming the ranks that did not."""
    seconds = _seconds(timeout, pg)
    rank, size = pg.rank(), pg.size()
    token = torch.zeros(1, dtype=torch.uint8)
    if size == 1:
        return
    if rank != 0:
        arrive = pg.send([token], 0, ARRIVE_TAG)
        release = pg.recv([torch.zeros(1, dtype=torch.uint8)], 0, RELEASE_TAG)
        try:
            arrive.wait(datetime.timedelta(seconds=seconds))
            release.wait(datetime.timedelta(seconds=seconds))
        except CollectiveError as err:
            raise CollectiveError(f"hpct monitored_barrier: rank {rank} was not released by rank 0 within "
                            f"{seconds:g} s (rank 0 found a rank missing, or is itself lost): {err}") from None
        return
    works = {r: pg.recv([torch.zeros(1, dtype=torch.uint8)], r, ARRIVE_TAG) for r in range(1, size)}
    deadline = time.monotonic() + seconds
    pending = dict(works)
    while pending and time.monotonic() < deadline:
        for r, w in list(pending.items()):
            if w.is_completed():           # starts the Work's own bounded waiter
                if not w.is_success():
                    raise CollectiveError(f"hpct monitored_barrier: waiting for rank {r} failed: {w.exception()}")
                del pending[r]
        if pending:
            time.sleep(POLL_S)
    if pending:
        missing = sorted(pending)
        ms = int(seconds * 1000)
        # Gloo names the first rank (in rank order) that did not arrive, or all of them.
        named = (f"Ranks {', '.join(map(str, missing))}" if wait_all_ranks
                 else f"Rank {missing[0]}")
        message = f"hpct monitored_barrier: {named} failed to pass monitoredBarrier in {ms} ms"
        pg.abort(message)        # a missing rank is a fault: peers fail now, not at their timeout
        raise CollectiveError(message)
    for r in range(1, size):
        pg.send([token], r, RELEASE_TAG).wait(datetime.timedelta(seconds=seconds))
