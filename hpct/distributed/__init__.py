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

One sub-package per concern (docs/architecture.md draws them and what each may import):
``backend/`` the facade torch sees and the Gloo engine, ``nccl/`` the NCCL engine,
``membership/`` who is in the world and in which generation, ``training/`` what training does
with the groups, ``diagnostics/`` where communication time goes.
"""

from __future__ import annotations

import sys

from ..errors import CollectiveError, HpctArgumentError, HpctError, ParityError
from .backend.group import BACKEND_NAME, HpctProcessGroup
from .backend.work import HpctWork
from .diagnostics import profile_comm as _profile_comm
from .diagnostics.profile_comm import CommProfile, profile_comm
from .membership import elastic, reconfigure
from .membership.admission import grow, membership_changed
from .membership.elastic import shrink
from .membership.recovery import init_process_group, recover
from .membership.slots import PlaceholderStore
from .membership.world import (abort_all, generation, group_monitored_barrier as monitored_barrier,
                               last_connect_seconds, live_groups, register, shutdown_all)
from .training import diloco, striping
from .training.parity import ParityReport, sync_state
from .training.state import broadcast_object, broadcast_state, healthy_source

# The modules users and docs import by their path from before the sub-packages
# (``from hpct.distributed.diloco import DiLoCo``): the same module objects, by their old names.
for _name, _module in {"diloco": diloco, "striping": striping, "profile_comm": _profile_comm}.items():
    sys.modules.setdefault(f"{__name__}.{_name}", _module)

register()
elastic.install()
reconfigure.install()

__all__ = ["BACKEND_NAME", "CollectiveError", "CommProfile", "HpctArgumentError", "HpctError", "HpctProcessGroup", "HpctWork",
           "ParityError", "ParityReport", "PlaceholderStore", "abort_all", "broadcast_object", "broadcast_state", "generation", "grow",
           "healthy_source", "init_process_group", "last_connect_seconds", "live_groups", "membership_changed",
           "monitored_barrier", "profile_comm", "recover", "shrink", "shutdown_all", "sync_state"]
