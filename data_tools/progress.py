"""A dependency-free progress line: documents/s, tokens/s, share of input read and ETA."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total_bytes: int, enabled: bool = True, every: float = 1.0, stream=None,
                 log_interval: int | None = None):
        """log_interval: a line each time another `log_interval` documents are done (Megatron's
        --log-interval), instead of one every `every` seconds. stream: sys.stderr as it is now
        (not as it was at import: a caller that redirects it gets the lines)."""
        stream = sys.stderr if stream is None else stream
        self.total, self.enabled, self.stream = total_bytes, enabled, stream
        self.start = self.last = time.time()
        self.every = every if stream.isatty() else 10.0   # logs: a line every 10 s
        self.tty = stream.isatty() and log_interval is None
        self.log_interval, self.logged = log_interval, 0

    def line(self, stats, done_bytes) -> str:
        elapsed = max(time.time() - self.start, 1e-9)
        frac = min(done_bytes / self.total, 1.0) if self.total else 0.0
        eta = f"{elapsed * (1 - frac) / frac:,.0f} s" if frac > 0 else "?"
        return (f"{stats.written:,} docs ({stats.written / elapsed:,.0f}/s), {stats.tokens:,} tokens "
                f"({stats.tokens / elapsed:,.0f}/s), {100 * frac:.1f}% of input, ETA {eta}")

    def update(self, stats, done_bytes) -> None:
        if self.enabled and self.log_interval is not None:
            if stats.written // self.log_interval > self.logged:
                self.logged = stats.written // self.log_interval
                print(self.line(stats, done_bytes), file=self.stream, flush=True)
            return
        if self.enabled and time.time() - self.last >= self.every:
            self.last = time.time()
            end = "\r" if self.tty else "\n"
            print(self.line(stats, done_bytes), end=end, file=self.stream, flush=True)

    def close(self, stats, done_bytes) -> None:
        if self.enabled and self.tty:
            print(self.line(stats, done_bytes), file=self.stream, flush=True)
