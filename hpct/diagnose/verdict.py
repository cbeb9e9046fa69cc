"""From the measured links to a verdict: which links and which nodes are suspect.

A link is compared with the median of its kind (node-to-node links with each other, links
within a node with each other): it is suspect when its slower direction is below
``bw_ratio`` x the median bandwidth or its latency above ``lat_ratio`` x the median latency
and at least ``lat_floor_us`` more (a few tens of microseconds are a busy CPU's, not a link's).
A node is suspect when most of its node-to-node links are (one bad link names its two ends;
a bad node makes all of its links bad).  Pure: every rank computes the same verdict from
the same numbers, so all agree on which suspects to measure again.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Thresholds:
    bw_ratio: float = 0.7
    lat_ratio: float = 1.5
    lat_floor_us: float = 50.0
    # A suspect measured alone whose ends still waited this share of its window for a CPU is not
    # judged: on hosts that busy the scheduler, not the link, sets the numbers (16 spinning
    # processes on 2 cores named a healthy link in 3 of 4 clean diagnoses; alone on idle hosts
    # the ends wait a few percent of the window).
    busy_share: float = 0.25


@dataclass
class Verdict:
    medians: dict                                   # kind -> {"bw_MBps", "latency_us"}
    suspect_links: dict = field(default_factory=dict)    # key -> [reasons]
    suspect_nodes: dict = field(default_factory=dict)    # node -> "k of n links suspect"
    busy_links: dict = field(default_factory=dict)       # key -> why it was not judged

    @property
    def clean(self) -> bool:
        return not self.suspect_links and not self.suspect_nodes


def _mb(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def slower(row: dict) -> float:
    return min(row["bw_ab_MBps"], row["bw_ba_MBps"])


def judge(rows: dict[str, dict], nproc: int, th: Thresholds = Thresholds(), *,
          medians: dict | None = None, candidates=None) -> Verdict:
    """``rows``: key -> measured link (links.measure's numbers).  A second look passes the
    first look's ``medians`` and its suspects as ``candidates``: a suspect measured again
    alone is judged against the links as they were measured (in rounds), and a link that
    was fine stays fine (alone, a suspect is faster: it would raise a new median)."""
    if medians is None:
        medians = {}
        for kind in ("inter", "intra"):
            mine = [r for r in rows.values() if r["kind"] == kind]
            if mine:
                medians[kind] = {"bw_MBps": statistics.median(slower(r) for r in mine),
                                 "latency_us": statistics.median(r["latency_us"] for r in mine)}
    v = Verdict(medians)
    counts = collections.Counter(r["kind"] for r in rows.values())
    for key, r in sorted(rows.items(), key=lambda kv: (kv[1]["a"], kv[1]["b"])):
        if candidates is not None and key not in candidates:
            continue
        # Fewer than three links of a kind have no majority to be compared with.
        if counts[r["kind"]] < 3:
            continue
        m = medians[r["kind"]]
        why = []
        if slower(r) < th.bw_ratio * m["bw_MBps"]:
            window = f" in {r['window_ms']:.0f} ms" if "window_ms" in r else ""
            part = f"1/{m['bw_MBps'] / slower(r):.0f}" if slower(r) * 2 < m["bw_MBps"] else \
                f"{slower(r) / m['bw_MBps']:.2f} x"
            why.append(f"bandwidth {_mb(slower(r))} MB/s{window} is below {th.bw_ratio:g} x the median "
                       f"{_mb(m['bw_MBps'])} MB/s ({part} of it)")
        if r["latency_us"] > max(th.lat_ratio * m["latency_us"], m["latency_us"] + th.lat_floor_us):
            why.append(f"latency {r['latency_us']:.0f} us is above {th.lat_ratio:g} x the median "
                       f"{m['latency_us']:.0f} us")
        if why:
            v.suspect_links[key] = why
    _name_nodes(v, rows, nproc)
    return v


def _name_nodes(v: Verdict, rows: dict[str, dict], nproc: int) -> None:
    nodes: dict[int, list[bool]] = {}
    for key, r in rows.items():
        if r["kind"] == "inter":
            for end in (r["a"], r["b"]):
                nodes.setdefault(end // nproc, []).append(key in v.suspect_links)
    v.suspect_nodes = {}
    for node, flags in sorted(nodes.items()):
        if len(flags) >= 2 and sum(flags) * 2 > len(flags):
            v.suspect_nodes[node] = f"{sum(flags)} of its {len(flags)} node-to-node links are suspect"


def set_aside_busy(v: Verdict, rows: dict[str, dict], nproc: int, th: Thresholds = Thresholds()) -> Verdict:
    """The final verdict: a suspect measured alone whose ends waited over ``th.busy_share`` of its
    window for a CPU moves to ``busy_links`` (not judged), and the nodes are named again without it."""
    for key in list(v.suspect_links):
        r = rows[key]                 # a row measured alone comes from links.measure: window and waits
        if r.get("alone") and r["cpu_wait_ms"] > th.busy_share * r["window_ms"]:
            v.busy_links[key] = (f"measured alone, its ends still waited {r['cpu_wait_ms']:.0f} ms of its "
                                 f"{r['window_ms']:.0f} ms window for a CPU (over {th.busy_share:.0%}): "
                                 f"the host was too busy to judge it ({'; '.join(v.suspect_links.pop(key))})")
    _name_nodes(v, rows, nproc)
    return v


def ring_prediction(rows: dict[str, dict], world: int, nproc: int) -> dict | None:
    """What the slowest link on Gloo's ring (rank r to r+1) predicts for the world's bus
    bandwidth: node boundaries use their nodes' measured link, others the node's local links."""
    by_nodes = {}
    for r in rows.values():
        if r["kind"] == "inter":
            by_nodes[frozenset((r["a"] // nproc, r["b"] // nproc))] = r
    worst = None
    for q in range(world):
        x, y = q // nproc, ((q + 1) % world) // nproc
        r = by_nodes.get(frozenset((x, y))) if x != y else \
            rows.get(f"{min(q, (q + 1) % world)}-{max(q, (q + 1) % world)}")
        if r is not None and (worst is None or slower(r) < slower(worst)):
            worst = r
    if worst is None:
        return None
    return {"link": f"{worst['a']}-{worst['b']}", "bw_MBps": slower(worst)}
