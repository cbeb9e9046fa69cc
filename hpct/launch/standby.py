"""A warm standby: a Python process that has imported torch and waits to become a worker.

Started by the agent ahead of need (``--standby K``).  It blocks on one JSON line on stdin,
``{"argv": [...], "env": {...}, "cwd": ..., "log": ...}``, then takes that environment,
sends its output to the worker's log and runs the script in this interpreter (``-m`` too),
so a replacement costs neither an interpreter start nor ``import torch``.  End of input
without a line (the agent stopped) exits quietly.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def _warm(backend: bool = True) -> None:
    # What every worker of a PyTorch job imports first; CUDA is not initialised (the
    # worker's CUDA_VISIBLE_DEVICES applies when it first touches the GPU).
    import torch
    import torch.distributed  # noqa: F401
    if backend:
        # Registering hpct's backend asks torch whether it sees a GPU (cudaGetDeviceCount): the
        # standby's own CUDA, as it becomes the worker.  A fork server must not ask (forkserver.py).
        import hpct.distributed  # noqa: F401
    # torch's optimizers import torch._dynamo at their first construction: 2 s of a replacement's
    # start on a 2-core machine (measured by benchmarks/launch.py) unless the standby pays it.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def become(order: dict) -> None:
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    fd = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    argv = list(order["argv"])
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> int:
    _warm()
    print("ready", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    sys.stdin = open(os.devnull)
    become(json.loads(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
