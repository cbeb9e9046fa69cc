"""``hpct demo``: rootless start-up, a lost rank, in-process recovery; timings next to stock PyTorch.

On this machine: N ranks train a small model with DistributedDataParallel on the ``hpct``
backend under ``hpct run`` (one agent; its workers forked from the node's fork server, the
default); one rank is SIGKILLed mid-step, hpct run forks its replacement at the next generation,
the survivors recover in-process and training ends with parameters bit-identical on every rank
and to a run without the fault.  The time from the kill to every rank's next step is what a user
lives through; it is printed beside stock PyTorch's way, a restart of every process.  Start-up
and the in-process recovery alone are also measured against stock (ProcessGroupGloo + TCPStore),
and one table is printed.  Every process has a deadline; the whole demo is bounded by --deadline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=4, help="ranks to start (default 4)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--fault-step", type=int, default=4, help="step at which a rank is killed")
    parser.add_argument("--deadline", type=float, default=110.0, help="seconds before the demo gives up")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs) and print its path")


def _params(out: Path, n: int):
    import torch
    return [torch.load(out / f"params-{r}.pt") for r in range(n)]


def _same(a, b) -> bool:
    import torch
    return a.keys() == b.keys() and all(
        a[k].reshape(-1).view(torch.uint8).equal(b[k].reshape(-1).view(torch.uint8)) for k in a)


def _how(why: str) -> str:
    """A start event's ``why`` without its pid: how hpct run started the process."""
    return {"forked": "forked from the node's fork server", "warm": "from a warm standby"}.get(
        why.split(":")[0], why)


def execute(args: argparse.Namespace) -> int:
    from .errors import HpctError
    if args.ranks < 2:
        raise HpctError("--ranks must be at least 2", fix="pass --ranks 2 or more")
    if not 0 <= args.fault_step < args.steps:
        raise HpctError("--fault-step must be below --steps", fix="e.g. --steps 10 --fault-step 4")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t_begin = time.monotonic()
    deadline = t_begin + args.deadline

    def on_alarm(*_):
        raise TimeoutError(f"hpct demo did not finish within --deadline {args.deadline:g} s")
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.deadline) + 1)
    work = Path(tempfile.mkdtemp(prefix="hpct-demo-"))
    n = args.ranks
    try:
        from .demo import launched
        line = launched.launcher_line(n)
        print(f"hpct demo: {n} ranks, DDP on the hpct backend under `{line}`, rank {n // 2} killed "
              f"at step {args.fault_step} of {args.steps}", flush=True)
        import warnings
        # torch warns once when numpy is absent; hpct does not use numpy (not a dependency)
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch  # noqa: F401  (after the banner: importing takes a moment)

        import hpct.distributed  # noqa: F401
        from .demo import measure as m
        ref = launched.run(work / "reference", n, args.steps, None, deadline)
        job = launched.run(work / "fault", n, args.steps, args.fault_step, deadline)
        ps, ref_ps = _params(work / "fault", n), _params(work / "reference", n)
        identical = all(_same(p, ps[0]) for p in ps) and _same(ps[0], ref_ps[0])
        first = job.first_pids()
        same_pids = all(any(r["pid"] == pid for r in job.records if r["rank"] == rank)
                        for rank, pid in first.items() if rank != job.victim)
        [replaced] = [e for e in job.starts() if e["generation"] > 0] or [{"why": "not replaced"}]
        how = _how(replaced["why"])
        connect_ms = max((next(e["t"] for e in r["events"] if e["what"] == "connected") -
                          next(e["t"] for e in r["events"] if e["what"] == "start")) * 1000
                         for r in ref.records)
        resume_s = job.resumed_s()
        print(f"  training: done; rank {job.victim}'s replacement {how}; survivors kept their processes: "
              f"{'yes' if same_pids else 'NO'}; final parameters bit-identical on all ranks and to the "
              f"fault-free run: {'yes' if identical else 'NO'}", flush=True)
        print("  measuring start-up and recovery against stock PyTorch ...", flush=True)
        su_h = m.median([m.startup("hpct", n, "reverse")["total"] for _ in range(3)])
        su_s = m.median([m.startup("stock", n, "reverse")["total"] for _ in range(3)])
        rc_h = m.recovery_in_process("hpct", n)
        rc_s = m.recovery_in_process("stock", n, op_timeout=5.0)
        rs_s = m.ddp_restart(n, work / "stock-restart", deadline)
        rows = [
            ["start-up: process start -> first all_reduce (ranks arrive in reverse order)",
             f"{su_h * 1000:.0f} ms", f"{su_s * 1000:.0f} ms", f"{su_s / su_h:.1f}x"],
            ["recovery: SIGKILL -> first all_reduce, in-process (stock: destroy + new store + init)",
             f"{rc_h * 1000:.0f} ms", f"{rc_s * 1000:.0f} ms", f"{rc_s / rc_h:.1f}x"],
            ["DDP training run: rendezvous in init_process_group, max over ranks",
             f"{connect_ms:.0f} ms", "", ""],
            ["DDP training run: failure -> training resumed (stock: full restart of all processes)",
             f"{resume_s * 1000:.0f} ms", f"{rs_s * 1000:.0f} ms", f"{rs_s / resume_s:.1f}x"],
        ]
        print()
        print(m.table(["measured on this machine", "hpct", "stock PyTorch", "stock/hpct"], rows,
                      f"hpct demo: {n} ranks, {os.cpu_count()} CPUs, torch {torch.__version__}; launcher: "
                      f"`{line}` (its default: workers forked from a fork server per node); "
                      f"bit-identical after recovery: {'yes' if identical else 'NO'}"))
        print(f"\nfailure -> training resumed: SIGKILL -> every rank's next DDP step, the replacement's start "
              f"included.\n  hpct: {resume_s * 1000:.0f} ms under `{line}`: the replacement {how}, the survivors "
              f"recovered in their processes.\n  stock: {rs_s * 1000:.0f} ms to start every process again on "
              f"ProcessGroupGloo + TCPStore (torchrun's restart, without its own detection and rendezvous).")
        print(f"(total {time.monotonic() - t_begin:.1f} s)")
        if args.keep:
            print(f"logs: {work}")
        return 0 if identical and same_pids else 1
    finally:
        signal.alarm(0)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        sys.stdout.flush()
