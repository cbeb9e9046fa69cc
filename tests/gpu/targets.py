"""Issue 61's speed targets read from the GPU proof's reports: what each table says against its target.

Not assertions (speed goals are reported, never asserted): each function turns a worker's lines into
the verdict lines the report ends with.  tests/test_gpu_pack.py runs them on the CPU.

- host time per 4 B all_reduce (``overhead-<n>.txt``, MPS): hpct / stock <= 1.0, and hpct with
  ``get_future()`` on every op / stock's plain op <= 1.25;
- a DDP step (``ddpab-4.txt``): hpct / stock <= 1.01, from rounds in which both stacks alternate in
  one process; the ratio is the geometric mean of the rounds' ratios with its 95 % interval (Student's
  t on the logs), and the target is shown met only when the whole interval is at or under it.
"""

from __future__ import annotations

import math
import re
import statistics

HOST_TARGET = 1.0
FUTURE_TARGET = 1.25
STEP_TARGET = 1.01
STOCK_ROW = "stock ProcessGroupNCCL (blocking comm)"
PLAIN_ROW = "hpct engine (blocking comm, the default)"
FUTURE_ROW = "hpct engine, get_future() as DDP"
# Student's t, two-sided 95 %, by degrees of freedom (beyond the table: the normal's 1.96).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 24: 2.064, 29: 2.045, 39: 2.023, 59: 2.001}
_ROW = re.compile(r"^OVERHEAD n=(?P<n>\d+)\s+(?P<name>.+?)\s+(?P<us>[0-9.]+)\s+(?P<host>[0-9.]+)$")


def t95(df: int) -> float:
    for k in sorted(_T95, reverse=True):
        if df >= k:
            return _T95[k] if df <= 59 or k < 59 else 1.96
    raise ValueError("a 95 % interval needs at least two rounds")


def host_rows(lines) -> dict[str, float]:
    """{row name: host us per op} of an overhead table."""
    out = {}
    for line in lines:
        m = _ROW.match(line.strip())
        if m:
            out[m["name"]] = float(m["host"])
    return out


def overhead_verdict(lines, n: int) -> list[str]:
    rows = host_rows(lines)
    missing = [r for r in (STOCK_ROW, PLAIN_ROW, FUTURE_ROW) if r not in rows]
    if missing:
        return [f"TARGET n={n} overhead table lacks {', '.join(missing)}: no verdict"]
    stock = rows[STOCK_ROW]
    out = []
    for what, row, target in (("host time, hpct / stock", PLAIN_ROW, HOST_TARGET),
                              ("host time, hpct with get_future() / stock's plain op", FUTURE_ROW, FUTURE_TARGET)):
        ratio = rows[row] / stock
        out.append(f"TARGET n={n} {what}: {ratio:.2f} (target <= {target:g}: {'met' if ratio <= target else 'not met'})")
    return out


def interval(ratios) -> tuple[float, float, float]:
    """(geometric mean, 95 % low, 95 % high) of per-round ratios."""
    logs = [math.log(r) for r in ratios]
    if len(logs) < 2:
        raise ValueError("a 95 % interval needs at least two rounds")
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = t95(len(logs) - 1) * sd / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def step_verdict(ratios, target: float = STEP_TARGET) -> str:
    ratio, lo, hi = interval(ratios)
    width = hi - lo
    if hi <= target:
        word = "met"
    elif lo > target:
        word = "not met"
    else:
        word = f"not shown: the interval straddles {target:g}"
    return (f"hpct/stock {ratio:.4f}, 95 % interval [{lo:.4f}, {hi:.4f}] (width {width * 100:.2f} %, "
            f"{len(ratios)} rounds); target <= {target:g}: {word}")


_AB = re.compile(r"^ABSTEP n=(?P<n>\d+) round=(?P<k>\d+) .*ratio=(?P<r>[0-9.]+)")


def ab_ratios(lines) -> list[float]:
    return [float(m["r"]) for m in map(_AB.match, (ln.strip() for ln in lines)) if m]
