"""Each desk's equity over time, sampled in memory for the web page's chart.

The daemon's status reports equity now; this keeps a day of samples per desk (one a minute
by default) so a page opened at any time can draw the recent curve. A restart starts afresh.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import anyio
import structlog

from trading_agent.daemon.control import DeskControl, UnknownDeskError

__all__ = ["EquityHistory"]

_log = structlog.get_logger(__name__)


class EquityHistory:
    """Samples of ``(time, equity)`` per desk.

    Args:
        control: The daemon, asked for each desk's status.
        interval_seconds: Time between samples.
        keep: How many samples are kept per desk.
        clock: Seconds since the epoch.
    """

    def __init__(self, control: DeskControl, interval_seconds: float = 60.0, keep: int = 1440,
                 clock: Callable[[], float] = time.time) -> None:
        self._control = control
        self.interval_seconds = interval_seconds
        self._keep = keep
        self._clock = clock
        self._points: dict[str, deque[tuple[float, float]]] = {}

    def points(self, desk: str) -> list[tuple[float, float]]:
        """A desk's samples, oldest first."""
        return list(self._points.get(desk, ()))

    def record(self, desk: str, equity: float | None, at: float | None = None) -> None:
        """Adds a sample (ignored when the equity is unknown)."""
        if equity is None:
            return
        points = self._points.setdefault(desk, deque(maxlen=self._keep))
        points.append((self._clock() if at is None else at, float(equity)))

    async def sample_once(self) -> None:
        """Asks every desk for its equity now."""
        for desk in self._control.desk_names():
            try:
                status = await self._control.desk_status(desk)
            except UnknownDeskError:
                continue
            except Exception as exc:  # a broken status must not end the sampling
                _log.warning("equity_sample_failed", desk=desk, error=repr(exc))
                continue
            self.record(desk, status.equity)

    async def run(self) -> None:
        """Samples every ``interval_seconds`` until cancelled."""
        while True:
            await self.sample_once()
            await anyio.sleep(self.interval_seconds)
