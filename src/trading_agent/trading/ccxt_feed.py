"""A live price feed from a real exchange's public market data, for the paper exchange.

The feed reads through an :class:`~trading_agent.trading.exchange.Exchange` (a
:class:`~trading_agent.trading.ccxt_exchange.CcxtExchange` opened for market data only), so
it inherits its retries and error translation. New candles are found by polling, once per
feed however many subscriptions it has (desks sharing a feed share its client and its rate
limit): whichever subscription runs out of candles first polls for all of them, the others
wait for that poll, and every poll's new candles go to every subscription.
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
    """New completed candles of every symbol of the feed, each once, oldest first.

    Created by :meth:`CcxtPriceFeed.subscribe`. It yields the candles found by the feed's
    polls from its creation on (a reader that lags gets them queued, none skipped). Use it
    as a context manager so the feed forgets it once closed.
    """

    def __init__(self, feed: CcxtPriceFeed) -> None:
        self._feed = feed
        self._pending: deque[Candle] = deque()
        self.closed = False

    def __aiter__(self) -> PollingSubscription:
        return self

    async def __anext__(self) -> Candle:
        while not self._pending:
            if self.closed:
                raise StopAsyncIteration
            await self._feed.poll_after(self._feed.polls)
        return self._pending.popleft()

    def deliver(self, candles: Sequence[Candle]) -> None:
        """Queues newly found candles (called by the feed's poll)."""
        if not self.closed:
            self._pending.extend(candles)

    def close(self) -> None:
        """Stops the subscription; the candles still queued are dropped."""
        if not self.closed:
            self.closed = True
            self._pending.clear()
            self._feed.unsubscribe(self)

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
        poll_seconds: How often the feed asks for new candles while it has subscriptions.
        sleep: How the feed waits between polls.
    """

    def __init__(self, exchange: Exchange, symbols: Sequence[str], *, timeframe: str = "5m",
                 poll_seconds: float = 10.0, sleep: Sleep = anyio.sleep) -> None:
        self.exchange = exchange
        self._symbols = list(symbols)
        self._timeframe = timeframe
        self.poll_seconds = poll_seconds
        self.sleep = sleep
        self._subscriptions: list[PollingSubscription] = []
        self._polling = anyio.Lock()
        self.polls = 0
        """How many polls have been tried (one number for every subscription to wait on)."""
        self._seen: dict[str, datetime] = {}
        self._noted = False
        self._tried = False

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
        """New completed candles of every symbol, found by the feed's polls."""
        subscription = PollingSubscription(self)
        self._subscriptions.append(subscription)
        return subscription

    def unsubscribe(self, subscription: PollingSubscription) -> None:
        """Forgets a reader (called by :meth:`PollingSubscription.close`)."""
        if subscription in self._subscriptions:
            self._subscriptions.remove(subscription)
        if not self._subscriptions:
            # Nobody listens: the next reader starts from where the candles then stand,
            # not from a backlog completed while nobody was there.
            self._seen.clear()
            self._noted = self._tried = False

    async def poll_after(self, polls: int) -> None:
        """Returns once a poll later than the ``polls``-th has been tried, polling if need be.

        One caller at a time polls (after ``poll_seconds``, but for the first poll since
        the feed had no subscriptions); the others, waiting their turn, find the poll done
        and return without asking the exchange again. A poll that fails for want of the
        exchange counts as tried (the exchange has already retried it).

        Args:
            polls: :attr:`polls` as the caller last saw it.
        """
        async with self._polling:
            if self.polls > polls:
                return
            if self._tried:
                await self.sleep(self.poll_seconds)
            try:
                await self._poll()
            except ExchangeUnavailableError:
                pass
            finally:
                self.polls += 1
                self._tried = True

    async def _poll(self) -> None:
        now = self.now()
        for symbol in self._symbols:
            candles = [c for c in await self.candles(symbol, limit=5) if c.closes_at <= now]
            if not candles:
                continue
            last_seen = self._seen.get(symbol)
            # The first poll only notes where the candles stand.
            if self._noted:
                new = [c for c in candles if last_seen is None or c.opened_at > last_seen]
                for subscription in list(self._subscriptions):
                    subscription.deliver(new if last_seen is not None else new[-1:])
            self._seen[symbol] = candles[-1].opened_at
        # Noted for the readers there are; if the last left meanwhile, the next reader notes anew.
        self._noted = bool(self._subscriptions)

    async def close(self) -> None:
        """Ends the subscriptions (the exchange belongs to whoever opened it)."""
        for subscription in list(self._subscriptions):
            subscription.close()

    def __repr__(self) -> str:
        return f"CcxtPriceFeed({self.exchange.name!r}, symbols={self._symbols})"
