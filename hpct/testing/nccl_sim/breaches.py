"""The rules of NCCL and CUDA the engine broke, as the simulated library and runtime saw them: each
breach is printed, recorded in ``BREACHES`` and fatal at the process's exit (exit code 86)."""

from __future__ import annotations

import atexit
import os
import sys
import threading

BREACHES: list[str] = []
_lock = threading.Lock()


class SimBreach(BaseException):
    """The engine broke a rule of NCCL or CUDA.  A BaseException, so that no ``except
    Exception`` in the engine (its watchdog's) can swallow it."""


def breach(text: str) -> SimBreach:
    with _lock:
        BREACHES.append(text)
    print(f"NCCL SIM BREACH: {text}", file=sys.stderr, flush=True)
    return SimBreach(text)


def _exit_on_breach() -> None:
    if BREACHES:
        print(f"NCCL SIM: {len(BREACHES)} breach(es) in this process:\n  " + "\n  ".join(BREACHES),
              file=sys.stderr, flush=True)
        os._exit(86)


atexit.register(_exit_on_breach)
