"""N ranks of the NCCL engine as threads of one process, over the simulated NCCL (hpct/testing/nccl_sim).

Each rank has its own engine and communicator; the data moves between them over loopback
exactly as between processes.  ``Ranks.run(fn)`` runs ``fn(rank, engine)`` on every rank at
once and returns the results in rank order (re-raising the first rank's error), failing the
test when a rank is still running at the deadline: nothing here may hang.
"""

from __future__ import annotations

import threading
import time

import pytest

from hpct.testing import nccl_sim
from hpct.distributed.nccl.engine import NcclEngine
from hpct.ports import free_port_block
from hpct.testing.nccl_sim.library import SimNccl
from hpct.testing.nccl_sim.runtime import SimRuntime


class Ranks:
    def __init__(self, n: int, *, lib: SimNccl | None = None, connect_timeout: float = 10.0,
                 op_timeout: float = 20.0, generation: int = 0, blocking: bool = False):
        self.n = n
        self.lib = lib or SimNccl()
        self.runtime = SimRuntime()
        base = free_port_block(n)
        addrs = [f"127.0.0.1:{base + r}" for r in range(n)]
        self.engines = [NcclEngine(rank=r, size=n, global_ranks=list(range(n)), generation=generation,
                                   group_index=0, group_name="sim", listen_addr=addrs[r], addresses=addrs,
                                   job_key=0x5157, connect_timeout=connect_timeout, op_timeout=op_timeout,
                                   retry_delay_ms=20, library=self.lib, runtime=self.runtime,
                                   blocking_comm=blocking)
                        for r in range(n)]

    def run(self, fn, timeout: float = 30.0, ranks=None) -> list:
        ranks = list(range(self.n)) if ranks is None else list(ranks)
        out: dict[int, object] = {}
        errors: dict[int, BaseException] = {}

        def body(r):
            try:
                out[r] = fn(r, self.engines[r])
            except BaseException as err:   # noqa: BLE001 -- handed to the test thread
                errors[r] = err
        threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"sim-rank-{r}") for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        stuck = [r for r, t in zip(ranks, threads) if t.is_alive()]
        if stuck:
            for e in self.engines:
                e.abort("the test's deadline passed")
            pytest.fail(f"ranks {stuck} still running after {timeout:g} s (a hang)")
        if errors:
            raise errors[min(errors)]
        return [out[r] for r in ranks]

    def comm(self, rank: int):
        """The simulated comm a rank's engine formed last (its calls, groups, state)."""
        return [c for c in self.lib.comms.values() if c.spec.listen_addr == self.engines[rank].listen_addr][-1]

    def close(self) -> None:
        for e in self.engines:
            e.shutdown(5.0)


def until(cond, seconds: float, what: str) -> None:
    """Wait for ``cond()``, failing the test with ``what`` after ``seconds``."""
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"{what} within {seconds:g} s")
        time.sleep(0.005)


@pytest.fixture
def no_breach():
    """Fails the test when the simulated library saw the engine break a rule."""
    before = len(nccl_sim.BREACHES)
    yield
    assert nccl_sim.BREACHES[before:] == []
