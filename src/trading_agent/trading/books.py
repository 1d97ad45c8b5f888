"""A desk's own books: its orders, its fills, its positions, its round-trip trades and its
profit, kept apart from the account the desk trades on.

Several desks may trade one account, and the account may hold coins no desk bought. What is
a desk's is decided by its orders: every order a desk places is noted in its books by client
order id before the exchange sees it (:meth:`DeskBookRecords.note_order`), and only fills of
those orders are the desk's. Balance changes no desk made belong to nobody (reconciliation
reports them).

One code path for every exchange kind. Whatever learns an order's state (the answer of
``create_order``, ``fetch_order`` or ``cancel_order``, a paper candle's match, a look on
start) hands the :class:`~trading_agent.trading.exchange.Order` to
:meth:`DeskBookRecords.observe`. Exchanges report an order's cumulative fill (amount,
average price, fee); the books keep what they have already counted of each order, and the
part not yet counted becomes one :class:`BookFill` whose id is the order's id and the
cumulative amount (``O123@0.5``). That id is unique in the books, and the fill, the order's
counted part and the position are written in one transaction: a ``kill -9`` before the write
loses nothing (the next look at the order counts the same part again, as one fill), and one
after it counts nothing twice.

Accounting, per symbol, by average cost (:func:`apply_fill`):
- a fill that adds to the position (or opens one) moves the average entry price to the
  amount-weighted mean of the old entry and the fill's price;
- a fill that reduces it realizes ``(price - entry) x amount`` (the opposite for a short)
  and leaves the entry where it was; a fill that crosses zero closes the position and opens
  the opposite one with the rest, at the fill's price;
- fees in the quote currency are subtracted from the profit; a fee in the base currency
  changes the amount held (a buy of 1 BTC paying 0.001 BTC holds 0.999; a sell paying one
  gives up that much more) and counts as a quote fee of its worth at the fill's price; fees
  in any other currency (BNB) are kept with the fill and in
  :attr:`BookPosition.other_fees`, never converted.

A round trip (:class:`RoundTrip`) opens when a position leaves zero and closes when it comes
back (or crosses): its profit is what its reducing fills realized less every quote fee paid
on its fills, entry and exit included; its percent is that profit over the entry cost.
Profit by UTC day (:class:`DayProfit`) is the realized profit less quote fees of the fills of
that day.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import date, datetime
from decimal import Decimal
from typing import Literal, Protocol

from trading_agent.trading.exchange import Order, OrderSide

__all__ = [
    "FLATTEN_TURN",
    "PROTECTION_TURNS",
    "STOP_LOSS_TURN",
    "ZERO",
    "BookFill",
    "BookOrder",
    "BookPosition",
    "DayProfit",
    "DeskBookRecords",
    "FillEffect",
    "RoundTrip",
    "apply_fill",
    "fill_from_order",
    "fill_id_for",
]

ZERO = Decimal(0)

FLATTEN_TURN = "flatten"
"""The turn noted for orders a kill switch's flatten placed (no model decided them)."""

PROTECTION_TURNS = ("stop_loss", "take_profit")
"""The turns noted for the orders of a position's protection (its stop, its target): no
turn placed them when they filled, and a round trip they close has that exit reason."""

STOP_LOSS_TURN = PROTECTION_TURNS[0]
"""The turn noted for orders a position's stop loss placed: the round trip they close has
this exit reason (what ``stoploss_guard`` counts)."""

_EXIT_TURNS = frozenset({FLATTEN_TURN, *PROTECTION_TURNS})
"""Turns that are themselves the exit reason of the round trip their order closes."""


@dataclass(frozen=True, slots=True)
class BookOrder:
    """An order in a desk's books, with the part of it the books have counted.

    Attributes:
        client_order_id: The id noted before sending.
        symbol: The market.
        side: ``buy`` or ``sell``.
        type: ``market`` or ``limit``.
        amount: The amount asked for.
        price: The limit price, for a limit order.
        turn: The turn that placed it (``flatten`` for a kill switch's), None if unknown.
        noted_at: When it was noted, before it was sent.
        order_id: The exchange's id, once known.
        status: As last seen (``new`` until the exchange answered).
        filled: The amount the books counted.
        cost: ``filled x average`` as counted.
        fee: The fee counted.
        fee_currency: Its currency.
    """

    client_order_id: str
    symbol: str
    side: OrderSide
    type: str
    amount: Decimal
    price: Decimal | None
    turn: str | None
    noted_at: datetime
    order_id: str | None = None
    status: str = "new"
    filled: Decimal = ZERO
    cost: Decimal = ZERO
    fee: Decimal = ZERO
    fee_currency: str | None = None

    @property
    def is_open(self) -> bool:
        """Whether it may still fill (not yet answered, or resting)."""
        return self.status in ("new", "open")


@dataclass(frozen=True, slots=True)
class BookFill:
    """One fill counted in a desk's books.

    Attributes:
        fill_id: Unique in the desk's books: the order's id and its cumulative fill.
        order_id: The exchange's order id.
        client_order_id: The desk's id for the order.
        symbol: The market.
        side: ``buy`` or ``sell``.
        amount: The base amount of this fill.
        price: Its price.
        fee: The fee of this fill.
        fee_currency: The fee's currency (None when there was none).
        at: When the books learned of it, on the exchange clock.
        turn: The turn that placed the order.
    """

    fill_id: str
    order_id: str
    client_order_id: str
    symbol: str
    side: OrderSide
    amount: Decimal
    price: Decimal
    fee: Decimal
    fee_currency: str | None
    at: datetime
    turn: str | None

    @property
    def quote_fee(self) -> Decimal:
        """The fee in the symbol's quote currency (0 when paid in another one)."""
        return self.fee if self.fee_currency == _quote(self.symbol) else ZERO

    @property
    def base_fee(self) -> Decimal:
        """The fee in the symbol's base currency (0 when paid in another one)."""
        return self.fee if self.fee_currency == _base(self.symbol) else ZERO


@dataclass(frozen=True, slots=True)
class BookPosition:
    """A desk's own position in one market.

    Attributes:
        symbol: The market.
        amount: The size in the base currency, negative for a short; 0 when flat.
        entry_price: The average entry price of what is held (None when flat).
        realized: Profit realized on this market, all time, quote fees subtracted.
        fees: Quote-currency fees paid on this market, all time.
        other_fees: Fees paid in other currencies, by currency.
        opened_at: When the position now held was opened.
        trade_id: The open round trip's id.
    """

    symbol: str
    amount: Decimal = ZERO
    entry_price: Decimal | None = None
    realized: Decimal = ZERO
    fees: Decimal = ZERO
    other_fees: Mapping[str, Decimal] = field(default_factory=dict)
    opened_at: datetime | None = None
    trade_id: int | None = None

    @property
    def side(self) -> Literal["long", "short", "flat"]:
        """``long``, ``short`` or ``flat``."""
        return "long" if self.amount > 0 else "short" if self.amount < 0 else "flat"

    def unrealized(self, mark: Decimal) -> Decimal:
        """Profit at ``mark`` of what is held (0 when flat)."""
        if self.amount == 0 or self.entry_price is None:
            return ZERO
        return (mark - self.entry_price) * self.amount


@dataclass(frozen=True, slots=True)
class RoundTrip:
    """A trade from opening a position to closing it.

    Attributes:
        id: Its number in the desk's books.
        symbol: The market.
        side: ``long`` or ``short``.
        opened_at: The first fill.
        closed_at: The fill that brought it back to zero (None while open).
        amount: The most it held at once.
        entry_price: The average entry price.
        exit_price: The average price of the fills that reduced it (None before any).
        exited: How much was closed so far.
        profit: Realized profit, every quote fee of its fills subtracted.
        fees: Quote-currency fees of its fills.
        exit_reason: Why it closed: ``decision`` (a turn's order), ``flatten`` (the kill
            switch), ``stop_loss`` or ``take_profit`` (its protection), ``reversed`` (an
            order crossed zero); None while open.
        opened_turn: The turn whose order opened it.
        closed_turn: The turn whose order closed it.
    """

    id: int
    symbol: str
    side: Literal["long", "short"]
    opened_at: datetime
    amount: Decimal
    entry_price: Decimal
    closed_at: datetime | None = None
    exit_price: Decimal | None = None
    exited: Decimal = ZERO
    profit: Decimal = ZERO
    fees: Decimal = ZERO
    exit_reason: str | None = None
    opened_turn: str | None = None
    closed_turn: str | None = None

    @property
    def is_open(self) -> bool:
        """Whether it still holds a position."""
        return self.closed_at is None

    @property
    def profit_percent(self) -> Decimal:
        """Profit over the cost of the amount closed, in percent (0 before any exit)."""
        basis = self.entry_price * (self.exited or self.amount)
        return (self.profit / basis * 100) if basis else ZERO

    @property
    def duration_seconds(self) -> float | None:
        """From the first fill to the last, once closed."""
        return None if self.closed_at is None else (
            self.closed_at - self.opened_at).total_seconds()


@dataclass(frozen=True, slots=True)
class DayProfit:
    """A UTC day's realized profit.

    Attributes:
        day: The UTC date.
        realized: Profit realized by that day's fills, quote fees subtracted.
        fees: Quote-currency fees paid that day.
        fills: How many fills there were.
        trades_closed: How many round trips closed.
    """

    day: date
    realized: Decimal
    fees: Decimal
    fills: int
    trades_closed: int


@dataclass(frozen=True, slots=True)
class FillEffect:
    """What one fill did to a position: the new position, the trades it touched and the
    profit it realized.

    Attributes:
        position: The position after the fill.
        realized: Profit the fill realized, its quote fee subtracted.
        closed: The round trip it closed, if any (complete, with its exit).
        opened: The round trip it opened (a position leaving zero, or the rest of a
            reversal), without an id yet (0) when new.
        updated: The open round trip it added to or partly closed.
    """

    position: BookPosition
    realized: Decimal
    closed: RoundTrip | None = None
    opened: RoundTrip | None = None
    updated: RoundTrip | None = None


_PRICE_PLACES = Decimal("1e-12")


def _tidy(price: Decimal) -> Decimal:
    """A price from a division, to twelve decimal places (far below any market's tick): the
    profits computed from it stay short decimals instead of 28-digit repeating ones."""
    tidy = price.quantize(_PRICE_PLACES).normalize()
    return tidy.quantize(Decimal(1)) if tidy.as_tuple().exponent > 0 else tidy  # type: ignore[operator]


def _base(symbol: str) -> str:
    return symbol.partition("/")[0]


def _quote(symbol: str) -> str:
    return symbol.partition("/")[2].partition(":")[0]


def fill_id_for(order_id: str, cumulative: Decimal) -> str:
    """The id of the fill that brought ``order_id`` to ``cumulative`` filled."""
    return f"{order_id}@{cumulative.normalize():f}"


def fill_from_order(counted: BookOrder, order: Order, at: datetime) -> BookFill | None:
    """The part of ``order`` the books have not counted yet, as one fill, or None.

    Args:
        counted: The order as the books hold it.
        order: The order as the exchange now reports it.
        at: When (the exchange clock).

    Returns:
        None when nothing new filled (or the report is older than what was counted).
    """
    amount = order.filled - counted.filled
    if amount <= 0 or order.average is None:
        return None
    cost = order.filled * order.average - counted.cost
    price = _tidy(cost / amount) if cost > 0 else order.average
    fee = max(ZERO, order.fee - counted.fee)
    currency = order.fee_currency or counted.fee_currency
    return BookFill(fill_id_for(order.id, order.filled), order.id, counted.client_order_id,
                    order.symbol, order.side, amount, price, fee,
                    currency if fee or currency else None, at, counted.turn)


def apply_fill(position: BookPosition, trade: RoundTrip | None, fill: BookFill
               ) -> FillEffect:
    """Applies one fill to a desk's position by average cost.

    Args:
        position: The position before the fill.
        trade: Its open round trip, if any.
        fill: The fill.

    Returns:
        What the fill did.
    """
    # A base-currency fee is coins received less (a buy) or given more (a sell), and worth
    # its amount at the fill's price: counted as a fee of that many quote.
    base_fee = fill.base_fee
    change = fill.amount - base_fee if fill.side == "buy" else -(fill.amount + base_fee)
    quote_fee = fill.quote_fee + base_fee * fill.price
    other = dict(position.other_fees)
    if fill.fee and fill.fee_currency and not quote_fee and not fill.base_fee:
        other[fill.fee_currency] = other.get(fill.fee_currency, ZERO) + fill.fee
    held = position.amount
    base = replace(position, fees=position.fees + quote_fee, other_fees=other)
    if held == 0 or (held > 0) == (change > 0):
        return _add(base, trade, fill, change, quote_fee)
    closing = min(abs(change), abs(held))
    entry = position.entry_price if position.entry_price is not None else fill.price
    direction = Decimal(1) if held > 0 else Decimal(-1)
    # A fee is shared between the closing part and the opening rest by amount.
    closing_fee = quote_fee * closing / abs(change) if change else quote_fee
    realized = (fill.price - entry) * closing * direction - closing_fee
    left = held + change if abs(change) <= abs(held) else ZERO
    assert trade is not None or held == 0
    exited = (trade.exited if trade else ZERO) + closing
    exit_price = fill.price if trade is None or trade.exit_price is None else _tidy(
        (trade.exit_price * trade.exited + fill.price * closing) / exited)
    touched = replace(trade, exited=exited, exit_price=exit_price,
                      profit=trade.profit + realized, fees=trade.fees + closing_fee
                      ) if trade else None
    if left != 0:  # partly closed
        return FillEffect(replace(base, amount=left, realized=base.realized + realized),
                          realized, updated=touched)
    reason = fill.turn if fill.turn in _EXIT_TURNS else (
        "reversed" if abs(change) > abs(held) else "decision")
    assert reason is not None
    closed = replace(touched, closed_at=fill.at, exit_reason=reason,
                     closed_turn=fill.turn) if touched else None
    flat = replace(base, amount=ZERO, entry_price=None, opened_at=None, trade_id=None,
                   realized=base.realized + realized)
    rest = abs(change) - closing
    if rest <= 0:
        return FillEffect(flat, realized, closed=closed)
    opened = _add(flat, None, fill, rest * (1 if change > 0 else -1), quote_fee - closing_fee)
    return FillEffect(opened.position, realized + opened.realized, closed=closed,
                      opened=opened.opened)


def _add(position: BookPosition, trade: RoundTrip | None, fill: BookFill, change: Decimal,
         fee: Decimal) -> FillEffect:
    held = position.amount
    amount = held + change
    if held == 0 or position.entry_price is None:
        entry = fill.price
    else:
        entry = _tidy((position.entry_price * abs(held) + fill.price * abs(change))
                      / abs(amount))
    moved = replace(position, amount=amount, entry_price=entry,
                    opened_at=position.opened_at or fill.at,
                    realized=position.realized - fee)
    if trade is None:
        new = RoundTrip(0, fill.symbol, "long" if change > 0 else "short", fill.at,
                        abs(amount), entry, profit=-fee, fees=fee, opened_turn=fill.turn)
        return FillEffect(moved, -fee, opened=new)
    grown = replace(trade, amount=max(trade.amount, abs(amount)), entry_price=entry,
                    profit=trade.profit - fee, fees=trade.fees + fee)
    return FillEffect(moved, -fee, updated=grown)


class DeskBookRecords(Protocol):
    """One desk's books in the store (``store.desk_books.SqliteDeskBooks``). Every
    observation is one transaction.

    Attributes:
        desk: The desk.
    """

    desk: str

    async def note_order(self, order: BookOrder) -> None:
        """Notes an order before it is sent (again for the same client order id: nothing
        changes)."""
        ...

    async def observe(self, order: Order, at: datetime) -> list[BookFill]:
        """Counts what of ``order`` filled since the books last looked, once.

        An order whose client order id the desk never noted is not the desk's: nothing is
        recorded and the result is empty.

        Returns:
            The fills newly counted (none, or one).
        """
        ...

    async def settle(self, client_order_id: str, status: str) -> None:
        """Marks a noted order that will never fill (``rejected`` by the exchange, or
        ``lost``: never placed), so it no longer counts as open."""
        ...

    async def orders(self, *, open_only: bool = False) -> list[BookOrder]:
        """The desk's orders, oldest first."""
        ...

    async def positions(self) -> dict[str, BookPosition]:
        """Every market the desk ever traded, flat ones included, by symbol."""
        ...

    async def fills(self, since: datetime | None = None) -> list[BookFill]:
        """The desk's fills, oldest first."""
        ...

    async def trades(self, since: datetime | None = None, *,
                     open_only: bool = False) -> list[RoundTrip]:
        """The desk's round trips (those open, or closed at or after ``since``), oldest
        first."""
        ...

    async def daily(self, since: date | None = None) -> list[DayProfit]:
        """Realized profit by UTC day, oldest first (days without fills left out)."""
        ...

    async def close(self) -> None:
        """Lets go of the store."""
        ...

