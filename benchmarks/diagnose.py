#!/usr/bin/env python3
"""``hpct diagnose``: the node-to-node matrix in rounds against the same pairs one at a time;
the time to a verdict with one link slowed far below the others; then the DDP communication
profiler's overhead and accuracy (benchmarks/profile_comm.py).

For every host count N (default 4, 8, 16), N network namespaces on one bridge, one rank
each, run ``hpct diagnose`` twice in the same run: in rounds of disjoint pairs (N-1 rounds
for even N) and ``--serial`` (N(N-1)/2 rounds of one pair).  The matrix time is the
node-to-node rounds only (connecting and importing torch excluded), as rank 0 measured it.
The model extends both to 1,024 nodes from the per-pair time measured at the largest N.

The slow-link table (issue 41): for each host count of --slow-hosts, a clean run gives the
node-to-node median M; then htb limits the link between hosts 1 and 2 (both ways) to M/R for
each R of --ratios, and a diagnosis with the default options runs.  It reports the time to
the verdict two ways: the diagnosis's own time as rank 0 measured it (from its start, with
torch imported), and the wall time from launching every rank to the last one's exit (on this
machine's 2 CPUs that includes importing torch in every rank at once), and whether exactly
the slowed link was named.
On this machine (2 cores) the pairs of a round share two CPUs, so a round costs more than a
pair alone; on a cluster each pair has its own hosts and NICs.

    python benchmarks/diagnose.py [--hosts 4,8,16] [--bytes 8388608] [--slow-hosts 4,16]
                                  [--ratios 10,100,1000] [--no-profile]
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


def run_matrix(nodes, extra: list[str], nbytes: int, timeout: float, wall: list | None = None) -> dict:
    hosts = ",".join(n.address for n in nodes)
    procs = []
    started = time.monotonic()
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
    if wall is not None:
        wall.append(time.monotonic() - started)
    code, so, se = outs[0]
    if code not in (0, 16):
        raise SystemExit(f"hpct diagnose failed with exit {code}:\n{se[-2000:]}")
    return json.loads(so)


def slow_table(host_counts: list[int], ratios: list[int], timeout: float) -> None:
    from hpct.testing.netns import limited_link, netns_network
    rows = []
    for n in host_counts:
        with netns_network(n, "hpct-bslow", "10.236.0") as nodes:
            median = run_matrix(nodes, [], 8 << 20, timeout)["medians"]["inter"]["bw_MBps"]
            for ratio in ratios:
                wall: list = []
                with limited_link(nodes[1], nodes[2], f"{median * 8 / ratio:.3f}mbit"):
                    got = run_matrix(nodes, [], 8 << 20, timeout, wall)
                row = next(r for r in got["links"] if (r["a"], r["b"]) == (1, 2))
                rows.append((n, median, ratio, min(row["bw_ab_MBps"], row["bw_ba_MBps"]),
                             sum(1 for r in got["links"] if r.get("alone")), got["seconds"], wall[0],
                             list(got["suspect_links"]) == ["1-2"], sorted(got["suspect_links"])))
                print(f"diagnose: {n} hosts, 1/{ratio} measured", file=sys.stderr, flush=True)
    print(f"hpct diagnose, one link (1-2) slowed to 1/R of the clean median with htb, default options: "
          f"{os.cpu_count()} CPUs, one rank per namespace")
    print("| hosts | clean median [MB/s] | R | link 1-2 measured [MB/s] | suspects measured alone "
          "| verdict, diagnosis [s] | verdict, wall incl. start-up [s] | named 1-2 and only it |")
    print("|---:|---:|---:|---:|---:|---:|---:|:--|")
    for n, m, ratio, bw, alone, secs, wall_s, right, named in rows:
        print(f"| {n} | {m:.0f} | {ratio} | {bw:.3g} | {alone} | {secs:.2f} | {wall_s:.1f} | "
              f"{'yes' if right else 'no: ' + (', '.join(named) or 'none')} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="4,8,16", help="host counts (network namespaces), comma list")
    ap.add_argument("--bytes", type=int, default=8 << 20, help="bytes per direction of each link")
    ap.add_argument("--timeout", type=float, default=240.0, help="each diagnosis's --timeout")
    ap.add_argument("--slow-hosts", default="4,16", help="host counts of the slow-link table (empty: none)")
    ap.add_argument("--ratios", default="10,100,1000", help="the slowed link's fraction of the median, 1/R")
    ap.add_argument("--no-profile", action="store_true", help="leave out the DDP profiler's part")
    args = ap.parse_args()
    sizes = [int(x) for x in args.hosts.split(",") if x]
    from hpct.testing.netns import netns_network, unavailable_reason   # the harness the multihost tests use too
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
    if rows:
        print(f"hpct diagnose, node-to-node matrix: {os.cpu_count()} CPUs, one rank per namespace, "
              f"at most {args.bytes} bytes per direction within a 100 ms window (twice for a suspect alone)")
        print("| hosts | rounds | matrix [s] | serial rounds | serial [s] | serial / rounds | suspects |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, r, t, sr, st, sus in rows:
        print(f"| {n} | {r} | {t:.2f} | {sr} | {st:.2f} | {st / t:.1f}x | {sus} |")
    if rows:
        n, r, t, sr, st, _ = rows[-1]
        pair = st / sr
        big = 1024
        print(f"model at {big} nodes (a pair takes {pair * 1e3:.0f} ms alone, as measured at {n} hosts; "
              f"a round of disjoint pairs as long as one pair on a cluster): rounds {big - 1} x {pair:.3f} s = "
              f"{(big - 1) * pair:.0f} s; one pair at a time {big * (big - 1) // 2} x {pair:.3f} s = "
              f"{big * (big - 1) // 2 * pair / 3600:.1f} h")
    slow_hosts = [int(x) for x in args.slow_hosts.split(",") if x]
    if slow_hosts:
        slow_table(slow_hosts, [int(x) for x in args.ratios.split(",") if x], args.timeout)
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
