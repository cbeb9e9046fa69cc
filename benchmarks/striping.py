"""A large all_reduce striped over k connections per peer pair, through a long fat pipe.

    sudo python benchmarks/striping.py [--world 2] [--mib 16] [--ks 1,2,4,8] [--delay-ms 25]
                                       [--window-kib 256] [--loss 0]

Each rank runs in its own network namespace behind the tests' userspace switch (hpct/testing/lossy.py),
which adds ``--delay-ms`` one way.  Inside each namespace (never on the machine) the TCP buffers
are capped at ``--window-kib``, as a long-haul path's window or a middlebox caps them: one
connection then moves about one window per round trip whatever the bandwidth.  Throughput is
the tensor's MiB over the best of REPS all_reduces; stock PyTorch (torch's Gloo, one connection
per peer pair) runs in the same namespaces first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANK = Path(__file__).with_name("striping_rank.py")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--delay-ms", type=float, default=25.0)
    ap.add_argument("--window-kib", type=int, default=256)
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    from hpct.testing.lossy import lossy_network
    from hpct.testing.netns import unavailable_reason
    why = unavailable_reason()
    if why:
        print(f"benchmarks/striping.py: network namespaces are unavailable: {why}", file=sys.stderr)
        return 2
    ks = [int(k) for k in args.ks.split(",")]
    win = args.window_kib * 1024
    with lossy_network(args.world, loss=args.loss, delay_ms=args.delay_ms, name_prefix="hpct-stripe",
                       max_seconds=args.timeout) as net:
        for nd in net.nodes:
            for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
                nd.run(["sysctl", "-q", "-w", f"{key}=4096 {min(win, 65536)} {win}"])
        hosts = ",".join(nd.address for nd in net.nodes)
        procs = []
        for r, nd in enumerate(net.nodes):
            env = {"RANK": str(r), "WORLD_SIZE": str(args.world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "N_PROC_PER_NODE": "1", "HPCT_HOSTS": hosts, "HPCT_PORT_BASE": "13000",
                   "HPCT_CONNECT_TIMEOUT": "60",
                   "MASTER_ADDR": net.nodes[0].address, "MASTER_PORT": "12900", "GLOO_SOCKET_IFNAME": "eth0",
                   "OMP_NUM_THREADS": "1"}
            procs.append(nd.popen([sys.executable, str(RANK), str(args.mib), args.ks, str(args.reps)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        rows = None
        for p in procs:
            try:
                out, err = p.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                print(f"benchmarks/striping.py: no result within {args.timeout} s", file=sys.stderr)
                return 1
            if p.returncode != 0:
                print(f"benchmarks/striping.py: a rank failed: {err.strip()[-2000:]}", file=sys.stderr)
                return 1
            got = json.loads(out.strip().splitlines()[-1])["mib_per_s"]
            rows = got if rows is None else {k: min(v, got[k]) for k, v in rows.items()}
    print(f"all_reduce of {args.mib} MiB, world {args.world}, {args.delay_ms:g} ms one way, "
          f"TCP window {args.window_kib} KiB, loss {args.loss:g}")
    stock = rows["stock-gloo"]
    print(f"{'stack':12s} {'MiB/s':>8s} {'vs stock':>9s}")
    for name, v in rows.items():
        print(f"{name:12s} {v:8.2f} {v / stock:9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
