"""A worker for `hpct run`'s tests that needs no torch (starts in milliseconds).

    launch_worker.py OUT MODE [ARG]

Every start writes OUT/start-<RANK>-<pid>.json with the environment the agent gave it.
Modes: ``sleep S`` (then exit 0); ``fail CODE`` (exit at once, before joining: a worker that
cannot start); ``joined-fail CODE`` (tell the agent its world formed, as hpct's backend does,
then exit CODE: its own failure, retried by --max-restarts); ``term`` (on SIGTERM write
OUT/term-<RANK>-<pid> and exit 0; otherwise sleep up to 60 s); ``until-replaced S [J]`` (the first
generation tells the agent its world formed after J seconds (default 0), as hpct's backend does,
writes OUT/joined-<RANK>-<pid> with the time.time() of that, and sleeps until S; a replacement
exits 0 at once); ``finish-or-wait S`` (the first generation joins, sleeps S and exits 0; a
replacement never joins and sleeps 120 s, as a worker waiting for a world that cannot form);
``finish-or-re-form S`` (the first generation joins; rank 0 sleeps S and exits 0, the others ask the
agent's view until it moves and go on asking for 120 s, as survivors re-forming; a replacement
never joins and sleeps 120 s); ``re-form-or-hang T`` (the first generation joins with an op
timeout of T s; rank 1 writes OUT/ready-<pid> and sleeps 120 s, as a hung worker; rank 0 waits for
OUT/go, asks the agent for a new world as recover() does after a failed collective, joins it and
watches the view until it moves again, then exits 0; a replacement exits 0 at once).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

from hpct import wire
from hpct.ports import host_of

out, mode = Path(sys.argv[1]), sys.argv[2]
arg = sys.argv[3] if len(sys.argv) > 3 else "0"
rank = os.environ["RANK"]
(out / f"start-{rank}-{os.getpid()}.json").write_text(json.dumps(dict(os.environ)))
if mode == "fail":
    print(f"worker {rank}: cannot start, on purpose", flush=True)
    sys.exit(int(arg))


def ask_agent(request: dict) -> dict:
    host = host_of(os.environ["HPCT_HOSTS"].split(","), int(rank), int(os.environ["N_PROC_PER_NODE"]))
    return wire.ask(host, int(os.environ["HPCT_AGENT_PORT"]), {**request, "place": int(rank), "pid": os.getpid()}, 5.0)


def joined(generation: int | None = None, **told) -> None:
    gen = int(os.environ["HPCT_GENERATION"]) if generation is None else generation
    ask_agent({"op": "joined", "generation": gen, **told})


def wait_for(path: Path, seconds: float) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > end:
            sys.exit(f"worker {rank}: {path} never came")
        time.sleep(0.05)


if mode == "joined-fail":
    joined()
    print(f"worker {rank}: failing after joining, generation {os.environ['HPCT_GENERATION']}", flush=True)
    sys.exit(int(arg))
if mode == "term":
    def on_term(signum, frame):
        (out / f"term-{rank}-{os.getpid()}").write_text("")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    (out / f"ready-{rank}-{os.getpid()}").write_text("")
    time.sleep(60)
    sys.exit(5)
if mode in ("finish-or-wait", "finish-or-re-form"):
    if int(os.environ["HPCT_GENERATION"]) > 0:
        time.sleep(120)
        sys.exit(0)
    joined()
    if mode == "finish-or-wait" or rank == "0":
        time.sleep(float(arg))
        sys.exit(0)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        ask_agent({"op": "world", "formed": 0})
        time.sleep(0.2)
    sys.exit(0)
if mode == "re-form-or-hang":
    if int(os.environ["HPCT_GENERATION"]) > 0:
        sys.exit(0)
    joined(op_timeout=float(arg))
    if rank == "1":
        (out / f"ready-{os.getpid()}").write_text("")
        time.sleep(120)
        sys.exit(0)
    wait_for(out / "go", 60)
    world = ask_agent({"op": "world", "formed": 0})
    joined(world["generation"], op_timeout=float(arg))
    end = time.monotonic() + 120
    while ask_agent({"op": "peek"})["generation"] <= world["generation"]:
        if time.monotonic() > end:
            sys.exit(f"worker {rank}: the view never moved past generation {world['generation']}")
        time.sleep(0.1)
    sys.exit(0)
if mode == "until-replaced":
    if int(os.environ["HPCT_GENERATION"]) > 0:
        sys.exit(0)
    start, join_after = time.monotonic(), float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    time.sleep(join_after)
    joined()
    (out / f"joined-{rank}-{os.getpid()}").write_text(repr(time.time()))
    time.sleep(max(0.0, float(arg) - (time.monotonic() - start)))
    sys.exit(0)
time.sleep(float(arg))
