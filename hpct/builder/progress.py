"""Progress lines for long steps (downloads, builds), on stderr so --json stays clean."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, quiet: bool = False, stream=None) -> None:
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.t0 = time.monotonic()
        self._last_bytes = 0.0

    def step(self, text: str) -> None:
        if not self.quiet:
            print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", file=self.stream, flush=True)

    def bytes(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.quiet or (now - self._last_bytes < 1.0 and done != total):
            return
        self._last_bytes = now
        of = f" of {total / 1e6:.1f} MB" if total else ""
        print(f"          {done / 1e6:.1f} MB{of}", file=self.stream, flush=True)
