"""One diagnosis, run by every rank of the job: connect, audit, measure, judge.

The ranks find each other as the training job does (the port plan: hosts, processes per
node, local rank) but on ports of their own, right after the plan's NCCL block, so a
diagnosis can run beside a job that holds the plan's ports.  Every rank ends with the same
report; rank 0 prints it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time

from ..config import Config
from ..errors import RendezvousError
from ..ports import PortPlan, host_of, shared_peers
from . import audit, links, schedule, verdict

SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Options:
    timeout: float = 30.0
    port_base: int | None = None           # default: the first port after the plan's NCCL block
    all_local: bool = False
    serial: bool = False
    thresholds: verdict.Thresholds = verdict.Thresholds()
    sizes: links.Sizes = links.Sizes()
    proc_sys: str = "/proc/sys"
    quiet: bool = False


def diagnose_port_base(cfg: Config) -> int:
    return PortPlan.from_config(cfg).block("nccl").stop


def _missing(err: RendezvousError) -> list[int]:
    # The extension's connect error lists the ranks it never heard from.
    m = re.search(r"still missing ranks? ([0-9, ]+)", str(err))
    return [int(x) for x in m.group(1).replace(",", " ").split()] if m else []


def _connect(cfg: Config, rank: int, world: int, base: int, opts: Options, deadline: float):
    from ..distributed.world import connect_context
    p = cfg.nproc_per_node
    peers = shared_peers(cfg.hosts, base, range(world), p)
    # Every pair at once: a rank that never arrives is named here, not in the first round.
    full = dataclasses.replace(cfg, lazy_connect=False)
    try:
        return connect_context(full, name="diagnose", group_rank=rank, generation=0, peers=peers,
                               global_rank=rank, key=0, timeout=max(deadline - time.monotonic(), 1.0),
                               connect_timeout=max(deadline - time.monotonic(), 0.5),
                               deadline_name="--timeout")
    except RendezvousError as err:
        named = [f"rank {q} (node {q // p}, local rank {q % p}) never arrived at its planned address "
                 f"{peers[q][0]}:{peers[q][1]}" for q in _missing(err)]
        where = (f"addresses come from HPCT_PORT_BASE={cfg.port_base} (diagnosis ports from "
                 f"{base}), the hosts {','.join(cfg.hosts)} and each rank's LOCAL_RANK, "
                 f"{p} per node")
        raise RendezvousError("; ".join(named) + f" ({where})" if named else f"{err.problem} ({where})",
                              fix="start every rank with the same HPCT_PORT_BASE and HPCT_HOSTS/HPCT_HOSTFILE "
                                  "(`hpct diagnose --json` on each shows its settings), or raise "
                                  "--timeout") from None


def run(opts: Options, env=os.environ) -> dict:
    """Diagnose with every other rank of the job; the report (every rank gets the same)."""
    started = time.monotonic()
    deadline = started + opts.timeout
    cfg = Config.from_mapping(env)
    rank, world, p = cfg.rank or 0, cfg.world_size or 1, cfg.nproc_per_node
    nodes = -(-world // p)
    base = opts.port_base if opts.port_base is not None else diagnose_port_base(cfg)

    def say(text: str) -> None:
        if rank == 0 and not opts.quiet:
            print(f"hpct diagnose: [{time.monotonic() - started:5.1f}s] {text}", file=sys.stderr, flush=True)

    say(f"{world} rank{'s' * (world != 1)} on {nodes} node{'s' * (nodes != 1)}, "
        f"{p} per node; ports from {base}")
    ctx = _connect(cfg, rank, world, base, opts, deadline)
    try:
        settings = links.gather_json(ctx, audit.collect(host_of(cfg.hosts, rank, p), env, opts.proc_sys))
        say("settings gathered; measuring links")
        inter = schedule.inter_rounds(nodes, p, opts.all_local)
        intra = schedule.intra_rounds(nodes, p)
        if opts.serial:
            inter, intra = schedule.serial(inter), schedule.serial(intra)
        ctx.barrier()
        t0 = time.monotonic()
        mine = links.run_rounds(ctx, rank, inter, opts.sizes, deadline, say, "node-to-node round")
        matrix_s = time.monotonic() - t0
        mine |= links.run_rounds(ctx, rank, intra, opts.sizes, deadline, say, "within-node round")
        rows = {k: v for part in links.gather_json(ctx, mine) for k, v in part.items()}
        judged = verdict.judge(rows, p, opts.thresholds)
        if judged.suspect_links and not opts.serial:
            # Parallel rounds may share a spine: a suspect is judged by what it does alone.
            alone = [[schedule.Link(rows[k]["a"], rows[k]["b"], rows[k]["kind"])] for k in judged.suspect_links]
            say(f"{len(alone)} suspect link{'s' * (len(alone) != 1)}: measuring each alone")
            # twice the tries: a CPU hiccup during every one of them is far less likely than once
            steady = dataclasses.replace(opts.sizes, tries=2 * opts.sizes.tries)
            again = links.run_rounds(ctx, rank, alone, steady, deadline, say, "alone")
            for part in links.gather_json(ctx, again):
                for k, v in part.items():
                    v["parallel_bw_MBps"] = verdict.slower(rows[k])
                    rows[k] = {**v, "alone": True}
            judged = verdict.judge(rows, p, opts.thresholds, medians=judged.medians,
                                   candidates=set(judged.suspect_links))
        say("the world's all_reduce and all_gather")
        coll = links.gather_json(ctx, links.collectives(ctx, opts.sizes.collective))
    finally:
        ctx.close()
    measured = {name: min(c[name] for c in coll) for name in (coll[0] if coll else {})}
    return {
        "schema_version": SCHEMA_VERSION, "world_size": world, "nodes": nodes, "nproc_per_node": p,
        "hosts": list(cfg.hosts[:nodes]), "port_base": base,
        "thresholds": dataclasses.asdict(opts.thresholds),
        "links": [rows[k] for k in sorted(rows, key=lambda k: (rows[k]["a"], rows[k]["b"]))],
        "medians": judged.medians,
        "suspect_links": judged.suspect_links,
        "suspect_nodes": {str(n): why for n, why in judged.suspect_nodes.items()},
        "collectives_MBps": measured,
        "ring_prediction": verdict.ring_prediction(rows, world, p),
        "settings": {"per_rank": settings, "differences": audit.differences(settings)},
        "rounds": {"inter": len(inter), "intra": len(intra)},
        "matrix_seconds": round(matrix_s, 3),
        "seconds": round(time.monotonic() - started, 2),
    }
