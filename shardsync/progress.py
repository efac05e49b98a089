"""Progress of long work on stderr, quiet for short work: a line per finished stage once the
work has run ``after_s`` (a Kimi-K2 plan takes seconds; a tiny model's never prints)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, what: str, *, after_s: float = 2.0, stream: TextIO | None = None) -> None:
        self.what, self.after_s, self.stream = what, after_s, stream
        self.t0 = time.perf_counter()
        self.lines = 0

    def __call__(self, stage: str) -> None:
        """``stage`` finished: said with the seconds so far, once the work is past ``after_s``."""
        elapsed = time.perf_counter() - self.t0
        if elapsed >= self.after_s:
            print(f"{self.what}: {stage} ({elapsed:.1f} s)", file=self.stream or sys.stderr, flush=True)
            self.lines += 1
