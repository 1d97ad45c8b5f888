"""Each desk's equity over time, for the web page's chart.

A sample is the equity the desk's status reports (the figure the page's header shows: the
desk's own, ``TradingVenue.equity``), taken on a timer (once a minute by default, the marks
to market) and at once on every fill: an ``order_filled`` event (a resting paper order
filled on a later candle) or a ``place_order`` result saying the order filled. Samples go
to the daemon's store
(:meth:`~trading_agent.store.equity_samples.SqliteEquitySamples.record_equity_sample`, which
thins them as they grow), so the curve outlives a restart; without a store they are kept in
memory.

The curve :meth:`EquityHistory.curve` answers ends with the status's equity at that moment,
so the chart's last point and the header can never disagree.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio
import structlog

from trading_agent.agent.event_bus import Subscription
from trading_agent.agent.events import Event
from trading_agent.daemon.control import DeskControl, UnknownDeskError
from trading_agent.daemon.events import OrderFilled

__all__ = ["EquityHistory", "EquitySamples", "MemoryEquitySamples", "is_fill"]

_log = structlog.get_logger(__name__)

_FILL_BUFFER = 1000
"""Fills waiting to be sampled; past it the bus drops (and the timer's sample catches up)."""


class EquitySamples(Protocol):
    """Where the samples are kept: the daemon's store, or :class:`MemoryEquitySamples`."""

    async def record_equity_sample(self, desk: str, equity: float,
                                   at: float | None = None) -> None:
        """Adds a sample (the keeper bounds how many it keeps)."""
        ...

    async def equity_samples(self, desk: str) -> list[tuple[float, float]]:
        """A desk's samples as ``(at, equity)``, oldest first."""
        ...


class MemoryEquitySamples:
    """Samples in memory, the newest ``keep`` per desk (for an API without a store).

    Args:
        keep: How many samples are kept per desk.
        clock: Seconds since the epoch.
    """

    def __init__(self, keep: int = 1440, clock: Callable[[], float] = time.time) -> None:
        self._keep = keep
        self._clock = clock
        self._points: dict[str, deque[tuple[float, float]]] = {}

    async def record_equity_sample(self, desk: str, equity: float,
                                   at: float | None = None) -> None:
        """Adds a sample; the oldest goes past ``keep``."""
        points = self._points.setdefault(desk, deque(maxlen=self._keep))
        points.append((self._clock() if at is None else at, float(equity)))

    async def equity_samples(self, desk: str) -> list[tuple[float, float]]:
        """A desk's samples, oldest first."""
        return list(self._points.get(desk, ()))


def is_fill(event: Event) -> bool:
    """Whether an event says one of the desk's orders filled (so its equity moved).

    Args:
        event: An event of the daemon's bus.

    Returns:
        True for an ``order_filled`` event (every fill the desk's books count).
    """
    return isinstance(event, OrderFilled)


class EquityHistory:
    """Samples each desk's equity on a timer and on fills, and answers its curve.

    It subscribes to the daemon's bus at once, so a fill published after construction is
    sampled once :meth:`run` runs.

    Args:
        control: The daemon, asked for each desk's status.
        interval_seconds: Time between the timer's samples.
        samples: Where samples are kept (the daemon's store); in memory when None.
        clock: Seconds since the epoch.
        sampled: The desks whose equity this daemon samples (in a fleet, the desks it
            runs: each daemon samples its own); every desk by default.
    """

    def __init__(self, control: DeskControl, interval_seconds: float = 60.0, *,
                 samples: EquitySamples | None = None,
                 clock: Callable[[], float] = time.time,
                 sampled: Callable[[], Sequence[str]] | None = None) -> None:
        self._control = control
        self._sampled = sampled or control.desk_names
        self.interval_seconds = interval_seconds
        self._samples: EquitySamples = samples or MemoryEquitySamples(clock=clock)
        self._clock = clock
        self._fills: Subscription = control.event_bus.subscribe(
            "equity", max_buffer=_FILL_BUFFER, accept=is_fill)

    async def points(self, desk: str) -> list[tuple[float, float]]:
        """A desk's stored samples as ``(at, equity)``, oldest first."""
        return await self._samples.equity_samples(desk)

    async def curve(self, desk: str) -> list[tuple[float, float]]:
        """A desk's samples, ending with its status's equity now (when known): the figure
        its status, and so the page's header, shows.

        Raises:
            UnknownDeskError: No such desk.
        """
        points = await self.points(desk)
        status = await self._control.desk_status(desk)
        equity = status.equity
        if equity is not None and math.isfinite(equity):
            points.append((max(self._clock(), points[-1][0] if points else 0.0), float(equity)))
        return points

    async def record(self, desk: str, equity: float | None, at: float | None = None) -> None:
        """Adds a sample (ignored when the equity is unknown or not a finite number)."""
        if equity is None or not math.isfinite(equity):
            return
        await self._samples.record_equity_sample(desk, float(equity),
                                                 self._clock() if at is None else at)

    async def sample(self, desk: str) -> None:
        """Records a desk's equity now; a failure is logged, never raised (it must not end
        the sampling), and an unknown desk (removed by a reload) is skipped."""
        try:
            status = await self._control.desk_status(desk)
            await self.record(desk, status.equity)
        except UnknownDeskError:
            return
        except Exception as exc:
            _log.warning("equity_sample_failed", desk=desk, error=repr(exc))

    async def sample_once(self) -> None:
        """Records every desk's equity now."""
        for desk in self._sampled():
            await self.sample(desk)

    async def run(self) -> None:
        """Samples every ``interval_seconds``, and each desk at its fills, until cancelled
        or :meth:`close`."""
        async with anyio.create_task_group() as group:
            group.start_soon(self._sample_on_fills)
            while True:
                await self.sample_once()
                await anyio.sleep(self.interval_seconds)

    def close(self) -> None:
        """Stops listening for fills (the server is stopping)."""
        self._fills.close()

    async def _sample_on_fills(self) -> None:
        with self._fills:
            async for event in self._fills:
                # A burst of fills (one candle filling several orders) is one sample a desk;
                # "*" is the bus's drop report, which the timer's next sample makes up for.
                desks = {event.desk}
                while (more := self._fills.get_nowait()) is not None:
                    desks.add(more.desk)
                for desk in sorted(desks - {"*"}):
                    await self.sample(desk)
