"""A live price feed from a real exchange's public market data, for the paper exchange.

The feed reads through an :class:`~trading_agent.trading.exchange.Exchange` (a
:class:`~trading_agent.trading.ccxt_exchange.CcxtExchange` opened for market data only), so
it inherits its retries and error translation. New candles are found by polling.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from datetime import datetime
from types import TracebackType

import anyio

from trading_agent.errors import ExchangeUnavailableError
from trading_agent.trading.exchange import Candle, Exchange, OrderBook, Ticker
from trading_agent.trading.timing import Sleep

__all__ = ["CcxtPriceFeed", "PollingSubscription"]


class PollingSubscription:
    """New completed candles, found by asking the exchange every ``poll_seconds``.

    The first poll only notes where the candles stand; candles completed after it are
    yielded, each once, oldest first. A poll that fails for want of the exchange is skipped.
    """

    def __init__(self, feed: CcxtPriceFeed) -> None:
        self._feed = feed
        self._seen: dict[str, datetime] = {}
        self._pending: deque[Candle] = deque()
        self._polled = False
        self.closed = False

    def __aiter__(self) -> PollingSubscription:
        return self

    async def __anext__(self) -> Candle:
        while not self._pending:
            if self.closed:
                raise StopAsyncIteration
            if self._polled:
                await self._feed.sleep(self._feed.poll_seconds)
            try:
                await self._poll()
            except ExchangeUnavailableError:
                continue
            self._polled = True
        return self._pending.popleft()

    async def _poll(self) -> None:
        now = self._feed.now()
        for symbol in self._feed.symbols:
            candles = [c for c in await self._feed.candles(symbol, limit=5)
                       if c.closes_at <= now]
            if not candles:
                continue
            last_seen = self._seen.get(symbol)
            if self._polled and last_seen is not None:
                self._pending.extend(c for c in candles if c.opened_at > last_seen)
            elif self._polled:
                self._pending.extend(candles[-1:])
            self._seen[symbol] = candles[-1].opened_at

    def close(self) -> None:
        """Stops the subscription."""
        self.closed = True

    def __enter__(self) -> PollingSubscription:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


class CcxtPriceFeed:
    """Prices and candles of a real exchange.

    Args:
        exchange: Where the data comes from (its clock is the feed's clock).
        symbols: The symbols the feed carries.
        timeframe: The timeframe of the feed's candles.
        poll_seconds: How often subscriptions ask for new candles.
        sleep: How subscriptions wait between polls.
    """

    def __init__(self, exchange: Exchange, symbols: Sequence[str], *, timeframe: str = "5m",
                 poll_seconds: float = 10.0, sleep: Sleep = anyio.sleep) -> None:
        self.exchange = exchange
        self._symbols = list(symbols)
        self._timeframe = timeframe
        self.poll_seconds = poll_seconds
        self.sleep = sleep
        self._subscriptions: list[PollingSubscription] = []

    @property
    def timeframe(self) -> str:
        """The feed's timeframe."""
        return self._timeframe

    @property
    def symbols(self) -> Sequence[str]:
        """The symbols carried."""
        return self._symbols

    def now(self) -> datetime:
        """The exchange's clock (the wall clock)."""
        return self.exchange.now()

    async def ticker(self, symbol: str) -> Ticker:
        """The exchange's ticker."""
        return await self.exchange.fetch_ticker(symbol)

    async def candles(self, symbol: str, timeframe: str | None = None, limit: int | None = None,
                      since: datetime | None = None) -> Sequence[Candle]:
        """The exchange's candles, oldest first; the last may still be forming."""
        return await self.exchange.fetch_candles(symbol, timeframe or self._timeframe,
                                                 limit or 500, since)

    async def order_book(self, symbol: str, limit: int) -> OrderBook | None:
        """The exchange's book."""
        return await self.exchange.fetch_order_book(symbol, limit)

    def subscribe(self) -> PollingSubscription:
        """New completed candles of every symbol, found by polling."""
        subscription = PollingSubscription(self)
        self._subscriptions.append(subscription)
        return subscription

    async def close(self) -> None:
        """Ends the subscriptions (the exchange belongs to whoever opened it)."""
        for subscription in self._subscriptions:
            subscription.close()

    def __repr__(self) -> str:
        return f"CcxtPriceFeed({self.exchange.name!r}, symbols={self._symbols})"
