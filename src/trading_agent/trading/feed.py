"""Price feeds: where the paper exchange and the tick triggers get prices and time.

A feed is a clock plus candles. :class:`~trading_agent.trading.replay.ReplayFeed` plays
recorded candles, and its clock is the replayed time;
:class:`~trading_agent.trading.ccxt_feed.CcxtPriceFeed` reads a real exchange's public data,
and its clock is the wall clock. Either way a consumer
sees only completed candles, never the future.

A daemon subscribes to new candles like this::

    with feed.subscribe() as candles:
        async for candle in candles:
            ...  # a tick trigger for candle.symbol
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from decimal import Decimal
from types import TracebackType
from typing import Protocol, runtime_checkable

from trading_agent.trading.exchange import Candle, OrderBook, Ticker, timeframe_delta

__all__ = ["CandleSubscription", "PriceFeed", "resample"]


@runtime_checkable
class CandleSubscription(Protocol):
    """New completed candles, in time order, until the feed ends or the subscription closes.

    Use it as a context manager so that it is closed (unregistered) when the reader stops.
    """

    def __aiter__(self) -> AsyncIterator[Candle]:
        """Iterates over new candles."""
        ...

    async def __anext__(self) -> Candle:
        """The next new candle; waits for it."""
        ...

    def close(self) -> None:
        """Stops the subscription; the feed no longer waits for this reader."""
        ...

    def __enter__(self) -> CandleSubscription:
        """Returns itself."""
        ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """Closes the subscription."""
        ...


@runtime_checkable
class PriceFeed(Protocol):
    """Prices, candles and time for a set of symbols."""

    @property
    def timeframe(self) -> str:
        """The timeframe of the feed's own candles (``5m``)."""
        ...

    @property
    def symbols(self) -> Sequence[str]:
        """The symbols the feed carries."""
        ...

    def now(self) -> datetime:
        """The feed's clock (replayed time on a replay)."""
        ...

    async def ticker(self, symbol: str) -> Ticker:
        """The latest price of ``symbol``.

        Raises:
            OrderRejectedError: The feed does not carry ``symbol``.
            ExchangeUnavailableError: There is no price yet, or the source cannot be reached.
        """
        ...

    async def candles(self, symbol: str, timeframe: str | None = None, limit: int | None = None,
                      since: datetime | None = None) -> Sequence[Candle]:
        """Candles of ``symbol``, oldest first.

        Args:
            symbol: The market.
            timeframe: The candles' timeframe; the feed's own by default. A replay builds
                longer timeframes from its own candles.
            limit: Return at most this many, the newest.
            since: Only candles opening at or after this time.
        """
        ...

    async def order_book(self, symbol: str, limit: int) -> OrderBook | None:
        """The real order book, or None when the feed has none (a replay)."""
        ...

    def subscribe(self) -> CandleSubscription:
        """New completed candles of every symbol, as they arrive."""
        ...

    async def close(self) -> None:
        """Releases what the feed holds."""
        ...


def resample(candles: Sequence[Candle], timeframe: str) -> list[Candle]:
    """Builds candles of a longer ``timeframe`` from consecutive shorter ones.

    Buckets are aligned to the epoch (a 1h candle opens on the hour, as exchanges do). The
    last bucket may be incomplete, like the forming candle an exchange returns.

    Args:
        candles: Candles of one symbol and one timeframe, oldest first.
        timeframe: The target timeframe; a multiple of the candles' own.

    Returns:
        The resampled candles, oldest first.

    Raises:
        ValueError: The target is not a multiple of the candles' timeframe.
    """
    if not candles:
        return []
    source = timeframe_delta(candles[0].timeframe)
    target = timeframe_delta(timeframe)
    if target == source:
        return list(candles)
    if target < source or target % source:
        raise ValueError(f"cannot build {timeframe} candles from {candles[0].timeframe} ones")
    width = int(target.total_seconds())
    result: list[Candle] = []
    bucket: list[Candle] = []
    bucket_start = 0
    for candle in candles:
        start = int(candle.opened_at.timestamp()) // width * width
        if bucket and start != bucket_start:
            result.append(_merge(bucket, timeframe))
            bucket = []
        bucket_start = start
        bucket.append(candle)
    if bucket:
        result.append(_merge(bucket, timeframe))
    return result


def _merge(bucket: list[Candle], timeframe: str) -> Candle:
    first = bucket[0]
    width = timeframe_delta(timeframe)
    since_epoch = first.opened_at - datetime.fromtimestamp(0, first.opened_at.tzinfo)
    return Candle(
        symbol=first.symbol,
        timeframe=timeframe,
        opened_at=first.opened_at - since_epoch % width,
        open=first.open,
        high=max(c.high for c in bucket),
        low=min(c.low for c in bucket),
        close=bucket[-1].close,
        volume=sum((c.volume for c in bucket), Decimal(0)),
    )
