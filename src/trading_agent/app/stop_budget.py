"""The SIGTERM promise: the daemon is gone within ten seconds of the signal, whatever hangs.

The desks get their ``shutdown_timeout_seconds`` (at most 8) to reach a safe point; the
event log half a second to be written; what is left before :data:`SINKS_DEADLINE_SECONDS`
is shared by the sinks that close together (webhooks, traces), each also held to its own
cap; the last :data:`RESERVED_SECONDS` are the local model's grace and a margin. A sink that
still waits on a receiver or a collector is abandoned (what it held is logged), never waited
for past the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio

__all__ = ["RESERVED_SECONDS", "SIGTERM_SECONDS", "SINKS_DEADLINE_SECONDS", "StopBudget",
           "close_sinks"]

SIGTERM_SECONDS = 10.0
"""What the README promises: from SIGTERM to exit."""

RESERVED_SECONDS = 1.5
"""Kept at the end: the local model's grace (1 s) and a margin."""

SINKS_DEADLINE_SECONDS = SIGTERM_SECONDS - RESERVED_SECONDS
"""When, after the signal, every sink must have closed."""

SinkClose = Callable[[float], Coroutine[Any, Any, None]]
"""Closes a sink within the seconds given."""


class StopBudget:
    """The time left of a shutdown.

    Args:
        clock: The monotonic clock (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started: float | None = None

    @property
    def started(self) -> bool:
        """Whether a signal started the countdown."""
        return self._started is not None

    def begin(self) -> None:
        """The signal came: the countdown starts (once)."""
        if self._started is None:
            self._started = self._clock()

    def left(self, cap: float) -> float:
        """Seconds a sink may still take: ``cap``, or less when the deadline is nearer
        (never below zero); ``cap`` when no signal started the countdown."""
        if self._started is None:
            return cap
        return max(0.0, min(cap, self._started + SINKS_DEADLINE_SECONDS - self._clock()))


async def close_sinks(closers: Sequence[SinkClose], budget: StopBudget,
                      cap: float) -> None:
    """Closes the sinks together, each within ``budget.left(cap)`` seconds.

    Args:
        closers: Each sink's close.
        budget: The shutdown's time left.
        cap: The most any sink gets.
    """
    within = budget.left(cap)
    with anyio.CancelScope(shield=True):
        async with anyio.create_task_group() as group:
            for close in closers:
                group.start_soon(close, within)
