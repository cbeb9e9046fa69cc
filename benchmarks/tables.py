"""The text table benchmarks/launch.py and benchmarks/goodput.py print: a header row, a rule, and
the rows, the first two columns left-aligned (names) and the rest right-aligned (numbers)."""

from __future__ import annotations


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) if i < 2 else c.rjust(w)   # noqa: E731
                                          for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    return "\n".join([fmt(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, rows)])
