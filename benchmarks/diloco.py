"""DiLoCo against stock DDP over a slow link: bytes on the wire, time per step, loss.

    sudo python benchmarks/diloco.py [--world 4] [--steps 200] [--h 50] [--delay-ms 20] [--loss 0]

Each rank runs in its own network namespace behind the tests' userspace switch (hpct/testing/lossy.py:
this kernel has no netem), which adds ``--delay-ms`` one way and drops ``--loss`` of the frames.
Bytes are the namespaces' eth0 transmit counters (everything on the wire: payload, TCP/IP
headers, retransmissions), summed over ranks and divided by the steps.  DDP runs on torch's
own Gloo with a TCPStore (stock PyTorch); the DiLoCo modes on hpct.  Same model, seed and data.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANK = Path(__file__).with_name("diloco_rank.py")
MODES = ("ddp-gloo", "diloco", "diloco-fp16", "diloco-int8")


def tx_bytes(ns) -> int:
    out = subprocess.run(["ip", "-n", ns.name, "-s", "-j", "link", "show", "eth0"], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def run_mode(net, mode: str, args) -> dict:
    nodes = net.nodes
    hosts = ",".join(nd.address for nd in nodes)
    before = sum(tx_bytes(nd) for nd in nodes)
    procs = []
    for r, nd in enumerate(nodes):
        env = {"RANK": str(r), "WORLD_SIZE": str(args.world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "N_PROC_PER_NODE": "1", "HPCT_HOSTS": hosts, "HPCT_PORT_BASE": "13000",
               "HPCT_CONNECT_TIMEOUT": "60", "MASTER_ADDR": nodes[0].address, "MASTER_PORT": "12900",
               "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        procs.append(nd.popen([sys.executable, str(RANK), mode, str(args.steps), str(args.h)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return {"mode": mode, "error": f"no result within {args.timeout} s"}
        if p.returncode != 0:
            return {"mode": mode, "error": err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}"}
        results.append(json.loads(out.strip().splitlines()[-1]))
    wire = sum(tx_bytes(nd) for nd in nodes) - before
    return {"mode": mode, "bytes_per_step": wire / args.steps,
            "s_per_step": max(r["s_per_step"] for r in results),
            "eval_loss": results[0]["eval_loss"], "params": results[0]["params"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--h", type=int, default=50, help="DiLoCo's inner steps between syncs")
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    from hpct.testing.lossy import lossy_network                 # the userspace impairment the tests use too
    from hpct.testing.netns import unavailable_reason
    why = unavailable_reason()
    if why:
        print(f"benchmarks/diloco.py: network namespaces are unavailable: {why}", file=sys.stderr)
        return 2
    rows = []
    with lossy_network(args.world, loss=args.loss, delay_ms=args.delay_ms, name_prefix="hpct-diloco",
                       max_seconds=args.timeout * len(MODES)) as net:
        for mode in args.modes.split(","):
            t0 = time.monotonic()
            rows.append(run_mode(net, mode, args))
            print(f"  {mode}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    base = next((r for r in rows if r["mode"] == "ddp-gloo" and "error" not in r), None)
    print(f"DiLoCo vs stock DDP: world {args.world}, {args.steps} steps, H={args.h}, "
          f"{args.delay_ms:g} ms one way, loss {args.loss:g}, {rows[0].get('params', '?')} parameters")
    print(f"{'mode':12s} {'wire KiB/step':>14s} {'DDP/this':>9s} {'s/step':>8s} {'eval loss':>10s}")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:12s} error: {r['error']}")
            continue
        ratio = base["bytes_per_step"] / r["bytes_per_step"] if base else float("nan")
        print(f"{r['mode']:12s} {r['bytes_per_step'] / 1024:14.1f} {ratio:9.1f} {r['s_per_step']:8.4f} "
              f"{r['eval_loss']:10.5f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
