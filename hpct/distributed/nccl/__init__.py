"""The CUDA half of the ``hpct`` backend: NCCL driven through ctypes, one engine per group.

Its parts (``engine.py`` wires them; docs/gpu.md states the rules and the fault model):

- ``library.py``: libnccl through ctypes (function table, errors, the rootless init, the
  abort flag); ``find.py``: which libnccl a process uses;
- ``device.py``: the CUDA runtime as the engine sees it (raw stream handles, a pool of
  driver events, thread-local capture mode for the helper threads);
- ``comm.py``: one communicator and the rules for calling into it (one lock per comm, abort
  only under it, a held call woken by the abort flag first);
- ``ops.py``: the op bodies; ``work.py``: Work and the engine's errors;
- ``watchdog.py``: the two helper threads, which only poll and raise the abort flag.

Importing this package imports neither torch nor a libnccl (``hpct doctor`` reads ``find``
and ``library`` on machines without either).
"""
