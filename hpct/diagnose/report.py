"""The diagnosis as a person reads it: a table of links, the verdict, the settings that differ;
and the heatmap of the node-to-node bandwidth (matplotlib is imported only for --plot)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import ConfigError


def where(report: dict, rank: int) -> str:
    """A rank as an operator finds it: node, host, local rank, interface."""
    p = report["nproc_per_node"]
    node = rank // p
    per_rank = report["settings"]["per_rank"]          # empty when a timeout came before the audit
    iface = per_rank[rank].get("interface", "unknown") if rank < len(per_rank) else "interface unknown"
    return f"node {node} ({report['hosts'][node]}, local rank {rank % p}, {iface})"


def _link_name(report: dict, row: dict) -> str:
    return f"{where(report, row['a'])} <-> {where(report, row['b'])}"


def _rows(report: dict) -> dict[str, dict]:
    return {f"{r['a']}-{r['b']}": r for r in report["links"]}


def suspects(report: dict) -> list[str]:
    """One line per finding, as the table's verdict and the exit code count them."""
    rows = _rows(report)
    out = [f"suspect link {_link_name(report, rows[k])}: {'; '.join(why)}"
           for k, why in report["suspect_links"].items()]
    p = report["nproc_per_node"]
    out += [f"suspect node {n} ({report['hosts'][int(n)]}, ranks {int(n) * p}-{int(n) * p + p - 1}): {why}"
            for n, why in report["suspect_nodes"].items()]
    for name, holders in report["settings"]["differences"].items():
        values = "; ".join(f"{v!r} on rank{'s' * (len(r) != 1)} {','.join(map(str, r))}" for v, r in holders.items())
        out.append(f"setting {name} differs across ranks: {values}")
    return out


def table(report: dict) -> str:
    lines = [f"hpct diagnose: {report['world_size']} ranks on {report['nodes']} nodes "
             f"({report['nproc_per_node']} per node), {report['seconds']} s", ""]
    if not report["complete"]:
        planned = sum(report["rounds"].values())
        lines += [f"INCOMPLETE: {report['timeout']}",
                  f"measured before that: {len(report['rounds_done'])} of {planned or 'the'} rounds, "
                  f"{len(report['links'])} links", ""]
    if report["nodes"] < 2:
        lines.append("node-to-node links: none (one node: the inter-node matrix is empty)")
    header = f"{'link':<11} {'kind':<5} {'latency us':>10} {'a->b MB/s':>10} {'b->a MB/s':>10}  verdict"
    lines += [header, "-" * len(header)]
    for r in report["links"]:
        key = f"{r['a']}-{r['b']}"
        mark = "SUSPECT" if key in report["suspect_links"] else \
            "not judged: busy CPU" if key in report["busy_links"] else "ok"
        if r.get("alone"):
            mark += f" (alone; {r['parallel_bw_MBps']:.0f} MB/s in its round)"
        lines.append(f"{key:<11} {r['kind']:<5} {r['latency_us']:>10.1f} {r['bw_ab_MBps']:>10.1f} "
                     f"{r['bw_ba_MBps']:>10.1f}  {mark}")
    for kind, m in report["medians"].items():
        lines.append(f"median {kind}: {m['bw_MBps']:.0f} MB/s, {m['latency_us']:.1f} us")
    coll, pred = report["collectives_MBps"], report["ring_prediction"]
    if coll:
        lines.append(f"world: all_reduce {coll['all_reduce']:.0f} MB/s, all_gather {coll['all_gather']:.0f} MB/s "
                     "(bus bandwidth, slowest rank)")
    if coll and pred:
        ratio = coll["all_reduce"] / pred["bw_MBps"] if pred["bw_MBps"] else 0.0
        explained = "the slowest link explains it" if ratio >= 0.5 else \
            "slower than the slowest link predicts: look beyond the links (CPU, memory, reduction)"
        lines.append(f"ring's slowest link {pred['link']}: {pred['bw_MBps']:.0f} MB/s; all_reduce reaches "
                     f"{ratio:.2f} x of it: {explained}")
    lines.append("")
    found = suspects(report)
    if report["complete"]:
        lines += found or ["verdict: nothing suspect"]
        rows = _rows(report)
        lines += [f"not judged, link {_link_name(report, rows[k])}: {why}; run it again on idle hosts"
                  for k, why in report["busy_links"].items()]
    else:
        lines += found + ["verdict: none on the links (the diagnosis did not finish; a link below its median "
                          "in a round is judged only once measured alone)"]
        lines += [f"below the median in its round, not measured alone: link {k}: {'; '.join(why)}"
                  for k, why in report["unconfirmed_links"].items()]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """The node-to-node bandwidth (slower direction) as a heatmap PNG at ``path``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed",
                          fix="pip install matplotlib, or leave out --plot") from None
    n, p = report["nodes"], report["nproc_per_node"]
    grid = [[float("nan")] * n for _ in range(n)]
    for r in report["links"]:
        if r["kind"] == "inter":
            x, y = r["a"] // p, r["b"] // p
            value = min(r["bw_ab_MBps"], r["bw_ba_MBps"])
            grid[x][y] = grid[y][x] = value if grid[x][y] != grid[x][y] else min(grid[x][y], value)
    fig, ax = plt.subplots(figsize=(max(5.5, 1.5 + 0.45 * n), max(4.5, 1 + 0.45 * n)))
    image = ax.imshow(grid, cmap="viridis")
    fig.colorbar(image, ax=ax, label="MB/s (slower direction)")
    ax.set_xticks(range(n), [str(i) for i in range(n)])
    ax.set_yticks(range(n), [str(i) for i in range(n)])
    ax.set_xlabel("node")
    ax.set_ylabel("node")
    ax.set_title("hpct diagnose: node-to-node bandwidth")
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent or ".", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)         # mkstemp's 0600 is for secrets, not a report
        os.replace(tmp, target)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
