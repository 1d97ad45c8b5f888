"""Time, injectable: the clock and the sleep the trading layer uses.

Live venues read the wall clock; a replay supplies its own. Backoff waits go through a
``Sleep`` so that tests replace it with one that returns at once and records the delay.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

__all__ = ["Clock", "Sleep", "from_millis", "to_millis", "utc_now"]

Clock = Callable[[], datetime]
"""Returns the current time, an aware UTC datetime."""

Sleep = Callable[[float], Awaitable[None]]
"""Waits the given number of seconds (``anyio.sleep`` in production)."""


def utc_now() -> datetime:
    """The wall clock, in UTC."""
    return datetime.now(UTC)


def from_millis(milliseconds: int | float) -> datetime:
    """An aware UTC datetime from milliseconds since the epoch."""
    return datetime.fromtimestamp(milliseconds / 1000, UTC)


def to_millis(moment: datetime) -> int:
    """Milliseconds since the epoch of an aware datetime."""
    return round(moment.timestamp() * 1000)
