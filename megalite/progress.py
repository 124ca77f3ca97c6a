"""Progress of long offline work (preprocessing, checkpoint conversion) on stderr.

    bar = ProgressBar(total=input_bytes, unit="MB", scale=1e6, count_name="docs")
    for batch in work: ...; bar.update(batch_bytes, count=len(batch))
    bar.update(0, final=True)

On a terminal one self-overwriting line (bar, amount, rate, ETA), redrawn 4 times a second; in a
log file (not a tty) a plain line every 10 seconds, so logs stay readable. Pure Python.
"""
from __future__ import annotations

import sys
import time


class ProgressBar:
    """`total` in the work's own unit (None: unknown, no bar or ETA); `scale` converts it to the
    shown `unit` (bytes -> MB: 1e6); `count_name` names the second counter (documents, tensors)."""

    def __init__(self, total: float | None, stream=None, *, unit: str = "MB", scale: float = 1e6,
                 count_name: str = "docs", label: str = ""):
        self.total, self.stream = total, stream or sys.stderr
        self.unit, self.scale, self.count_name, self.label = unit, scale, count_name, label
        self.start = self.last = time.perf_counter()
        self.done = self.count = 0
        self.live = getattr(self.stream, "isatty", lambda: False)()
        self.interval = 0.25 if self.live else 10.0

    def update(self, amount: float, count: int = 0, final: bool = False) -> None:
        """`amount` more of the work done (and `count` more items); `final`: the last line."""
        self.done += amount
        self.count += count
        now = time.perf_counter()
        if not final and now - self.last < self.interval:
            return
        self.last = now
        self.stream.write(self.line(now - self.start, final))
        self.stream.flush()

    def line(self, elapsed: float, final: bool) -> str:
        """What update writes: '\\r'-led and unterminated (until final) on a terminal, a whole line otherwise."""
        rate = self.done / self.scale / max(elapsed, 1e-9)
        head = tail = ""
        if self.total:
            fraction = 1.0 if final else min(self.done / self.total, 1.0)
            bar = "#" * int(30 * fraction) + "." * (30 - int(30 * fraction))
            head = f"[{bar}] {100 * fraction:5.1f}% "
            if not final and rate > 0:
                tail = f" eta {clock(max(0.0, self.total - self.done) / self.scale / rate)}"
        label = f"{self.label}: " if self.label else ""
        text = (f"{label}{head}{self.done / self.scale:8.1f} {self.unit} {rate:7.1f} {self.unit}/s "
                f"{self.count:9d} {self.count_name}{tail}")
        if self.live:
            return "\r" + text + ("\n" if final else "")
        return text + "\n"


def clock(seconds: float) -> str:
    """Seconds as 3m07s or 2h05m."""
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{secs:02d}s"
