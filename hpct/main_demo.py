"""``hpct demo``: rootless start-up, a lost rank, in-process recovery; timings next to stock PyTorch.

On this machine: N ranks train a small model with DistributedDataParallel on the ``hpct``
backend (started rank 0 last, no TCPStore); one rank is SIGKILLed mid-step, a replacement
joins at the next generation, the survivors recover in-process and training ends with
parameters bit-identical on every rank and to a run without the fault.  Then start-up and
recovery are measured against stock PyTorch (ProcessGroupGloo + TCPStore) and one table is
printed.  Every process has a deadline; the whole demo is bounded by --deadline.
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


def _train(out: Path, n: int, steps: int, fault: int | None, deadline: float):
    from .demo.agent import Job, free_port_block, trainer_argv
    args = ["--steps", str(steps)]
    victim = n // 2
    if fault is not None:
        args += ["--hang", f"{victim}:{fault}:0"]
    out.mkdir(parents=True)
    with Job(trainer_argv(out, *args), n, free_port_block(8 * n), out, deadline,
             env={"HPCT_CONNECT_TIMEOUT": "30"}) as job:
        job.start_all(order=list(reversed(range(n))))           # rank 0 last
        survivors = {}
        if fault is not None:
            job.wait_file(out / f"hang-{victim}-0", max(deadline - time.monotonic(), 1))
            survivors = {r: p.pid for r, p in job.procs.items() if r != victim}
            time.sleep(0.3)
            job.kill(victim)
            job.start(victim, generation=1, extra=["--replacement"])
        codes = job.wait_all()
        if any(codes.values()):
            bad = next(r for r, c in codes.items() if c)
            raise RuntimeError(f"rank {bad} exited with {codes[bad]}:\n{job.output(bad)}")
        records = job.records()
    return records, survivors, victim


def _params(out: Path, n: int):
    import torch
    return [torch.load(out / f"params-{r}.pt") for r in range(n)]


def _same(a, b) -> bool:
    import torch
    return a.keys() == b.keys() and all(
        a[k].reshape(-1).view(torch.uint8).equal(b[k].reshape(-1).view(torch.uint8)) for k in a)


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
    try:
        print(f"hpct demo: {args.ranks} ranks, DDP on the hpct backend, rank {args.ranks // 2} killed "
              f"at step {args.fault_step} of {args.steps}", flush=True)
        import warnings
        # torch warns once when numpy is absent; hpct does not use numpy (not a dependency)
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch  # noqa: F401  (after the banner: importing takes a moment)

        import hpct.distributed  # noqa: F401
        from .demo import measure as m
        ref, _, _ = _train(work / "reference", args.ranks, args.steps, None, deadline)
        recs, survivors, victim = _train(work / "fault", args.ranks, args.steps, args.fault_step, deadline)
        ps, ref_ps = _params(work / "fault", args.ranks), _params(work / "reference", args.ranks)
        identical = all(_same(p, ps[0]) for p in ps) and _same(ps[0], ref_ps[0])
        same_pids = all(any(r["pid"] == pid for r in recs if r["rank"] == rank) for rank, pid in survivors.items())
        recovered = [e for r in recs for e in r["events"] if e["what"] == "recovered"]
        connect_ms = max((next(e["t"] for e in r["events"] if e["what"] == "connected") -
                          next(e["t"] for e in r["events"] if e["what"] == "start")) * 1000
                         for r in ref)
        resume_s = max(e["total_s"] for e in recovered)
        print(f"  training: done; survivors kept their processes: {'yes' if same_pids else 'NO'}; "
              f"final parameters bit-identical on all ranks and to the fault-free run: "
              f"{'yes' if identical else 'NO'}", flush=True)
        print("  measuring start-up and recovery against stock PyTorch ...", flush=True)
        n = args.ranks
        su_h = m.median([m.startup("hpct", n, "reverse")["total"] for _ in range(3)])
        su_s = m.median([m.startup("stock", n, "reverse")["total"] for _ in range(3)])
        rc_h = m.recovery_in_process("hpct", n)
        rc_s = m.recovery_in_process("stock", n, op_timeout=5.0)
        rs_s = m.full_restart(n)
        rows = [
            ["start-up: process start -> first all_reduce (ranks arrive in reverse order)",
             f"{su_h * 1000:.0f} ms", f"{su_s * 1000:.0f} ms", f"{su_s / su_h:.1f}x"],
            ["recovery: SIGKILL -> first all_reduce, in-process (stock: destroy + new store + init)",
             f"{rc_h * 1000:.0f} ms", f"{rc_s * 1000:.0f} ms", f"{rc_s / rc_h:.1f}x"],
            ["recovery: hpct in-process vs stock full restart of all processes (torchrun-style)",
             f"{rc_h * 1000:.0f} ms", f"{rs_s * 1000:.0f} ms", f"{rs_s / rc_h:.1f}x"],
            ["DDP training run: rendezvous in init_process_group, max over ranks",
             f"{connect_ms:.0f} ms", "", ""],
            ["DDP training run: failure -> training resumed (incl. replacement process start)",
             f"{resume_s * 1000:.0f} ms", "", ""],
        ]
        print()
        print(m.table(["measured on this machine", "hpct", "stock PyTorch", "stock/hpct"], rows,
                      f"hpct demo: {n} ranks, {os.cpu_count()} CPUs, torch {torch.__version__}; "
                      f"bit-identical after recovery: {'yes' if identical else 'NO'}"))
        print(f"\n(total {time.monotonic() - t_begin:.1f} s)")
        if args.keep:
            print(f"logs: {work}")
        return 0 if identical and same_pids else 1
    finally:
        signal.alarm(0)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        sys.stdout.flush()
