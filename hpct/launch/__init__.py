"""``hpct run``: a torchrun-compatible launcher whose node agents replace a lost worker in place.

One agent per node starts the node's workers, agrees membership and generation with the other
agents over the port plan (no store, no root) and answers its workers' ``hd.recover()``.
"""
