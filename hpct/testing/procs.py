"""Process helpers for tests and benchmarks: a process's descendants and environment read from
/proc, and every process carrying a run's tag killed at the end of the run."""

from __future__ import annotations

import importlib.metadata
import os
import signal
from pathlib import Path


def _ppid_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(name))
    return kids


def descendants(roots: list[int]) -> list[int]:
    """Every process below ``roots`` now (children first, then theirs)."""
    kids, found, todo = _ppid_map(), [], list(roots)
    while todo:
        for child in kids.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def environ(pid: int) -> dict[str, str]:
    """A process's environment ({} once it is gone, or not readable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def kill_tagged(var: str, tag: str) -> None:
    """SIGKILL every process whose environment sets ``var`` to ``tag`` (a run's agents, standbys,
    workers and launchers, whatever session or namespace they run in), this one excepted."""
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid() and environ(int(name)).get(var) == tag:
            try:
                os.kill(int(name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


TAG_VAR = "BENCH_LAUNCH_TAG"      # the variable a benchmark's run marks every process it starts with


def torch_version() -> str:
    """The installed torch's version, as a run's report names it ("?" without torch)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "?"
