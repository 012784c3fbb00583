"""Progress of long steps (opening, converting and uploading weights), drawn on stderr.

Code that does long work takes an optional `progress(step, done, total)` callable and
calls it with the step's name and how far it is (`done == total` ends the step); it
never prints itself. `ProgressBar` is the one the command line passes, `None` (the
default everywhere) keeps a library caller quiet. On a terminal the bar redraws in
place; elsewhere (CI logs, a pipe) each step writes one line when it ends, so logs
stay readable.
"""
from __future__ import annotations

import sys
import time

WIDTH = 24


class ProgressBar:
    def __init__(self, stream=None, min_interval: float = 0.1):
        self.stream = stream or sys.stderr
        self.min_interval = min_interval
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.step, self.started, self.drawn = None, 0.0, 0.0

    def __call__(self, step: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if step != self.step:
            self.step, self.started, self.drawn = step, now, 0.0
        finished = total > 0 and done >= total
        if finished:
            self._write(self._line(done, total, now), end="\n")
            self.step = None
        elif self.live and now - self.drawn >= self.min_interval:
            self.drawn = now
            self._write(self._line(done, total, now), end="")

    def _line(self, done: int, total: int, now: float) -> str:
        filled = WIDTH * done // total if total > 0 else 0
        bar = "#" * filled + "-" * (WIDTH - filled)
        return f"[kiec] {self.step:<15} [{bar}] {done}/{total} {now - self.started:.1f} s"

    def _write(self, line: str, end: str) -> None:
        self.stream.write(("\r" + line + "\x1b[K" if self.live else line) + end)
        self.stream.flush()


def report(progress, step: str, done: int, total: int) -> None:
    """Calls `progress` if there is one: producers write `report(progress, ...)` without a None check."""
    if progress is not None:
        progress(step, done, total)
