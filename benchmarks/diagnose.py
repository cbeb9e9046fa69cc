#!/usr/bin/env python3
"""``hpct diagnose``: the node-to-node matrix in rounds against the same pairs one at a time;
then the DDP communication profiler's overhead and accuracy (benchmarks/profile_comm.py).

For every host count N (default 4, 8, 16), N network namespaces on one bridge, one rank
each, run ``hpct diagnose`` twice in the same run: in rounds of disjoint pairs (N-1 rounds
for even N) and ``--serial`` (N(N-1)/2 rounds of one pair).  The matrix time is the
node-to-node rounds only (connecting and importing torch excluded), as rank 0 measured it.
The model extends both to 1,024 nodes from the per-pair time measured at the largest N.
On this machine (2 cores) the pairs of a round share two CPUs, so a round costs more than a
pair alone; on a cluster each pair has its own hosts and NICs.

    python benchmarks/diagnose.py [--hosts 4,8,16] [--bytes 8388608] [--no-profile]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI = "import sys; from hpct.cli import main; sys.exit(main())"


def run_matrix(nodes, extra: list[str], nbytes: int, timeout: float) -> dict:
    hosts = ",".join(n.address for n in nodes)
    procs = []
    for rank, node in enumerate(nodes):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(len(nodes)),
               "LOCAL_WORLD_SIZE": "1", "HPCT_HOSTS": hosts}
        procs.append(node.popen([sys.executable, "-c", CLI, "diagnose", "--json", "--timeout", str(timeout),
                                 "--bytes", str(nbytes), *extra], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    for p in procs:
        so, se = p.communicate(timeout=timeout + 60)
        outs.append((p.returncode, so, se))
    code, so, se = outs[0]
    if code not in (0, 16):
        raise SystemExit(f"hpct diagnose failed with exit {code}:\n{se[-2000:]}")
    return json.loads(so)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="4,8,16", help="host counts (network namespaces), comma list")
    ap.add_argument("--bytes", type=int, default=8 << 20, help="bytes per direction of each link")
    ap.add_argument("--timeout", type=float, default=240.0, help="each diagnosis's --timeout")
    ap.add_argument("--no-profile", action="store_true", help="leave out the DDP profiler's part")
    args = ap.parse_args()
    sizes = [int(x) for x in args.hosts.split(",") if x]
    sys.path.insert(0, str(REPO / "tests"))
    from netns import netns_network, unavailable_reason   # the multihost tests' harness
    why = unavailable_reason()
    if why:
        raise SystemExit(f"benchmarks/diagnose.py needs network namespaces: {why}")
    rows = []
    for n in sizes:
        with netns_network(n, "hpct-bdiag", "10.234.0") as nodes:
            rounds = run_matrix(nodes, [], args.bytes, args.timeout)
            serial = run_matrix(nodes, ["--serial"], args.bytes, args.timeout)
        rows.append((n, rounds["rounds"]["inter"], rounds["matrix_seconds"], serial["rounds"]["inter"],
                     serial["matrix_seconds"], len(rounds["suspect_links"])))
        print(f"diagnose: {n} hosts measured", file=sys.stderr, flush=True)
    print(f"hpct diagnose, node-to-node matrix: {os.cpu_count()} CPUs, one rank per namespace, "
          f"{args.bytes} bytes per direction, best of 3 tries (6 for a suspect measured alone)")
    print("| hosts | rounds | matrix [s] | serial rounds | serial [s] | serial / rounds | suspects |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, r, t, sr, st, sus in rows:
        print(f"| {n} | {r} | {t:.2f} | {sr} | {st:.2f} | {st / t:.1f}x | {sus} |")
    n, r, t, sr, st, _ = rows[-1]
    pair = st / sr
    big = 1024
    print(f"model at {big} nodes (a pair takes {pair * 1e3:.0f} ms alone, as measured at {n} hosts; "
          f"a round of disjoint pairs as long as one pair on a cluster): rounds {big - 1} x {pair:.3f} s = "
          f"{(big - 1) * pair:.0f} s; one pair at a time {big * (big - 1) // 2} x {pair:.3f} s = "
          f"{big * (big - 1) // 2 * pair / 3600:.1f} h")
    if not args.no_profile:
        started = time.monotonic()
        proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_comm.py")], text=True,
                              capture_output=True, timeout=600, cwd="/")
        print(proc.stdout.rstrip())
        if proc.returncode:
            raise SystemExit(f"benchmarks/profile_comm.py failed:\n{proc.stderr[-2000:]}")
        print(f"(profiler part: {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
