"""What the GPU proof's fault-path reports must show (issue 38), as checks the CPU tier tests too.

Each worker of tests/gpu prints one line per stage, ``<MODE> rank <r>: <stage>: <seconds> s (<detail>)``;
each function here reads those lines and returns the problems (an empty list: the run shows what
it must).  tests/test_gpu_pack.py runs them on lines of the kind the H200 printed and on broken
ones, so a check that cannot fail, or one that miscounts, shows here and not on a lent GPU.
"""

from __future__ import annotations

import re

_STAGE = re.compile(r"^(?P<mode>[A-Z]+) rank (?P<rank>\d+): (?P<stage>[^:]+): (?P<s>[0-9.]+) s(?: \((?P<detail>.*)\))?$")
HELD_OP_TIMEOUT_S = 5.0
HELD_SLACK_S = 12.0               # a watchdog period, the flag's wake, ncclCommAbort's bound (10 s)
SHUTDOWN_BOUND_S = 5.0            # the graph worker's engine.shutdown(5.0)


def stages(lines, mode: str) -> dict[tuple[int, str], tuple[float, str]]:
    """{(rank, stage): (seconds, detail)} of ``mode``'s lines; a stage printed twice is an error."""
    out: dict = {}
    for line in lines:
        m = _STAGE.match(line.strip())
        if not m or m["mode"] != mode:
            continue
        key = (int(m["rank"]), m["stage"])
        if key in out:
            raise ValueError(f"{mode} rank {key[0]} printed stage {key[1]!r} twice")
        out[key] = (float(m["s"]), m["detail"] or "")
    return out


def graph_problems(lines, n: int = 2) -> list[str]:
    """Capture right after warm-ups, exact replays, a barrier and an eager op after a replay, a
    shutdown that returns within its bound while the graph lives, the comm freed with the graph."""
    got, problems = stages(lines, "GRAPH"), []
    for r in range(n):
        def need(stage: str, detail: str, bound: float | None = None):
            if (r, stage) not in got:
                problems.append(f"rank {r}: no '{stage}' stage")
                return
            seconds, text = got[(r, stage)]
            if detail not in text:
                problems.append(f"rank {r}: {stage}: '{text}' lacks '{detail}'")
            if bound is not None and seconds > bound:
                problems.append(f"rank {r}: {stage} took {seconds:g} s, more than {bound:g} s")
        need("3 replays", "result exact")
        need("replay, then an eager all_reduce", "eager result 2")
        need("shutdown while the graph lives", "returned: True", SHUTDOWN_BOUND_S + 2.0)
        need("del graph", "comm freed after del graph: True", 10.0)
    return problems


def initfail_problems(lines, n: int = 2) -> list[str]:
    """Rank 0's init fails with rank 1 absent, its comm is aborted and freed, and both ranks form
    the next generation on the same slot."""
    got, problems = stages(lines, "INITFAIL"), []
    first = got.get((0, "init with rank 1 absent"))
    if first is None or "NcclConnectError" not in first[1]:
        problems.append(f"rank 0's first init did not fail with NcclConnectError: {first}")
    comm = got.get((0, "the failed init's comm"))
    if comm is None or "ended: aborted), freed: True" not in comm[1]:
        problems.append(f"the failed init's comm was not aborted and freed: {comm}")
    for r in range(n):
        again = got.get((r, "recover on the same slot"))
        if again is None or "re-formed on the same slot and summed exactly" not in again[1]:
            problems.append(f"rank {r} did not re-form on the same slot: {again}")
    return problems


def held_problems(line: str) -> list[str]:
    """The held launch ended with an error within the op timeout plus the slack, through the
    abort flag, and ncclCommAbort ran only after the call returned."""
    if not line.startswith("HELD"):
        return ["no HELD line"]
    problems = []
    took = float(line.split(": ", 1)[1].split(" s", 1)[0])
    if "unexpected" in line or "Error" not in line:
        problems.append("the held launch did not end with an error")
    if took > HELD_OP_TIMEOUT_S + HELD_SLACK_S:
        problems.append(f"the held launch ended after {took:g} s")
    if "flag first: True" not in line:
        problems.append("the abort flag was not the first step of the end")
    if "abort beside the call: False" not in line:
        problems.append("ncclCommAbort ran beside the held call")
    return problems
