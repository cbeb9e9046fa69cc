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
from ..errors import DiagnoseTimeout, RendezvousError, TransportError
from ..ports import PortPlan, host_of, shared_peers
from . import audit, links, rounds, schedule, verdict

SCHEMA_VERSION = 2      # 2: time-bounded probes (window_ms), a timeout's partial report


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
    from ..distributed.membership.world import connect_context
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
    """Diagnose with every other rank of the job; the report (every rank gets the same, but
    for a timeout's: then only rank 0's holds what was measured, and ``complete`` is False)."""
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
    partial = rounds.Partial()
    head = {"schema_version": SCHEMA_VERSION, "world_size": world, "nodes": nodes, "nproc_per_node": p,
            "hosts": list(cfg.hosts[:nodes]), "port_base": base,
            "thresholds": dataclasses.asdict(opts.thresholds)}
    try:
        body = _measure(ctx, cfg, rank, p, nodes, opts, env, deadline, say, partial)
    except (DiagnoseTimeout, TransportError) as err:
        # A rank that never answered: rank 0 still reports what the rounds before measured.
        problem = err.problem if isinstance(err, DiagnoseTimeout) else \
            f"{partial.doing}: {err} (the --timeout ran out, or a rank stopped)"
        rows = partial.rows
        # No verdict: the links below the median were measured in rounds only, never alone.
        first = verdict.judge(rows, p, opts.thresholds)
        body = _body(rows, verdict.Verdict(first.medians), {}, partial.settings, world, p, partial)
        body |= {"complete": False, "timeout": problem, "waiting_on": partial.doing, "collective_bytes": None,
                 "unconfirmed_links": first.suspect_links}
    finally:
        ctx.close()
    return head | body | {"seconds": round(time.monotonic() - started, 2)}


def _measure(ctx, cfg, rank, p, nodes, opts, env, deadline, say, partial) -> dict:
    partial.doing = "gathering every rank's settings"
    partial.settings = rounds.gather_json(ctx, audit.collect(host_of(cfg.hosts, rank, p), env, opts.proc_sys))
    say("settings gathered; measuring links")
    inter = schedule.inter_rounds(nodes, p, opts.all_local)
    intra = schedule.intra_rounds(nodes, p)
    if opts.serial:
        inter, intra = schedule.serial(inter), schedule.serial(intra)
    partial.planned = {"inter": len(inter), "intra": len(intra)}
    t0 = time.monotonic()
    mine = rounds.run_rounds(ctx, rank, inter, opts.sizes, deadline, partial, say, "node-to-node round")
    partial.matrix_s = time.monotonic() - t0
    mine |= rounds.run_rounds(ctx, rank, intra, opts.sizes, deadline, partial, say, "within-node round")
    partial.doing = "sharing the measured links"
    rows = {k: v for part in rounds.gather_json(ctx, mine) for k, v in part.items()}
    judged = verdict.judge(rows, p, opts.thresholds)
    # Parallel rounds may share a spine (and a busy host its CPUs): a suspect is judged by what it
    # does alone, twice the tries each way, and one still suspect is looked at once more and
    # judged on its better look: a hiccup during every try of two looks is far less likely
    # than during one, and a slow link is slow in all of them.
    steady = dataclasses.replace(opts.sizes, tries=2 * opts.sizes.tries)
    firsts = {}
    for look in (1, 2):
        if not judged.suspect_links:
            break
        alone = [[schedule.Link(rows[k]["a"], rows[k]["b"], rows[k]["kind"])] for k in judged.suspect_links]
        say(f"{len(alone)} suspect link{'s' * (len(alone) != 1)}: measuring each alone (look {look} of 2)")
        again = rounds.run_rounds(ctx, rank, alone, steady, deadline, partial, say, f"alone, look {look}",
                                  warm=False)
        partial.doing = "sharing the links measured alone"
        for part in rounds.gather_json(ctx, again):
            for k, v in part.items():
                firsts.setdefault(k, verdict.slower(rows[k]))
                rows[k] = _better(rows[k], v) if look > 1 else v
                rows[k] |= {"parallel_bw_MBps": firsts[k], "alone": True}
        judged = verdict.judge(rows, p, opts.thresholds, medians=judged.medians,
                               candidates=set(judged.suspect_links))
    judged = verdict.set_aside_busy(judged, rows, p, opts.thresholds)
    say("the world's all_reduce and all_gather")
    partial.doing = "measuring the world's all_reduce and all_gather"
    nbytes = links.collective_bytes(opts.sizes, min(map(verdict.slower, rows.values()), default=None))
    coll = rounds.gather_json(ctx, links.collectives(ctx, nbytes))
    measured = {name: min(c[name] for c in coll) for name in (coll[0] if coll else {})}
    return _body(rows, judged, measured, partial.settings, ctx.size, p, partial) | \
        {"complete": True, "timeout": None, "waiting_on": None, "collective_bytes": nbytes, "unconfirmed_links": {}}


def _better(a: dict, b: dict) -> dict:
    """Two looks at one link: each number at its best (the faster direction, the shorter wait)."""
    out = dict(b)
    for key in ("bw_ab_MBps", "bw_ba_MBps"):
        out[key] = max(a[key], b[key])
    out["latency_us"] = min(a["latency_us"], b["latency_us"])
    return out


def _body(rows, judged, collectives, settings, world, p, partial) -> dict:
    return {
        "links": [rows[k] for k in sorted(rows, key=lambda k: (rows[k]["a"], rows[k]["b"]))],
        "medians": judged.medians,
        "suspect_links": judged.suspect_links,
        "suspect_nodes": {str(n): why for n, why in judged.suspect_nodes.items()},
        "busy_links": judged.busy_links,
        "collectives_MBps": collectives,
        "ring_prediction": verdict.ring_prediction(rows, world, p),
        "settings": {"per_rank": settings, "differences": audit.differences(settings)},
        "rounds": partial.planned, "rounds_done": partial.rounds,
        "matrix_seconds": round(partial.matrix_s, 3),
    }
