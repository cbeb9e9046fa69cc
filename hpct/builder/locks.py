"""One hpct-build at a time per component tree.

Two hpct-builds on one checkout (two CI jobs, two terminals, two pytest-xdist
workers) would otherwise both fetch, patch or build the same component: the
second one's ``atomic_dir`` removes the first one's scratch folder as stale, and
its rename replaces a tree the first is still compiling against.  ``fetch``,
``patch`` and the builds therefore hold the component's lock while they look at
and replace its trees; whoever waited then finds the work done and reuses it.

The locks are ``flock`` locks on files under ``third_party/cache/locks``: the kernel
releases them when their holder exits however it exits, so a lock is never left
stale.  They are re-entrant within a process (a build holds its component's lock
around the fetch and the patch it calls), and every wait has a deadline.
"""

from __future__ import annotations

import fcntl
import functools
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from ..errors import BuildError

LOCK_WAIT_S = 3 * 3600.0     # a cold PyTorch build is the longest a waiter can need to wait
POLL_S = 0.5
_held: dict[str, tuple[int, int]] = {}     # lock path -> (fd, depth), for re-entry in this process
_guard = threading.Lock()


@contextmanager
def file_lock(path: Path, what: str, progress=None, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold the ``flock`` on ``path`` (created if missing) for the ``with`` body.

    ``what`` names the guarded work in the waiting line and in the timeout's message.
    """
    key = str(Path(path).absolute())
    with _guard:
        if key in _held:
            fd, depth = _held[key]
            _held[key] = (fd, depth + 1)
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield
        finally:
            _release(key)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        _acquire(fd, key, what, progress, wait_s)
    except BaseException:
        os.close(fd)
        raise
    with _guard:
        _held[key] = (fd, 1)
    try:
        yield
    finally:
        _release(key)


def _acquire(fd: int, path: str, what: str, progress, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if not told:
            told = True
            if progress is not None:
                progress.step(f"waiting for another hpct-build working on {what} (lock {path})")
        if time.monotonic() >= deadline:
            raise BuildError(f"another hpct-build has held the lock on {what} for over {wait_s:.0f} s ({path})",
                             fix=f"wait for it to finish, or stop it (`fuser {path}` names its process); "
                                 "the lock goes with the process that holds it")
        time.sleep(POLL_S)


def _release(key: str) -> None:
    with _guard:
        fd, depth = _held[key]
        if depth > 1:
            _held[key] = (fd, depth - 1)
            return
        del _held[key]
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def component_lock(layout, name: str, version: str, progress=None):
    """The lock that guards ``third_party/{src,patched,build}/<name>-<version>``."""
    return file_lock(layout.root / "third_party" / "cache" / "locks" / f"{name}-{version}.lock",
                     f"{name} {version}", progress)


F = TypeVar("F", bound=Callable)


def one_at_a_time(fn: F) -> F:
    """For ``fn(layout, manifest, progress, ...)``: run it under the component's lock."""
    @functools.wraps(fn)
    def locked(layout, m, progress, *args, **kwargs):
        with component_lock(layout, m.name, m.version, progress):
            return fn(layout, m, progress, *args, **kwargs)
    return locked  # type: ignore[return-value]
