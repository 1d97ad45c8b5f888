"""The backtest's progress on the terminal: simulated time, decisions, equity, tokens, ETA.

On a terminal one line is redrawn in place (at most ten times a second); elsewhere (a log, a
CI job) a line is written at every tenth of the run, so the output stays readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from trading_agent.backtest.engine import Progress
from trading_agent.trading.formatting import format_amount

__all__ = ["ProgressBar", "format_duration"]

_WIDTH = 24
_REDRAW_SECONDS = 0.1


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h10m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _tokens(count: int) -> str:
    if count >= 1_000_000:
        return f"{count / 1_000_000:.1f}M"
    if count >= 1_000:
        return f"{count / 1_000:.1f}k"
    return str(count)


class ProgressBar:
    """Draws :class:`Progress` reports.

    Args:
        label: What is running (the desk's name).
        stream: Where to draw (standard error by default).
    """

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self._label = label
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._drawn = 0.0
        self._tenth = -1
        self._last: Progress | None = None

    def line(self, progress: Progress) -> str:
        """One report as text."""
        share = progress.step / progress.steps if progress.steps else 1.0
        filled = round(share * _WIDTH)
        bar = "#" * filled + "-" * (_WIDTH - filled)
        remaining = (progress.elapsed / share - progress.elapsed) if share else 0.0
        cached = f", {progress.cache_hits} cached" if progress.cache_hits else ""
        return (f"{self._label} [{bar}] {share:4.0%} {progress.now:%Y-%m-%d %H:%M} UTC | "
                f"{progress.decisions} decisions | equity "
                f"{format_amount(progress.equity, progress.quote_currency)} | "
                f"{_tokens(progress.tokens)} tokens ({progress.model_calls} calls{cached}) | "
                f"ETA {format_duration(remaining)}")

    def __call__(self, progress: Progress) -> None:
        self._last = progress
        if self._tty:
            now = time.monotonic()
            if now - self._drawn >= _REDRAW_SECONDS or progress.step == progress.steps:
                self._drawn = now
                self._stream.write("\r\x1b[2K" + self.line(progress))
                self._stream.flush()
            return
        tenth = progress.step * 10 // max(progress.steps, 1)
        if tenth != self._tenth:
            self._tenth = tenth
            self._stream.write(self.line(progress) + "\n")
            self._stream.flush()

    def finish(self) -> None:
        """Ends the redrawn line."""
        if self._tty and self._last is not None:
            self._stream.write("\n")
            self._stream.flush()
