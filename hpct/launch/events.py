"""The agent's event log: one timestamped line per event on stderr, and JSON lines with ``--json``.

Every line names the node; the JSON document of each event carries the schema version, the
wall-clock time, the seconds since the agent started and the event's own fields (ranks, pids,
generations, exit codes), so a job's history can be replayed from the files of all nodes.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from ..cliutil import JSON_SCHEMA_VERSION


class EventLog:
    def __init__(self, node: int, json_path: Path | None = None, stream=None) -> None:
        self.node = node
        self.t0 = time.monotonic()
        self.stream = stream or sys.stderr
        self.lock = threading.Lock()
        self.file = None
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(json_path, "a", buffering=1)

    def emit(self, event: str, text: str, **fields) -> None:
        now = datetime.now(timezone.utc)
        since = time.monotonic() - self.t0
        with self.lock:
            print(f"hpct run [node {self.node}] {now:%H:%M:%S.%f}"[:-3] + f" {event}: {text}",
                  file=self.stream, flush=True)
            if self.file is not None:
                doc = {"schema_version": JSON_SCHEMA_VERSION, "time": now.isoformat(), "t": round(since, 6),
                       "node": self.node, "event": event, "message": text, **fields}
                self.file.write(json.dumps(doc) + "\n")

    def close(self) -> None:
        with self.lock:
            if self.file is not None:
                self.file.close()
                self.file = None
