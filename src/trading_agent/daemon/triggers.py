"""Market triggers: a desk wakes when its prices move, and when candles close.

A :class:`MarketWatcher` reads the new candles of a desk's price feed (replayed time on a
replay, the wall clock live) and fires:

- a **tick** trigger when a symbol's price moved at least ``move_percent`` since the desk
  last looked at it: the price of the last tick trigger the desk took for that symbol (at
  start, the price then). While the desk works, every further candle past the mark
  fires again; the desk's queue keeps only the newest per symbol and counts the others
  (``Trigger.merged``), and the mark moves when the desk takes it;
- a **candle** trigger when a candle of a configured timeframe closes (a ``1h`` candle
  closes with the feed's ``5m`` candle that ends the hour).

Before a step's triggers fire, the watcher awaits its ``on_step`` hook once per feed step
(the first new candle of a step: every candle of the step is visible by then). The daemon
matches the desk's resting paper orders and records its risk day there, so a desk woken by
a tick already sees the fills and balances of that candle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from decimal import Decimal

import anyio
from anyio.abc import TaskStatus

from trading_agent.agent.trigger import Trigger
from trading_agent.errors import TradingAgentError
from trading_agent.trading.exchange import Candle, timeframe_delta
from trading_agent.trading.feed import PriceFeed

__all__ = ["MarketWatcher"]


class MarketWatcher:
    """Turns one desk's feed into tick and candle triggers.

    Args:
        feed: The desk's price feed.
        symbols: The symbols the desk watches (others on the feed are ignored).
        fire: Queues a trigger for the desk (never blocks).
        move_percent: The move, in percent, that fires a tick; None for no tick triggers.
        candle_timeframes: Timeframes whose candle closes fire a trigger (``["1h"]``).
        on_step: Awaited once per new step of the feed, before its triggers fire.
    """

    def __init__(self, feed: PriceFeed, symbols: Sequence[str], fire: Callable[[Trigger], None],
                 *, move_percent: float | None = None, candle_timeframes: Sequence[str] = (),
                 on_step: Callable[[], Awaitable[None]] | None = None) -> None:
        self.feed = feed
        self.symbols = frozenset(symbols)
        self._fire = fire
        self.move_percent = move_percent
        self.candle_timeframes = list(candle_timeframes)
        for timeframe in self.candle_timeframes:
            timeframe_delta(timeframe)  # a bad timeframe fails at start, not at the hour
        self.marks: dict[str, Decimal] = {}
        """The price of each symbol when the desk last looked."""
        self._fired: dict[str, Decimal] = {}
        self._on_step = on_step
        self._step_closes: datetime | None = None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Watches the feed until it ends or the task is cancelled.

        Args:
            task_status: Told once subscribed (for ``TaskGroup.start``).
        """
        with self.feed.subscribe() as candles:
            await self.prime()
            task_status.started()
            async for candle in candles:
                if self._on_step is not None and candle.closes_at != self._step_closes:
                    self._step_closes = candle.closes_at
                    await self._on_step()
                if candle.symbol in self.symbols:
                    await self.observe(candle)

    async def prime(self) -> None:
        """Takes the current prices as the marks moves are measured from."""
        ticking = self.symbols if self.move_percent is not None else frozenset()
        for symbol in sorted(ticking - self.marks.keys()):
            # No price yet: the first candle seen sets the mark.
            with contextlib.suppress(TradingAgentError):
                self.marks[symbol] = (await self.feed.ticker(symbol)).last

    async def take_step(self, candles: Sequence[Candle]) -> None:
        """One whole feed step at once, as :meth:`run` takes it (a backtest moves its feed
        itself and calls this after each step): the ``on_step`` hook, then each candle.

        Args:
            candles: The step's candles, as :meth:`ReplayFeed.advance` returns them.
        """
        if not candles:
            return
        if self._on_step is not None:
            self._step_closes = candles[0].closes_at
            await self._on_step()
        for candle in candles:
            if candle.symbol in self.symbols:
                await self.observe(candle)

    async def observe(self, candle: Candle) -> None:
        """Fires what one new candle calls for.

        Args:
            candle: A newly completed candle of the feed.
        """
        self._check_move(candle)
        for timeframe in self.candle_timeframes:
            if _closes_bucket(candle, timeframe):
                await self._candle_closed(candle, timeframe)

    def desk_looked(self, trigger: Trigger) -> None:
        """Moves a symbol's mark when the desk takes a tick trigger for it.

        Args:
            trigger: The trigger the desk is starting a turn for.
        """
        if trigger.kind == "tick" and trigger.source in self._fired:
            self.marks[trigger.source] = self._fired.pop(trigger.source)

    def _check_move(self, candle: Candle) -> None:
        price = candle.close
        mark = self.marks.setdefault(candle.symbol, price)
        if self.move_percent is None or mark == 0:
            return
        move = (price - mark) / mark * 100
        if abs(move) < Decimal(str(self.move_percent)):
            return
        self._fired[candle.symbol] = price
        at = candle.closes_at
        self._fire(Trigger(
            kind="tick", source=candle.symbol, at=at.timestamp(),
            text=(f"{candle.symbol} moved {move:+.2f}% since you last looked: {mark} -> "
                  f"{price} (at {at:%Y-%m-%d %H:%M} UTC, feed time).")))

    async def _candle_closed(self, candle: Candle, timeframe: str) -> None:
        if timeframe == candle.timeframe:
            closed = candle
        else:
            # The bucket this candle ends (not the newest one: the feed may have moved on).
            opened_at = candle.closes_at - timeframe_delta(timeframe)
            found = await self.feed.candles(candle.symbol, timeframe, since=opened_at)
            if not found or found[0].opened_at != opened_at:
                return
            closed = found[0]
        when = f"{candle.closes_at:%Y-%m-%d %H:%M}"
        self._fire(Trigger(
            kind="candle", source=f"{candle.symbol} {timeframe}", at=candle.closes_at.timestamp(),
            text=(f"A {timeframe} candle of {closed.symbol} closed at {when} UTC (feed time): "
                  f"open {closed.open}, high {closed.high}, low {closed.low}, close "
                  f"{closed.close}, volume {closed.volume}.")))


def _closes_bucket(candle: Candle, timeframe: str) -> bool:
    """Whether ``candle`` is the last of an epoch-aligned ``timeframe`` bucket."""
    width = timeframe_delta(timeframe)
    if width < timeframe_delta(candle.timeframe):
        return False
    return int(candle.closes_at.timestamp()) % int(width.total_seconds()) == 0

