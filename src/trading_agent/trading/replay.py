"""Recorded candles played back as if they were live, with replayed time as the clock.

The replay moves in steps, one candle time after another. After a step, :meth:`ReplayFeed.now`
is the close time of the candles just published, every reader sees those candles and none
after them, and every subscription yields them. :meth:`ReplayFeed.run` takes the steps at
``speed`` times real time (``speed=60``: a 5-minute candle every 5 seconds); with speed 0 it
goes as fast as the slowest subscriber gets through each step. :meth:`ReplayFeed.advance`
takes steps by hand (tests, benchmarks, a backtest driving its own loop).

Each symbol has its own CSV file, ``timestamp_ms,open,high,low,close,volume``, times being
candle opens in milliseconds since the epoch (any file a backtest reads works too: one
reader, :mod:`~trading_agent.trading.candle_csv`, serves both).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from types import TracebackType

import anyio
from anyio.abc import TaskStatus

from trading_agent.errors import ConfigError, ExchangeUnavailableError, OrderRejectedError
from trading_agent.trading.candle_csv import load_history_csv
from trading_agent.trading.config import ReplayConfig
from trading_agent.trading.exchange import Candle, OrderBook, Ticker, timeframe_delta
from trading_agent.trading.feed import resample
from trading_agent.trading.timing import Sleep

__all__ = ["ReplayFeed", "ReplaySubscription", "load_candles_csv"]

_DAY = timedelta(days=1)


def load_candles_csv(path: Path, symbol: str, timeframe: str = "5m") -> list[Candle]:
    """Reads one symbol's candles from a CSV file, with the one reader of candle files
    (:func:`~trading_agent.trading.candle_csv.load_history_csv`, which backtests use too).

    Args:
        path: The file: a time column (``timestamp_ms`` in the packaged file), then open,
            high, low, close, volume.
        symbol: The market the candles belong to.
        timeframe: Their timeframe.

    Returns:
        The candles, oldest first.

    Raises:
        ConfigError: The file is missing, or a line is malformed, out of order or leaves a
            gap (the message names the file and line).
    """
    return load_history_csv(path, symbol, timeframe)


class ReplaySubscription:
    """One reader's view of the replay: every step's candles, in order, none skipped.

    Created by :meth:`ReplayFeed.subscribe`. It starts after the step current when it was
    created. Use it as a context manager so the feed stops waiting for it once closed.
    """

    def __init__(self, feed: ReplayFeed) -> None:
        self._feed = feed
        self.position = feed.cursor
        """The last step whose candles this reader has been given."""
        self.done = feed.cursor
        """The last step this reader has finished with (it asked for more after it)."""
        self._pending: list[Candle] = []
        self.closed = False

    def __aiter__(self) -> ReplaySubscription:
        return self

    async def __anext__(self) -> Candle:
        if not self._pending and self.done < self.position:
            # Asking past the last candle given means the reader is through with its step:
            # only now may a replay at speed 0 move the clock on.
            self.done = self.position
            self._feed.notify_progress()
        while not self._pending:
            if self.closed:
                raise StopAsyncIteration
            if self.position < self._feed.cursor:
                self.position += 1
                self._pending = self._feed.step_candles(self.position)
                continue
            if self._feed.finished:
                raise StopAsyncIteration
            await self._feed.wait_for_step()
        return self._pending.pop(0)

    def close(self) -> None:
        """Unregisters the reader; iteration stops."""
        if not self.closed:
            self.closed = True
            self._feed.unsubscribe(self)

    def __enter__(self) -> ReplaySubscription:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


class ReplayFeed:
    """Candles from files, played back on a replayed clock.

    Args:
        series: Each symbol's candles, oldest first, all of ``timeframe``.
        timeframe: The candles' timeframe.
        speed: Times faster than real time; 0 or None for as fast as subscribers read.
        start_offset: How many steps are already in the past at the start (the history
            readers see at once).
        start: Start at the first step opening at or after this time (overrides
            ``start_offset``).
        sleep: How :meth:`run` waits between steps (``anyio.sleep``; tests pass a fake).

    Raises:
        ConfigError: No candles, or a series of another timeframe.
    """

    def __init__(
        self,
        series: Mapping[str, Sequence[Candle]],
        *,
        timeframe: str = "5m",
        speed: float | None = 60.0,
        start_offset: int = 0,
        start: datetime | None = None,
        sleep: Sleep = anyio.sleep,
    ) -> None:
        if not series or not any(series.values()):
            raise ConfigError("the replay has no candles")
        self._timeframe = timeframe
        self._step = timeframe_delta(timeframe)
        self._series: dict[str, list[Candle]] = {}
        self._opens: dict[str, list[datetime]] = {}
        self._volume_sums: dict[str, list[Decimal]] = {}
        for symbol, candles in series.items():
            if any(c.timeframe != timeframe or c.symbol != symbol for c in candles):
                raise ConfigError(f"the replay of {symbol} mixes symbols or timeframes")
            self._series[symbol] = list(candles)
            self._opens[symbol] = [c.opened_at for c in candles]
            # Running volume totals, so a ticker's 24h volume is one subtraction.
            sums = [Decimal(0)]
            for candle in candles:
                sums.append(sums[-1] + candle.volume)
            self._volume_sums[symbol] = sums
        self._timeline: list[datetime] = sorted({t for opens in self._opens.values()
                                                 for t in opens})
        self.speed = speed or 0.0
        self._sleep = sleep
        if start is not None:
            start = start if start.tzinfo else start.replace(tzinfo=UTC)
            self.cursor = bisect.bisect_left(self._timeline, start) - 1
        else:
            self.cursor = min(start_offset, len(self._timeline)) - 1
        """The index of the last published step (-1 before the first)."""
        self._subscribers: list[ReplaySubscription] = []
        self._stepped = anyio.Event()
        self._progress = anyio.Event()

    @classmethod
    def from_config(cls, config: ReplayConfig, *, sleep: Sleep = anyio.sleep) -> ReplayFeed:
        """Loads the configured files.

        Raises:
            ConfigError: A file is missing or malformed.
        """
        series = {symbol: load_candles_csv(Path(path), symbol, config.timeframe)
                  for symbol, path in config.files.items()}
        return cls(series, timeframe=config.timeframe, speed=config.speed,
                   start_offset=config.start_offset, start=config.start, sleep=sleep)

    # -- the clock -------------------------------------------------------------------------

    @property
    def timeframe(self) -> str:
        """The candles' timeframe."""
        return self._timeframe

    @property
    def symbols(self) -> Sequence[str]:
        """The replayed symbols."""
        return list(self._series)

    @property
    def steps(self) -> int:
        """How many steps the replay has in all."""
        return len(self._timeline)

    @property
    def finished(self) -> bool:
        """Whether every step has been published."""
        return self.cursor >= len(self._timeline) - 1

    def now(self) -> datetime:
        """The replayed time: the close of the latest published candles.

        Before the first step it is the first candle's open time.
        """
        if self.cursor < 0:
            return self._timeline[0]
        return self._timeline[self.cursor] + self._step

    # -- moving the replay -----------------------------------------------------------------

    def advance(self, steps: int = 1) -> list[Candle]:
        """Publishes the next ``steps`` steps at once.

        Args:
            steps: How many candle times to move forward.

        Returns:
            The candles published, in order (empty once the replay is finished).
        """
        published: list[Candle] = []
        for _ in range(steps):
            if self.finished:
                break
            self.cursor += 1
            published.extend(self.step_candles(self.cursor))
        if published:
            self._stepped.set()
            self._stepped = anyio.Event()
        return published

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Plays the remaining steps, then returns (the subscriptions then end).

        At speed 0 a step is published once every subscriber has finished with the previous
        one: it has asked for the candle after that step's last, so the work it does on a
        candle (a paper sync, a risk check) sees the candle's own time as :meth:`now`.

        Args:
            task_status: Told when the replay has started (for ``TaskGroup.start``).
        """
        task_status.started()
        interval = self._step.total_seconds() / self.speed if self.speed else 0.0
        while not self.finished:
            if interval:
                await self._sleep(interval)
            else:
                await self._wait_for_readers()
            self.advance()
        self._stepped.set()

    async def _wait_for_readers(self) -> None:
        while any(s.done < self.cursor for s in self._subscribers):
            await self._progress.wait()
        await anyio.lowlevel.checkpoint()

    # -- subscriptions ---------------------------------------------------------------------

    def subscribe(self) -> ReplaySubscription:
        """New candles of every symbol, each step's in symbol order, from the next step on."""
        subscription = ReplaySubscription(self)
        self._subscribers.append(subscription)
        return subscription

    def unsubscribe(self, subscription: ReplaySubscription) -> None:
        """Forgets a reader (called by :meth:`ReplaySubscription.close`)."""
        if subscription in self._subscribers:
            self._subscribers.remove(subscription)
        self.notify_progress()

    def notify_progress(self) -> None:
        """Wakes :meth:`run` waiting for readers (called as readers move)."""
        self._progress.set()
        self._progress = anyio.Event()

    async def wait_for_step(self) -> None:
        """Waits until the next step is published or the replay ends."""
        await self._stepped.wait()

    def step_candles(self, index: int) -> list[Candle]:
        """The candles opening at step ``index``, one per symbol that has one."""
        opened_at = self._timeline[index]
        found: list[Candle] = []
        for symbol, opens in self._opens.items():
            position = bisect.bisect_left(opens, opened_at)
            if position < len(opens) and opens[position] == opened_at:
                found.append(self._series[symbol][position])
        return found

    # -- reading ---------------------------------------------------------------------------

    def _require_symbol(self, symbol: str) -> None:
        if symbol not in self._series:
            raise OrderRejectedError(
                f"{symbol} is not replayed; the replay has {', '.join(self._series)}")

    def _visible_count(self, symbol: str) -> int:
        if self.cursor < 0:
            return 0
        return bisect.bisect_right(self._opens[symbol], self._timeline[self.cursor])

    def latest(self, symbol: str) -> Candle:
        """The newest published candle of ``symbol``.

        Raises:
            OrderRejectedError: The symbol is not replayed.
            ExchangeUnavailableError: Nothing of it has been published yet.
        """
        self._require_symbol(symbol)
        count = self._visible_count(symbol)
        if count == 0:
            raise ExchangeUnavailableError(f"the replay has no price for {symbol} yet")
        return self._series[symbol][count - 1]

    async def ticker(self, symbol: str) -> Ticker:
        """The latest close as the last price, with the change and volume of the last 24h.

        Raises:
            OrderRejectedError: The symbol is not replayed.
            ExchangeUnavailableError: Nothing of it has been published yet.
        """
        last = self.latest(symbol)
        count = self._visible_count(symbol)
        candles = self._series[symbol]
        day_ago = bisect.bisect_left(self._opens[symbol], last.opened_at - _DAY + self._step)
        reference = candles[day_ago - 1].close if day_ago > 0 else candles[day_ago].open
        volumes = self._volume_sums[symbol]
        return Ticker(
            symbol=symbol,
            last=last.close,
            at=self.now(),
            change_24h=(last.close / reference - 1) if reference else None,
            volume_24h=volumes[count] - volumes[day_ago],
        )

    async def candles(self, symbol: str, timeframe: str | None = None, limit: int | None = None,
                      since: datetime | None = None) -> Sequence[Candle]:
        """Published candles of ``symbol``, oldest first (see :meth:`PriceFeed.candles`).

        Raises:
            OrderRejectedError: Unknown symbol, or a timeframe not buildable from the replay's.
        """
        self._require_symbol(symbol)
        series = self._series[symbol]
        end = self._visible_count(symbol)
        start = 0 if since is None else min(end, bisect.bisect_left(self._opens[symbol], since))
        timeframe = timeframe or self._timeframe
        if timeframe == self._timeframe:
            if limit:
                start = max(start, end - limit)
            return series[start:end]
        try:
            target = timeframe_delta(timeframe)
        except ValueError as exc:
            raise OrderRejectedError(str(exc)) from exc
        if limit:
            # Only the tail is needed: enough candles for ``limit`` buckets, plus one bucket
            # of slack for alignment.
            start = max(start, end - (limit + 1) * max(1, int(target / self._step)))
        try:
            built = resample(series[start:end], timeframe)
        except ValueError as exc:
            raise OrderRejectedError(str(exc)) from exc
        return built[-limit:] if limit else built

    async def order_book(self, symbol: str, limit: int) -> OrderBook | None:
        """None: recorded candles carry no book."""
        return None

    async def close(self) -> None:
        """Ends every subscription."""
        for subscription in list(self._subscribers):
            subscription.close()
        self._stepped.set()

    def __repr__(self) -> str:
        return (f"ReplayFeed(symbols={list(self._series)}, timeframe={self._timeframe!r}, "
                f"speed={self.speed}, now={self.now().isoformat()})")

