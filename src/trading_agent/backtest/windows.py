"""Which spans a many-window backtest runs: pure functions of the range and a seed.

One window proves nothing: a positive return over one span says little without its spread
over many spans. ``--windows N --window DAYS`` picks N windows of DAYS inside ``--from`` ..
``--to``: at random start times (seeded, the default) or evenly spaced; ``--walk-forward``
cuts the range into consecutive windows of DAYS instead. Every start is on a candle
boundary, so each window runs whole candles.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

__all__ = ["Window", "choose_windows"]

Spacing = Literal["random", "even", "walk-forward"]


@dataclass(frozen=True, order=True)
class Window:
    """One span of a many-window run.

    Attributes:
        start: Its start (on a candle boundary).
        end: Its end.
    """

    start: datetime
    end: datetime

    @property
    def label(self) -> str:
        """``2023-01-05 14:00``, its start, as tables name it."""
        return f"{self.start:%Y-%m-%d %H:%M}"


def choose_windows(start: datetime, end: datetime, length: timedelta, *, count: int = 0,
                   spacing: Spacing = "random", seed: int = 0,
                   step: timedelta = timedelta(minutes=5)) -> list[Window]:
    """The windows of a run, oldest first.

    Args:
        start: The range's start.
        end: The range's end; no window goes past it.
        length: Each window's length.
        count: How many windows (``random`` and ``even``; ``walk-forward`` fits as many as
            the range holds).
        spacing: ``random`` (uniform start times from ``seed``), ``even`` (the first at
            ``start``, the last ending at ``end``) or ``walk-forward`` (consecutive).
        seed: The random starts' seed.
        step: The candles' timeframe: starts are rounded down to a multiple of it.

    Returns:
        The windows.

    Raises:
        ValueError: The range is shorter than one window, or ``count`` is below 1.
    """
    room = end - start - length
    if room < timedelta(0):
        raise ValueError(f"the range {start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M} is "
                         f"shorter than one window of {_days(length)}")
    if spacing == "walk-forward":
        count = int((end - start) // length)
        starts = [start + index * length for index in range(count)]
    else:
        if count < 1:
            raise ValueError("--windows must be 1 or more")
        slots = int(room // step)
        if spacing == "even":
            offsets = [0] if count == 1 else [round(i * slots / (count - 1)) for i in
                                              range(count)]
        else:
            rng = random.Random(f"windows {seed}")
            offsets = sorted(rng.randint(0, slots) for _ in range(count))
        starts = [start + offset * step for offset in offsets]
    return [Window(begin, begin + length) for begin in starts]


def _days(length: timedelta) -> str:
    days = length / timedelta(days=1)
    return f"{days:g} day{'s' if days != 1 else ''}"
