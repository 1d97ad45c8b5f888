"""The paper exchange: simulated fills on a price feed, with exact books in SQLite.

How orders fill:

- A market order fills at once, in full, at the feed's latest price moved against the
  trader by ``slippage_bps`` (a buy pays ``last × (1 + slippage)``), and pays the taker fee.
  With ``market_fill = "next_open"`` (backtests) it is accepted and waits instead, holding
  back its funds at the latest price, and fills at the open of the first candle that opens
  at or after it was placed, slipped the same way, as a taker; if the open moved so far
  that the funds no longer cover it, it is rejected then and its funds freed.
- A limit order that is marketable when placed (a buy at or above that slipped price) fills
  at once the same way, as a taker. Otherwise it rests, holding back its funds, and fills in
  full at its own price, paying the maker fee, on the first completed candle that opens at or
  after the order's creation and trades through the price (a buy needs a low below it, a sell
  a high above it; touching is not enough).
- Fees are charged in the quote currency. Spot only: selling more than is held is refused.

Every amount is a :class:`~decimal.Decimal`, computed without rounding. Every change (order,
fill, balance movement, position) is committed to the ledger in one transaction before the
exchange's memory changes, so reopening the same file resumes exactly. Resting orders are
matched whenever the exchange is asked anything, and by :meth:`PaperExchange.sync`, which the
daemon may call on every new candle. One :class:`PaperExchange` per account.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from decimal import Decimal
from typing import Literal

import anyio

from trading_agent.errors import ExchangeError, OrderRejectedError
from trading_agent.trading.config import PaperExchangeConfig
from trading_agent.trading.exchange import (
    Balance,
    Candle,
    Fill,
    Market,
    Order,
    OrderBook,
    OrderRequest,
    Position,
    Ticker,
    timeframe_delta,
)
from trading_agent.trading.feed import PriceFeed
from trading_agent.trading.formatting import format_amount
from trading_agent.trading.ledger import (
    BalanceChange,
    LedgerChanges,
    PaperBooks,
    PaperOrder,
)

__all__ = ["PaperExchange"]

_ZERO = Decimal(0)
_BPS = Decimal(10000)


def _split(symbol: str) -> tuple[str, str]:
    base, _, quote = symbol.partition("/")
    return base, quote.split(":")[0]


@dataclass
class _Draft:
    """Working copies of the books for one operation, and the changes to commit."""

    balances: dict[str, tuple[Decimal, Decimal]]
    positions: dict[str, tuple[Decimal, Decimal | None]]
    changes: LedgerChanges
    fills: list[Fill] = field(default_factory=list)

    def move(self, currency: str, free: Decimal, used: Decimal, reason: str,
             order_id: str | None) -> None:
        old_free, old_used = self.balances.get(currency, (_ZERO, _ZERO))
        new = (old_free + free, old_used + used)
        self.balances[currency] = new
        self.changes.balances[currency] = new
        self.changes.balance_changes.append(BalanceChange(currency, free, used, reason, order_id))

    def free(self, currency: str) -> Decimal:
        return self.balances.get(currency, (_ZERO, _ZERO))[0]

    def trade_position(self, symbol: str, side: Literal["buy", "sell"], amount: Decimal,
                       price: Decimal) -> None:
        held, cost = self.positions.get(symbol, (_ZERO, _ZERO))
        if side == "buy":
            new = (held + amount, None if cost is None else cost + amount * price)
        elif amount >= held:
            new = (_ZERO, _ZERO)
        else:
            new = (held - amount, None if cost is None else cost - cost * amount / held)
        self.positions[symbol] = new
        self.changes.positions[symbol] = new


class PaperExchange:
    """A simulated exchange on a price feed, its books in SQLite.

    Use :meth:`open`.

    Args:
        config: Starting balances, fees, slippage.
        feed: Where prices, candles and time come from.
        ledger: The account's books.
        name: A name for messages.
    """

    def __init__(self, config: PaperExchangeConfig, feed: PriceFeed, ledger: PaperBooks,
                 *, name: str = "paper") -> None:
        self._config = config
        self._feed = feed
        self._ledger = ledger
        self._name = name
        self._slippage = config.slippage_bps / _BPS
        self._balances: dict[str, tuple[Decimal, Decimal]] = {}
        self._positions: dict[str, tuple[Decimal, Decimal | None]] = {}
        self._open: dict[str, PaperOrder] = {}
        self._order_count = 0
        self._matched_until: dict[str, datetime] = {}
        self._step = timeframe_delta(feed.timeframe)
        self._lock = anyio.Lock()
        self._closed = False

    @classmethod
    async def open(cls, config: PaperExchangeConfig, feed: PriceFeed, ledger: PaperBooks, *,
                   name: str = "paper") -> PaperExchange:
        """Opens the account kept in ``ledger``, creating it with the starting balances; the
        exchange closes the ledger when it closes (also when this fails).

        Args:
            config: Starting balances (used only when the account is new), fees, slippage.
            feed: The price feed.
            ledger: The account's books (the store's ``SqlitePaperBooks``).
            name: A name for messages.

        Raises:
            StoreError: The books cannot be read.
        """
        exchange = cls(config, feed, ledger, name=name)
        try:
            await exchange._restore()
        except BaseException:
            await ledger.close()
            raise
        return exchange

    async def _restore(self) -> None:
        snapshot = await self._ledger.load()
        if snapshot.exists:
            self._balances = dict(snapshot.balances)
            self._positions = dict(snapshot.positions)
            self._open = {paper.order.id: paper for paper in snapshot.open_orders}
            self._order_count = snapshot.order_count
            return
        draft = self._draft()
        for currency, amount in self._config.starting_balances.items():
            draft.move(currency, amount, _ZERO, "deposit", None)
        for symbol in self._feed.symbols:
            base, _ = _split(symbol)
            amount = self._config.starting_balances.get(base, _ZERO)
            if amount > 0 and not any(_split(s)[0] == base for s in draft.positions):
                cost: Decimal | None
                try:
                    cost = amount * (await self._feed.ticker(symbol)).last
                except ExchangeError:
                    cost = None
                draft.positions[symbol] = draft.changes.positions[symbol] = (amount, cost)
        await self._ledger.create_account(draft.changes)
        self._apply(draft)

    # -- reads -----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """``paper`` unless named otherwise."""
        return self._name

    @property
    def feed(self) -> PriceFeed:
        """The price feed the exchange trades on."""
        return self._feed

    def now(self) -> datetime:
        """The feed's clock."""
        return self._feed.now()

    async def markets(self) -> Mapping[str, Market]:
        """One market per symbol of the feed."""
        return {symbol: Market(symbol, *_split(symbol)) for symbol in self._feed.symbols}

    def _require_market(self, symbol: str) -> None:
        if symbol not in self._feed.symbols:
            raise OrderRejectedError(f"{self._name} has no market {symbol}; it trades "
                                     f"{', '.join(self._feed.symbols)}")

    async def fetch_ticker(self, symbol: str) -> Ticker:
        """The feed's last price; bid and ask are where a market order would fill."""
        self._require_market(symbol)
        ticker = await self._feed.ticker(symbol)
        return replace(ticker, bid=self._taker_price("sell", ticker.last),
                       ask=self._taker_price("buy", ticker.last))

    async def fetch_order_book(self, symbol: str, limit: int = 10) -> OrderBook:
        """The feed's book, or on a replay a simulated one around the fill prices."""
        self._require_market(symbol)
        book = await self._feed.order_book(symbol, limit)
        if book is not None:
            return book
        ticker = await self.fetch_ticker(symbol)
        assert ticker.bid is not None and ticker.ask is not None
        latest = await self._feed.candles(symbol, limit=1)
        depth = latest[-1].volume / (4 * limit) if latest else Decimal(1)
        step = max(self._slippage, Decimal("0.0001"))
        return OrderBook(
            symbol=symbol,
            bids=tuple((ticker.bid * (1 - step * k), depth) for k in range(limit)),
            asks=tuple((ticker.ask * (1 + step * k), depth) for k in range(limit)),
            at=ticker.at,
            simulated=True,
        )

    async def fetch_candles(self, symbol: str, timeframe: str = "5m", limit: int = 100,
                            since: datetime | None = None) -> Sequence[Candle]:
        """The feed's completed candles (a longer timeframe's last one may be forming)."""
        self._require_market(symbol)
        return await self._feed.candles(symbol, timeframe, limit, since)

    async def fetch_balances(self) -> Mapping[str, Balance]:
        """Non-zero balances, after matching resting orders."""
        await self.sync()
        return {currency: Balance(currency, free, used)
                for currency, (free, used) in sorted(self._balances.items())
                if free or used}

    async def fetch_positions(self, symbols: Sequence[str] | None = None) -> Sequence[Position]:
        """Held amounts per symbol, marked at the feed's last price."""
        await self.sync()
        positions: list[Position] = []
        for symbol, (amount, cost) in sorted(self._positions.items()):
            if amount <= 0 or (symbols is not None and symbol not in symbols):
                continue
            mark = (await self._feed.ticker(symbol)).last
            entry = None if cost is None else cost / amount
            positions.append(Position(symbol, "long", amount, mark, entry))
        return positions

    async def fetch_open_orders(self, symbol: str | None = None) -> Sequence[Order]:
        """Resting orders, oldest first, after matching."""
        await self.sync()
        return [paper.order for paper in self._open.values()
                if symbol is None or paper.order.symbol == symbol]

    async def fetch_order(self, order_id: str, symbol: str) -> Order:
        """An order by its id or its client order id.

        Raises:
            OrderRejectedError: No such order.
        """
        await self.sync()
        if order_id in self._open:
            return self._open[order_id].order
        paper = (await self._ledger.find_order(order_id=order_id)
                 or await self._ledger.find_order(client_order_id=order_id))
        if paper is None:
            raise OrderRejectedError(f"{self._name} has no order {order_id}")
        return paper.order

    async def fetch_order_by_client_id(self, client_order_id: str,
                                       symbol: str | None = None) -> Order:
        """An order by our client order id, as the books hold it now (after matching).

        Args:
            client_order_id: The id the order was placed with.
            symbol: Unused (the books know each order's market); accepted so the call reads
                as the ccxt exchange's.

        Raises:
            OrderRejectedError: The books hold no order with that client id: it was never
                placed (refused orders leave no record).
        """
        await self.sync()
        resting = next((p.order for p in self._open.values()
                        if p.order.client_order_id == client_order_id), None)
        if resting is not None:
            return resting
        paper = await self._ledger.find_order(client_order_id=client_order_id)
        if paper is None:
            raise OrderRejectedError(f"{self._name} has no order with client id "
                                     f"{client_order_id}")
        return paper.order

    async def fills(self, order_id: str | None = None) -> list[Fill]:
        """Fills of the account (of one order if given), oldest first."""
        return await self._ledger.fills(order_id)

    # -- orders ----------------------------------------------------------------------------

    async def create_order(self, request: OrderRequest) -> Order:
        """Places an order; the same client order id twice returns the first order.

        Raises:
            OrderRejectedError: Unknown symbol, bad amount or price, insufficient funds.
            ExchangeUnavailableError: The feed has no price yet.
        """
        self._require_market(request.symbol)
        if request.trigger is not None:
            raise OrderRejectedError(f"{self._name} holds no protective orders: its stops and "
                                     "targets are simulated from the candles")
        if request.amount <= 0:
            raise OrderRejectedError(f"the amount must be positive, not {request.amount}")
        if request.price is not None and request.price <= 0:
            raise OrderRejectedError(f"the price must be positive, not {request.price}")
        async with self._lock:
            self._check_open()
            await self._sync_locked()
            resting = next((p.order for p in self._open.values()
                            if p.order.client_order_id == request.client_order_id), None)
            if resting is not None:
                return resting
            last = (await self._feed.ticker(request.symbol)).last
            draft = self._draft()
            self._order_count += 1
            try:
                order = self._place(draft, request, last)
                # The ledger refuses a client order id it has seen: that order is returned
                # instead, so a retried request never trades twice.
                written = await self._ledger.commit(
                    draft.changes, new_client_order_id=request.client_order_id)
            except BaseException:
                self._order_count -= 1
                raise
            if not written:
                self._order_count -= 1
                earlier = await self._ledger.find_order(client_order_id=request.client_order_id)
                assert earlier is not None
                return earlier.order
            self._apply(draft)
            return order

    async def execute_at(self, request: OrderRequest, price: Decimal, at: datetime) -> Order:
        """Fills a market order at once, in full, at ``price`` as a taker: the exit of a
        protective order that the candles set off (its price, or the open it gapped to;
        see :mod:`trading_agent.trading.protection`). The same client order id twice returns
        the first order.

        Raises:
            OrderRejectedError: Unknown symbol, or the funds no longer cover it.
        """
        self._require_market(request.symbol)
        async with self._lock:
            self._check_open()
            earlier = await self._ledger.find_order(client_order_id=request.client_order_id)
            if earlier is not None:
                return earlier.order
            draft = self._draft()
            self._order_count += 1
            order = Order(
                id=f"P{self._order_count}", client_order_id=request.client_order_id,
                symbol=request.symbol, side=request.side, type="market",
                amount=request.amount, price=None, status="open", filled=_ZERO,
                average=None, fee=_ZERO, fee_currency=None, created_at=at)
            try:
                filled = self._fill(draft, order, price, "taker", at, reserved=None)
                written = await self._ledger.commit(
                    draft.changes, new_client_order_id=request.client_order_id)
            except BaseException:
                self._order_count -= 1
                raise
            if not written:  # pragma: no cover - found above under the same lock
                self._order_count -= 1
                found = await self._ledger.find_order(client_order_id=request.client_order_id)
                assert found is not None
                return found.order
            self._apply(draft)
            return filled

    def _place(self, draft: _Draft, request: OrderRequest, last: Decimal) -> Order:
        now = self._feed.now()
        order = Order(
            id=f"P{self._order_count}", client_order_id=request.client_order_id,
            symbol=request.symbol, side=request.side, type=request.type,
            amount=request.amount, price=request.price, status="open", filled=_ZERO,
            average=None, fee=_ZERO, fee_currency=None, created_at=now,
        )
        taker_price = self._taker_price(request.side, last)
        marketable = request.price is None or (
            request.price >= taker_price if request.side == "buy" else request.price <= taker_price)
        if self._config.market_fill == "next_open":
            marketable = False  # it reaches the book at the next candle's open
        if marketable:
            return self._fill(draft, order, taker_price, "taker", now, reserved=None)
        base, quote = _split(request.symbol)
        if request.side == "buy":
            reserve_currency = quote
            if request.price is None:
                reserve = request.amount * taker_price * (1 + self._config.taker_fee)
                what = (f"this buy costs about {format_amount(reserve)} {quote} at the last "
                        "price, fee included")
            else:
                # Waiting for the next open, it may yet take the book: the higher fee.
                fee = (max(self._config.maker_fee, self._config.taker_fee)
                       if self._config.market_fill == "next_open" else self._config.maker_fee)
                reserve = request.amount * request.price * (1 + fee)
                what = f"this buy needs {format_amount(reserve)} {quote} held back (order and " \
                       "maker fee)"
            self._require_funds(draft, quote, reserve, what)
        else:
            reserve_currency, reserve = base, request.amount
            self._require_funds(draft, base, reserve, f"this sell needs {reserve} {base}")
        draft.move(reserve_currency, -reserve, reserve, "reserve", order.id)
        draft.changes.orders.append(PaperOrder(order, reserve, reserve_currency))
        return order

    def _require_funds(self, draft: _Draft, currency: str, needed: Decimal, what: str) -> None:
        free = draft.free(currency)
        if free < needed:
            raise OrderRejectedError(f"Insufficient {currency}: {what}, but only "
                                     f"{format_amount(free)} {currency} is free.")

    def _fill(self, draft: _Draft, order: Order, price: Decimal,
              liquidity: Literal["maker", "taker"], at: datetime,
              reserved: PaperOrder | None) -> Order:
        """Fills ``order`` in full at ``price`` (the funds check included for takers)."""
        base, quote = _split(order.symbol)
        amount = order.amount
        notional = amount * price
        rate = self._config.maker_fee if liquidity == "maker" else self._config.taker_fee
        fee = notional * rate
        if reserved is not None:
            draft.move(reserved.reserved_currency, reserved.reserved, -reserved.reserved,
                       "release", order.id)
        if order.side == "buy":
            if reserved is None:
                self._require_funds(draft, quote, notional + fee,
                                    f"this buy costs {format_amount(notional)} {quote} plus a fee "
                                    f"of {format_amount(fee)} {quote}")
            draft.move(quote, -notional, _ZERO, "fill", order.id)
            draft.move(quote, -fee, _ZERO, "fee", order.id)
            draft.move(base, amount, _ZERO, "fill", order.id)
        else:
            if reserved is None:
                self._require_funds(draft, base, amount, f"this sell needs {amount} {base}")
            draft.move(base, -amount, _ZERO, "fill", order.id)
            draft.move(quote, notional, _ZERO, "fill", order.id)
            draft.move(quote, -fee, _ZERO, "fee", order.id)
        draft.trade_position(order.symbol, order.side, amount, price)
        filled = replace(order, status="closed", filled=amount, average=price, fee=fee,
                         fee_currency=quote)
        fill = Fill(order.id, order.symbol, order.side, amount, price, fee, quote, liquidity, at)
        draft.changes.fills.append(fill)
        draft.fills.append(fill)
        draft.changes.orders.append(PaperOrder(filled, _ZERO, quote if reserved is None
                                               else reserved.reserved_currency))
        return filled

    async def cancel_order(self, order_id: str, symbol: str) -> Order:
        """Cancels a resting order and frees what it held back.

        Raises:
            OrderRejectedError: No such order, or it is no longer open.
        """
        async with self._lock:
            self._check_open()
            await self._sync_locked()
            paper = self._open.get(order_id)
            if paper is None:
                known = await self._ledger.find_order(order_id=order_id)
                if known is None:
                    raise OrderRejectedError(f"{self._name} has no order {order_id}")
                raise OrderRejectedError(f"order {order_id} is {known.order.status}, not open; "
                                         "there is nothing to cancel")
            draft = self._draft()
            draft.move(paper.reserved_currency, paper.reserved, -paper.reserved, "release",
                       order_id)
            canceled = replace(paper.order, status="canceled")
            draft.changes.orders.append(PaperOrder(canceled, _ZERO, paper.reserved_currency))
            await self._ledger.commit(draft.changes)
            self._apply(draft)
            return canceled

    # -- matching --------------------------------------------------------------------------

    async def sync(self) -> list[Fill]:
        """Matches resting orders against the candles completed since the last match.

        Returns:
            The fills this produced, oldest first.
        """
        if not self._open:
            return []
        async with self._lock:
            self._check_open()
            return await self._sync_locked()

    async def _sync_locked(self) -> list[Fill]:
        if not self._open:
            return []
        now = self._feed.now()
        draft = self._draft()
        horizon: dict[str, datetime] = {}
        for symbol in sorted({paper.order.symbol for paper in self._open.values()}):
            resting = [p for p in self._open.values() if p.order.symbol == symbol]
            since = min(p.order.created_at for p in resting)
            since = max(since, self._matched_until.get(symbol, since))
            candles = [c for c in await self._feed.candles(symbol, since=since)
                       if c.closes_at <= now]
            for candle in candles:
                crossed = [p for p in resting if candle.opened_at >= p.order.created_at
                           and _trades_through(p.order, candle)]
                for paper in crossed:
                    if self._takes_the_open(paper.order, candle):
                        self._fill_at_open(draft, paper, candle)
                    else:
                        assert paper.order.price is not None
                        self._fill(draft, paper.order, paper.order.price, "maker",
                                   candle.closes_at, reserved=paper)
                resting = [p for p in resting if p not in crossed]
            if candles:
                horizon[symbol] = candles[-1].opened_at + self._step
        if draft.changes.orders:  # fills, and market orders the open made unaffordable
            await self._ledger.commit(draft.changes)
            self._apply(draft)
        self._matched_until.update(horizon)
        return draft.fills

    def _takes_the_open(self, order: Order, candle: Candle) -> bool:
        """Whether ``order`` fills at ``candle``'s open as a taker: a waiting market order,
        and (with ``next_open``) a limit order reaching the book at that open already
        marketable there; any other limit order rests and fills at its own price."""
        if order.price is None:
            return True
        if self._config.market_fill != "next_open" or \
                candle.opened_at >= order.created_at + self._step:
            return False  # it was resting before this candle opened
        open_price = self._taker_price(order.side, candle.open)
        return open_price <= order.price if order.side == "buy" else open_price >= order.price

    def _fill_at_open(self, draft: _Draft, paper: PaperOrder, candle: Candle) -> None:
        """A waiting market order fills at ``candle``'s open, or is rejected when the funds
        held back at the last price no longer cover it."""
        order = paper.order
        price = self._taker_price(order.side, candle.open)
        base, quote = _split(order.symbol)
        if order.side == "buy":
            currency, needed = quote, order.amount * price * (1 + self._config.taker_fee)
        else:
            currency, needed = base, order.amount
        held_back = paper.reserved if paper.reserved_currency == currency else _ZERO
        if draft.free(currency) + held_back < needed:
            draft.move(paper.reserved_currency, paper.reserved, -paper.reserved, "release",
                       order.id)
            rejected = replace(order, status="rejected")
            draft.changes.orders.append(PaperOrder(rejected, _ZERO, paper.reserved_currency))
            return
        self._fill(draft, order, price, "taker", candle.opened_at, reserved=paper)

    # -- internals -------------------------------------------------------------------------

    def _taker_price(self, side: Literal["buy", "sell"], last: Decimal) -> Decimal:
        return last * (1 + self._slippage) if side == "buy" else last * (1 - self._slippage)

    def _draft(self) -> _Draft:
        return _Draft(dict(self._balances), dict(self._positions),
                      LedgerChanges(at=self._feed.now()))

    def _apply(self, draft: _Draft) -> None:
        """Makes committed changes visible."""
        self._balances = draft.balances
        self._positions = draft.positions
        for paper in draft.changes.orders:
            if paper.order.status == "open":
                self._open[paper.order.id] = paper
            else:
                self._open.pop(paper.order.id, None)

    def _check_open(self) -> None:
        if self._closed:
            raise ExchangeError(f"the {self._name} exchange is closed")

    async def close(self) -> None:
        """Closes the ledger (the feed belongs to whoever opened it)."""
        if not self._closed:
            self._closed = True
            async with self._lock:
                await self._ledger.close()

    def __repr__(self) -> str:
        return (f"PaperExchange(name={self._name!r}, account={self._ledger.account!r}, "
                f"open_orders={len(self._open)})")


def _trades_through(order: Order, candle: Candle) -> bool:
    if order.price is None:
        return True  # a waiting market order takes the candle's open
    return candle.low < order.price if order.side == "buy" else candle.high > order.price
