"""A desk's view of its exchange: the account's prices and balances, the desk's own orders
and positions.

:class:`BookedExchange` wraps the exchange a desk trades on (paper or ccxt) and keeps the
desk's books on the way through. Every order is noted in the books before the exchange sees
it; every order the exchange reports back (placed, fetched, cancelled, looked up) is
observed, so what filled is counted once, whoever asked. What a desk reads of the account
is then its own:

- :meth:`fetch_positions` is the desk's position by its own fills, marked at the market,
  not the account's balance (which may hold the user's coins or another desk's);
- :meth:`fetch_open_orders` lists only the desk's orders (an order the user placed by hand,
  or another desk's, is not this desk's to count or to cancel);
- the risk policy, the flatten of a kill switch and the ``get_positions`` tool all read
  these, so a desk's limits and its flatten act on what it holds itself.

:meth:`refresh` looks at the desk's resting orders (once per candle, before its triggers):
on a paper venue after its matcher, on a live one at the exchange. It returns the fills it
counted, for the daemon to announce.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Literal

import structlog

from trading_agent.errors import ExchangeError, OrderRejectedError
from trading_agent.trading.books import (
    PROTECTION_TURNS,
    ZERO,
    BookFill,
    BookOrder,
    DeskBookRecords,
)
from trading_agent.trading.exchange import (
    Balance,
    Candle,
    Exchange,
    Market,
    Order,
    OrderBook,
    OrderRequest,
    Position,
    Ticker,
)

__all__ = ["STARTING_TURN", "BookedExchange"]

_LOOK_UP_AFTER = timedelta(minutes=1)
"""How old (on the exchange clock) an order noted without an answer must be before a
refresh looks it up by client order id: younger, it may still be on its way."""

_LOST_AFTER = timedelta(hours=1)
"""How long a live exchange may take to show an order before it counts as never placed."""

_log = structlog.get_logger(__name__)

STARTING_TURN = "start"
"""The turn noted for what a paper account held before its books were kept (its starting
coins, or an account from before books existed)."""


class BookedExchange:
    """An exchange as one desk sees it, its books kept on the way through.

    Args:
        inner: The exchange the desk trades on.
        records: The desk's books in the store.
    """

    def __init__(self, inner: Exchange, records: DeskBookRecords) -> None:
        self.inner = inner
        self.records = records
        self.on_fill: Callable[[BookFill], object] | None = None
        """Called with each fill the moment the books count it (the daemon announces it)."""
        self.before_order: Callable[[OrderRequest], Awaitable[None]] | None = None
        """Awaited before each order is sent (the desk's protection keeper cancels the
        exchange-held stop of a position the order reduces)."""
        self._fresh: list[BookFill] = []
        self._none_open = False
        """True once a refresh found no order that may still fill, until the next is noted:
        the refresh on every candle then reads nothing (this exchange notes all the desk's
        orders)."""

    # ------------------------------------------------------------------ the account's

    @property
    def name(self) -> str:
        """The exchange's name."""
        return self.inner.name

    def now(self) -> datetime:
        """The exchange clock."""
        return self.inner.now()

    async def markets(self) -> Mapping[str, Market]:
        """The tradable markets."""
        return await self.inner.markets()

    async def fetch_ticker(self, symbol: str) -> Ticker:
        """The latest price."""
        return await self.inner.fetch_ticker(symbol)

    async def fetch_order_book(self, symbol: str, limit: int = 10) -> OrderBook:
        """The best levels of the book."""
        return await self.inner.fetch_order_book(symbol, limit)

    async def fetch_candles(self, symbol: str, timeframe: str = "5m", limit: int = 100,
                            since: datetime | None = None) -> Sequence[Candle]:
        """Candles, oldest first."""
        return await self.inner.fetch_candles(symbol, timeframe, limit, since)

    async def fetch_balances(self) -> Mapping[str, Balance]:
        """The account's balances (every desk's, and the user's own, on a shared one).

        On a live exchange the desk's orders that may have filled are looked at first: the
        balances read are noted as seen for reconciliation on the next start, which takes
        every fill counted after them as a change they do not show yet; a fill the balances
        already show must be counted before them.
        """
        if hasattr(self.inner, "order_journal"):
            await self._look_at_waiting_orders()
        return await self.inner.fetch_balances()

    # ------------------------------------------------------------------ the desk's own

    async def fetch_positions(self, symbols: Sequence[str] | None = None) -> Sequence[Position]:
        """The desk's own positions, by its fills, marked at the last price."""
        held = await self.records.positions()
        positions = []
        for symbol in sorted(held):
            position = held[symbol]
            if position.amount == 0 or (symbols is not None and symbol not in symbols):
                continue
            mark = (await self.inner.fetch_ticker(symbol)).last
            positions.append(Position(symbol, "long" if position.amount > 0 else "short",
                                      abs(position.amount), mark, position.entry_price))
        return positions

    async def fetch_open_orders(self, symbol: str | None = None) -> Sequence[Order]:
        """The desk's own resting orders, its protective orders left out (they only take
        risk off, and the protection keeper owns them). Not counted from here: an
        exchange's list of open orders may leave out what a partial fill paid (Binance's
        does), and the books count a fill's fee with the fill; :meth:`refresh` looks at
        each order itself."""
        ours = {order.client_order_id for order in await self.records.orders(open_only=True)
                if order.turn not in PROTECTION_TURNS}
        return [order for order in await self.inner.fetch_open_orders(symbol)
                if order.client_order_id in ours]

    async def note(self, request: OrderRequest) -> None:
        """Notes an order in the desk's books before it is sent."""
        self._none_open = False
        await self.records.note_order(BookOrder(
            request.client_order_id, request.symbol, request.side, request.type,
            request.amount, request.price, request.turn, self.inner.now()))

    async def observe(self, order: Order) -> None:
        """Counts what an order of the desk filled (an order placed past :meth:`create_order`,
        such as a simulated protection's exit)."""
        await self._observe(order)

    async def create_order(self, request: OrderRequest) -> Order:
        """Notes the order in the desk's books, then places it."""
        if self.before_order is not None:
            await self.before_order(request)
        await self.note(request)
        try:
            order = await self.inner.create_order(request)
        except OrderRejectedError:
            await self.records.settle(request.client_order_id, "rejected")
            raise
        await self._observe(order)
        return order

    async def cancel_order(self, order_id: str, symbol: str) -> Order:
        """Cancels an order and counts what it filled before."""
        order = await self.inner.cancel_order(order_id, symbol)
        await self._observe(order)
        return order

    async def fetch_order(self, order_id: str, symbol: str) -> Order:
        """An order's state (what it filled is counted)."""
        order = await self.inner.fetch_order(order_id, symbol)
        await self._observe(order)
        return order

    async def fetch_order_by_client_id(self, client_order_id: str, symbol: str) -> Order:
        """An order by the desk's client order id (what it filled is counted).

        Raises:
            OrderRejectedError: The exchange has no such order.
        """
        lookup = getattr(self.inner, "fetch_order_by_client_id")  # noqa: B009 (both kinds)
        order: Order = await lookup(client_order_id, symbol)
        await self._observe(order)
        return order

    async def refresh(self, *, on_start: bool = False) -> list[BookFill]:
        """Looks at each of the desk's orders that may still fill and counts what did.

        Args:
            on_start: The daemon is starting: an order noted but never answered is looked
                up by its client order id at once, however young (no request of this
                process can still be on its way; the one that sent it is gone), so what it
                filled while the daemon was down is the desk's before reconciliation.

        Returns:
            The fills counted since the last call (by this look or by any other way the
            desk learned of them: an order's answer, a tool's look), oldest first.
        """
        fresh, self._fresh = self._fresh, []
        await self._look_at_waiting_orders(on_start=on_start)
        fresh.extend(self._fresh)
        self._fresh = []
        return fresh

    async def _look_at_waiting_orders(self, *, on_start: bool = False) -> None:
        if self._none_open and not on_start:
            return
        now = self.inner.now()
        waiting = await self.records.orders(open_only=True)
        self._none_open = not waiting
        for noted in waiting:
            try:
                if noted.order_id is not None:
                    await self.fetch_order(noted.order_id, noted.symbol)
                elif on_start or now - noted.noted_at >= _LOOK_UP_AFTER:
                    await self._look_up(noted, now)
            except ExchangeError as exc:
                _log.warning("books_refresh_failed", desk=self.records.desk,
                             client_order_id=noted.client_order_id, error=str(exc))

    def take_fresh(self) -> list[BookFill]:
        """The fills counted since the last :meth:`refresh` (or call of this), oldest
        first; they will not be returned again."""
        fresh, self._fresh = self._fresh, []
        return fresh

    async def adopt_holdings(self, positions: Sequence[Position]) -> None:
        """Takes what a paper account holds into books that have never seen an order: its
        starting coins, or an account traded before books were kept. Each holding becomes
        an opening fill at its cost (at its mark when the cost is unknown). A live account's
        holdings are never adopted: they may be the user's or another desk's.
        """
        if await self.records.orders():
            return
        at = self.inner.now()
        for position in positions:
            client_order_id = f"{STARTING_TURN}-{position.symbol}"
            side: Literal["buy", "sell"] = "buy" if position.side == "long" else "sell"
            await self.records.note_order(BookOrder(
                client_order_id, position.symbol, side, "market", position.amount, None,
                STARTING_TURN, at))
            price = position.entry_price or position.mark_price
            await self._observe(Order(
                client_order_id, client_order_id, position.symbol, side, "market",
                position.amount, None, "closed", position.amount, price, ZERO, None, at))
        self._fresh.clear()  # nothing happened: nothing to announce

    async def _look_up(self, noted: BookOrder, now: datetime) -> None:
        """An order noted but never answered (the daemon died while it was sent, or its
        answer was lost): looked up by its client order id. Found, it is counted; not found,
        it was never placed: on paper at once (the paper books are the exchange), on a live
        exchange once :data:`_LOST_AFTER` has passed (a venue may be slow to show it)."""
        try:
            await self.fetch_order_by_client_id(noted.client_order_id, noted.symbol)
        except OrderRejectedError:
            if not hasattr(self.inner, "order_journal") or now - noted.noted_at >= _LOST_AFTER:
                await self.records.settle(noted.client_order_id, "lost")
                _log.info("books_order_never_placed", desk=self.records.desk,
                          client_order_id=noted.client_order_id)

    async def close(self) -> None:
        """Nothing: the inner exchange and the books are closed by whoever opened them."""

    async def _observe(self, order: Order) -> None:
        fills = await self.records.observe(order, self.inner.now())
        self._fresh.extend(fills)
        if self.on_fill is not None:
            for fill in fills:
                self.on_fill(fill)

    def __getattr__(self, name: str) -> object:
        # What an exchange kind offers beyond the protocol (a paper exchange's fills, a
        # ccxt one's journal and look-up by client id) stays reachable.
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"BookedExchange({self.inner!r}, desk={self.records.desk!r})"
