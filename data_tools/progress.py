"""A dependency-free progress line: documents/s, tokens/s, share of input read and ETA."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total_bytes: int, enabled: bool = True, every: float = 1.0, stream=sys.stderr):
        self.total, self.enabled, self.stream = total_bytes, enabled, stream
        self.start = self.last = time.time()
        self.every = every if stream.isatty() else 10.0   # logs: a line every 10 s
        self.tty = stream.isatty()

    def line(self, stats, done_bytes) -> str:
        elapsed = max(time.time() - self.start, 1e-9)
        frac = min(done_bytes / self.total, 1.0) if self.total else 0.0
        eta = f"{elapsed * (1 - frac) / frac:,.0f} s" if frac > 0 else "?"
        return (f"{stats.written:,} docs ({stats.written / elapsed:,.0f}/s), {stats.tokens:,} tokens "
                f"({stats.tokens / elapsed:,.0f}/s), {100 * frac:.1f}% of input, ETA {eta}")

    def update(self, stats, done_bytes) -> None:
        if self.enabled and time.time() - self.last >= self.every:
            self.last = time.time()
            end = "\r" if self.tty else "\n"
            print(self.line(stats, done_bytes), end=end, file=self.stream, flush=True)

    def close(self, stats, done_bytes) -> None:
        if self.enabled and self.tty:
            print(self.line(stats, done_bytes), file=self.stream, flush=True)
