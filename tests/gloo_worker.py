"""One rank of a multi-process hpct._gloo test.

Run as ``python gloo_worker.py '<json spec>'``.  The spec holds ``rank``,
``size``, ``generation``, ``peers`` ([host, port] per rank), the timeouts and a
``script``: a list of steps executed in order.  Every observation is printed as
one JSON object per line on stdout (flushed at once), so the test can follow
the worker while it runs and parse everything at the end.  A step that raises
prints an ``error`` event with the exception type, message and time, and the
worker exits with status 3.

Only the installed ``hpct`` is imported; nothing here needs numpy or torch.
"""

from __future__ import annotations

import array
import json
import os
import sys
import threading
import time

import hpct._gloo as gloo

T0 = time.monotonic()


def emit(event: str, **fields) -> None:
    fields.update(event=event, t=round(time.monotonic() - T0, 4), pid=os.getpid())
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def collectives(ctx: "gloo.Context", elements: int = 1000) -> None:
    """Every collective on every dtype, compared with the exact expected values."""
    r, n = ctx.rank, ctx.size
    total = n * (n + 1) // 2
    for code in ("f", "d", "i", "q"):
        buf = array.array(code, [r + 1] * elements)
        ctx.allreduce(buf)
        check(all(x == total for x in buf), f"allreduce sum {code}: {buf[:4]} != {total}")
        buf = array.array(code, [r + 1] * 7)
        ctx.allreduce(buf, op="max")
        check(all(x == n for x in buf), f"allreduce max {code}")
        buf = array.array(code, [r + 1] * 7)
        ctx.allreduce(buf, op="min")
        check(all(x == 1 for x in buf), f"allreduce min {code}")
        buf = array.array(code, [2 if r < 3 else 1] * 5)
        ctx.allreduce(buf, op="product")
        check(all(x == 2 ** min(n, 3) for x in buf), f"allreduce product {code}")
    # bytearray with an explicit dtype
    raw = bytearray(array.array("i", [r] * 3).tobytes())
    ctx.allreduce(raw, dtype="int32")
    check(list(array.array("i", bytes(raw))) == [n * (n - 1) // 2] * 3, "allreduce bytearray")
    # broadcast from every root
    for root in sorted({0, n - 1, n // 2}):
        buf = array.array("d", [float(r * 100 + i) for i in range(elements)])
        ctx.broadcast(buf, root)
        check(list(buf) == [float(root * 100 + i) for i in range(elements)], f"broadcast root {root}")
    # allgather
    mine = array.array("q", [r * 1000 + i for i in range(5)])
    out = bytearray(len(mine.tobytes()) * n)
    ctx.allgather(mine, out)
    got = list(array.array("q", bytes(out)))
    check(got == [p * 1000 + i for p in range(n) for i in range(5)], "allgather")
    ctx.barrier()
    # point to point around the ring
    if n > 1:
        dst, src = (r + 1) % n, (r - 1) % n
        msg = array.array("i", [r] * 11)
        got = array.array("i", [0] * 11)
        if r % 2 == 0:
            ctx.send(msg, dst, tag=7)
            ctx.recv(got, src, tag=7)
        else:
            ctx.recv(got, src, tag=7)
            ctx.send(msg, dst, tag=7)
        check(list(got) == [src] * 11, "send/recv")
    ctx.barrier()


def small_allreduce(ctx: "gloo.Context", algorithm: str) -> dict:
    """Every reduce op on every dtype with exact expected values, then float sums whose
    bits depend on the reduction order: returned as hex, for the test to compare across
    ranks (every rank must hold the same bits)."""
    import random
    r, n = ctx.rank, ctx.size
    total = n * (n + 1) // 2
    for code in ("f", "d", "i", "q"):
        for op, mine, expect in (("sum", r + 1, total), ("max", r + 1, n), ("min", r + 1, 1),
                                 ("product", 2 if r < 3 else 1, 2 ** min(n, 3))):
            for elements in (1, 5):
                buf = array.array(code, [mine] * elements)
                ctx.allreduce(buf, op=op, algorithm=algorithm)
                check(list(buf) == [expect] * elements,
                      f"{algorithm} allreduce {op} {code} x{elements}: {list(buf)} != {expect}")
    rnd = random.Random(1000 + r)
    values = [rnd.uniform(-1, 1) * 10 ** rnd.randint(-6, 6) for _ in range(64)]
    out = {}
    for code in ("f", "d"):
        buf = array.array(code, values)
        ctx.allreduce(buf, algorithm=algorithm)
        out[code] = buf.tobytes().hex()
    return out


def error_fields(err: BaseException) -> dict:
    fields = {"type": type(err).__name__, "message": str(err),
              "classes": [c.__name__ for c in type(err).__mro__]}
    if hasattr(err, "newer_generation"):        # StaleGenerationError: the peers' generation
        fields["newer_generation"] = err.newer_generation
    return fields


def main() -> int:
    spec = json.loads(sys.argv[1])
    ctx = None
    abort_info: dict = {}

    def make(step: dict) -> "gloo.Context":
        # Liveness settings only where a test asks for them (the defaults otherwise).
        extra = {k: step.get(k, spec.get(k)) for k in
                 ("ack_timeout", "keepalive_idle", "keepalive_interval", "keepalive_count", "lazy",
                  "retry_delay_initial", "retry_delay_max", "float_doubling")
                 if step.get(k, spec.get(k)) is not None}
        # The suites that run in both connect modes set this (see the lazy_mode fixture).
        if os.environ.get("HPCT_TEST_LAZY") == "1":
            extra.setdefault("lazy", True)
        return gloo.Context(step.get("rank", spec["rank"]), step.get("size", spec["size"]),
                            step.get("generation", spec["generation"]),
                            [tuple(p) for p in step.get("peers", spec["peers"])],
                            timeout=step.get("timeout", spec.get("timeout", 30.0)),
                            connect_timeout=step.get("connect_timeout", spec.get("connect_timeout", 30.0)),
                            **extra)

    try:
        for step in spec["script"]:
            op = step["op"]
            if op == "sleep":
                time.sleep(step["seconds"])
            elif op == "connect":
                started = time.monotonic()
                ctx = make(step)
                emit("connected", seconds=round(time.monotonic() - started, 4),
                     rank=ctx.rank, size=ctx.size, generation=ctx.generation)
            elif op == "collectives":
                collectives(ctx, step.get("elements", 1000))
                emit("collectives_ok", rank=ctx.rank, generation=ctx.generation)
            elif op == "allreduce_loop":
                # Run allreduces for about `seconds` (rank 0's clock decides, through
                # the allreduce itself, so every rank stops after the same iteration);
                # check each result.
                n, r = ctx.size, ctx.rank
                deadline = time.monotonic() + step.get("seconds", 1.0)
                count = 0
                emit("loop_started")
                while True:
                    buf = array.array("f", [1.0]) * max(3, step.get("elements", 1000))
                    buf[0] = float(r)
                    buf[1] = 1.0 if (r == 0 and time.monotonic() >= deadline) else 0.0
                    ctx.allreduce(buf)
                    check(buf[0] == n * (n - 1) / 2 and buf[-1] == float(n), "allreduce_loop result")
                    count += 1
                    if buf[1] > 0:
                        break
                emit("loop_done", count=count)
            elif op == "allreduce":
                # One checked allreduce (sum of rank + 1 over every rank).
                n, r = ctx.size, ctx.rank
                buf = array.array("i", [r + 1] * step.get("elements", 16))
                ctx.allreduce(buf)
                check(all(x == n * (n + 1) // 2 for x in buf), f"allreduce result {buf[:4]}")
                emit("allreduce_ok", generation=ctx.generation)
            elif op == "small_allreduce":
                emit("small_allreduce", **small_allreduce(ctx, step.get("algorithm", "auto")))
            elif op == "connections":
                emit("connections", count=ctx.connections(), rank=ctx.rank)
            elif op == "ready":
                emit("ready")
            elif op == "wait_stdin":
                sys.stdin.readline()
            elif op == "abort_after":
                def aborter(delay=step["seconds"], c=ctx):
                    time.sleep(delay)
                    abort_info["called"] = time.monotonic()
                    c.abort(step.get("reason", "test abort"))
                    abort_info["returned"] = time.monotonic()
                threading.Thread(target=aborter, daemon=True).start()
            elif op == "expect_error":
                # Run an allreduce that must fail; report how and when.
                started = time.monotonic()
                try:
                    buf = array.array("f", [1.0]) * step.get("elements", 1 << 20)
                    while True:
                        ctx.allreduce(buf)
                        if not step.get("repeat", False):
                            break
                    emit("no_error")
                except gloo.GlooError as err:
                    failed = time.monotonic()
                    fields = error_fields(err)
                    fields["after_start"] = round(failed - started, 4)
                    if "called" in abort_info:
                        fields["after_abort_call"] = round(failed - abort_info["called"], 4)
                        fields["abort_call_seconds"] = round(
                            abort_info.get("returned", failed) - abort_info["called"], 4)
                    emit("op_error", **fields)
            elif op == "barrier":
                ctx.barrier()
                emit("barrier_ok")
            elif op == "send":
                # Blocking send of `elements` int32 (value i + 1000 * this rank) to `dst`.
                buf = array.array("i", [i + 1000 * ctx.rank for i in range(step.get("elements", 16))])
                ctx.send(buf, step["dst"], tag=step.get("tag", 0))
                emit("sent", dst=step["dst"])
            elif op == "recv":
                # Blocking receive from `src`; reports the data or how and when it failed
                # (`mono`: time.monotonic(), comparable across processes on Linux).
                started = time.monotonic()
                buf = array.array("i", [0] * step.get("elements", 16))
                try:
                    ctx.recv(buf, step["src"], tag=step.get("tag", 0))
                    emit("recv_ok", src=step["src"], data=list(buf),
                         seconds=round(time.monotonic() - started, 4))
                except gloo.GlooError as err:
                    fields = error_fields(err)
                    fields.update(seconds=round(time.monotonic() - started, 4), mono=time.monotonic())
                    emit("op_error", **fields)
            elif op == "abort":
                started = time.monotonic()
                ctx.abort(step.get("reason", "test abort"))
                emit("aborted", seconds=round(time.monotonic() - started, 4))
            elif op == "close":
                rejected = ctx.rejected_connections
                dropped = getattr(ctx, "dropped_connections", None)
                refusals = {str(k): list(v) for k, v in getattr(ctx, "refusals", {}).items()}
                started = time.monotonic()
                ctx.close()
                emit("closed", seconds=round(time.monotonic() - started, 4), rejected=rejected,
                     dropped=dropped, refusals=refusals)
                ctx = None
            elif op == "cycles":
                # Repeated init/collective/abort on the same ports, one generation each.
                # With "abort", a rank that finishes first resets its connections
                # while a slower peer may still be reading the last bytes of the
                # allreduce: that peer's allreduce then fails with PeerError (counted
                # as "raced"); anything else (address in use, connect timeout) fails.
                first = step.get("first_generation", 1)
                raced = 0
                for i in range(step["count"]):
                    c = make(dict(step, generation=first + i))
                    buf = array.array("i", [c.rank + i])
                    n = c.size
                    try:
                        c.allreduce(buf)
                        check(buf[0] == n * (n - 1) // 2 + n * i, f"cycle {i} result {buf[0]}")
                    except gloo.PeerError:
                        if step.get("end", "abort") != "abort":
                            raise
                        raced += 1
                    if step.get("end", "abort") == "abort":
                        c.abort(f"cycle {i} done")
                    c.close()
                emit("cycles_ok", count=step["count"], raced=raced)
            elif op == "expect_connect_error":
                started = time.monotonic()
                try:
                    ctx = make(step)
                    emit("no_error")
                except gloo.GlooError as err:
                    fields = error_fields(err)
                    fields["seconds"] = round(time.monotonic() - started, 4)
                    emit("connect_error", **fields)
            else:
                raise ValueError(f"unknown step {op!r}")
    except BaseException as err:  # noqa: BLE001 - everything is reported
        emit("error", **error_fields(err))
        return 3
    emit("exit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
