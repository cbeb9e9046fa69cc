"""Start-up and in-process recovery on torch 2.6.0: stock, hpct's patched wheel, the hpct backend.

Three stacks in one run, each in its own interpreter (hpct.demo.measure forks the ranks from a
parent that already imported torch, so the times are rendezvous, connect and rebuild):
  stock    PyPI's torch 2.6.0: ProcessGroupGloo, a TCPStore on rank 0; recovery destroys the
           group and forms a new one through a new store;
  patched  hpct-build wheel torch=2.6.0, HPCT_USE_ROOTLESS=1: the same torch API with no store
           and no root; recovery destroys the world and forms it again on the same ports;
  hpct     the hpct backend (init_process_group("hpct")) on stock torch 2.6.0; recovery is
           hpct.distributed.recover().
Start-up: release -> the last rank's first all_reduce.  Recovery: SIGKILL of the last rank ->
every rank's first all_reduce of the rebuilt world (the replacement is forked at the kill); a
recovery in which a rank never rebuilt its group within the deadline is shown as hung.
The interpreters come from build/torch26.json (``python tests/torch26_envs.py`` makes both
environments), or --stock/--patched.

    python benchmarks/torch26.py [--n 4,16] [--repeat 3] [--stock PY] [--patched PY]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STATE = REPO / "build" / "torch26.json"
STACKS = (("stock", "stock"), ("patched", "patched"), ("hpct", "stock"))   # (stack, environment)
RUN_TIMEOUT_S = 3600


def measure(stack: str, sizes: list[int], repeat: int) -> dict:
    """Runs in the stack's interpreter: {N: {"startup": [s...], "recovery": [s...]}}."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from hpct.demo import measure as m
    out = {"torch": torch.__version__}
    for n in sizes:
        recovery = []
        for _ in range(repeat):
            try:
                recovery.append(m.recovery_in_process(stack, n))
            except TimeoutError:               # a rank never rebuilt its group: no more tries at this size
                recovery.append(None)
                break
        out[str(n)] = {"startup": [m.startup(stack, n)["total"] for _ in range(repeat)], "recovery": recovery}
    return out


def _cell(runs: list, base: list | None = None) -> tuple[str, str]:
    """(median in ms, ratio to stock's median) of the runs that finished; a run that hung says so."""
    done = [r for r in runs if r is not None]
    if not done:
        from hpct.demo.measure import RECOVERY_DEADLINE_S
        return f"hung (> {RECOVERY_DEADLINE_S} s)", "-"
    med = statistics.median(done)
    text = f"{med * 1000:.0f}" + ("" if len(done) == len(runs) else f" ({len(runs) - len(done)} hung)")
    base_done = [r for r in (base or []) if r is not None]
    return text, (f"{med / statistics.median(base_done):.3f}" if base_done else "-")


def _pythons(args) -> dict:
    state = json.loads(STATE.read_text()) if STATE.is_file() else {}
    found = {"stock": args.stock or state.get("stock"), "patched": args.patched or state.get("patched")}
    missing = [k for k, v in found.items() if not v]
    if missing:
        sys.exit(f"no torch 2.6.0 interpreter for {', '.join(missing)}: run `python tests/torch26_envs.py` first "
                 "(it makes both environments and writes build/torch26.json), or pass --stock/--patched")
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="4,16", help="comma list of world sizes")
    ap.add_argument("--repeat", type=int, default=3, help="runs per point (the median is shown)")
    ap.add_argument("--stock", help="python of an environment with stock torch 2.6.0 and hpct")
    ap.add_argument("--patched", help="python of an environment with hpct's patched torch 2.6.0 and hpct")
    ap.add_argument("--measure", help=argparse.SUPPRESS)          # internal: one stack, in its interpreter
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.n.split(",")]
    if args.measure:
        print(json.dumps(measure(args.measure, sizes, args.repeat)))
        return 0
    pythons = _pythons(args)
    got = {}
    for stack, env in STACKS:
        print(f"  {stack} ({pythons[env]}) ...", file=sys.stderr, flush=True)
        proc = subprocess.run([pythons[env], str(Path(__file__).resolve()), "--measure", stack, "--n", args.n,
                               "--repeat", str(args.repeat)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                              env={k: v for k, v in os.environ.items() if not k.startswith(("HPCT_", "PYTHONPATH"))})
        if proc.returncode != 0:
            sys.exit(f"{stack}: the measurement failed:\n{proc.stderr[-3000:]}")
        got[stack] = json.loads(proc.stdout.splitlines()[-1])
    from hpct.demo.measure import table
    rows = []
    for n in sizes:
        stock = got["stock"][str(n)]
        for stack, _ in STACKS:
            runs = got[stack][str(n)]
            start, start_ratio = _cell(runs["startup"], stock["startup"])
            recovery, recovery_ratio = _cell(runs["recovery"], stock["recovery"])
            rows.append([n, f"{stack} ({got[stack]['torch']})", start, recovery, start_ratio, recovery_ratio])
    print(table(["N", "stack", "start-up (ms)", "recovery (ms)", "start-up / stock", "recovery / stock"], rows,
                f"torch 2.6.0: start-up (release -> last first all_reduce) and in-process recovery (SIGKILL -> "
                f"every rank's first all_reduce), {os.cpu_count()} CPUs, median of {args.repeat}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
