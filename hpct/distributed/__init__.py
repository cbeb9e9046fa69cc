"""hpct's c10d backend for stock PyTorch: rootless, TCPStore-less, abortable, recoverable.

Importing this module registers the ``hpct`` backend (CPU tensors) with
``torch.distributed``.  Two ways to start::

    import hpct.distributed as hd
    hd.init_process_group()                    # RANK/WORLD_SIZE + the port plan; no store
    # or, the documented torch form (the store is accepted and never used):
    torch.distributed.init_process_group("hpct", store=torch.distributed.HashStore(),
                                         rank=rank, world_size=world_size)

After a failure (an op raised ``CollectiveError``, an ``HpctError``), every survivor calls ``hd.recover()`` and a
replacement process starts with the same RANK and ``HPCT_GENERATION`` set to the survivors'
new generation; ``hd.broadcast_state(model, optimizer, src=hd.healthy_source(...))`` then
re-synchronises the state.  Without a replacement, the survivors go on with fewer ranks:
``torch.distributed.shrink_group([lost], group)`` or ``hd.shrink(...)`` (elastic.py); and
``hd.grow(new_size)`` admits joiners at a step boundary (admission.py);
``hd.sync_state(model, optimizer)`` finds and repairs a member whose state drifted (parity.py).
``hd.profile_comm(ddp_model)`` times DDP's gradient communication per step: how much of it
backward hid and how much was exposed (profile_comm.py, docs/diagnose.md).
docs/elastic.md says when to use which.
"""

from __future__ import annotations

from ..errors import CollectiveError, HpctArgumentError, HpctError, ParityError
from . import elastic, reconfigure
from .group import BACKEND_NAME, HpctProcessGroup
from .slots import PlaceholderStore
from .work import HpctWork
from .admission import grow, membership_changed
from .elastic import shrink
from .parity import ParityReport, sync_state
from .profile_comm import CommProfile, profile_comm
from .state import broadcast_object, broadcast_state, healthy_source
from .recovery import init_process_group, recover
from .world import (abort_all, generation, group_monitored_barrier as monitored_barrier, last_connect_seconds,
                    live_groups, register, shutdown_all)

register()
elastic.install()
reconfigure.install()

__all__ = ["BACKEND_NAME", "CollectiveError", "CommProfile", "HpctArgumentError", "HpctError", "HpctProcessGroup", "HpctWork",
           "ParityError", "ParityReport", "PlaceholderStore", "abort_all", "broadcast_object", "broadcast_state", "generation", "grow",
           "healthy_source", "init_process_group", "last_connect_seconds", "live_groups", "membership_changed",
           "monitored_barrier", "profile_comm", "recover", "shrink", "shutdown_all", "sync_state"]
