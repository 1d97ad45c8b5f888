"""The exchange interface and the values it trades in.

One protocol, :class:`Exchange`, with two kinds behind it: the paper exchange (simulated
fills on a price feed) and the ccxt exchange (a real venue). Every amount and price is a
:class:`~decimal.Decimal`; every time is an aware UTC :class:`~datetime.datetime` on the
exchange's clock (replayed time for a replay). Errors are the project's own
(:class:`~trading_agent.errors.ExchangeError` and subclasses), never a library's.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Literal, Protocol, runtime_checkable

__all__ = [
    "CLIENT_ORDER_ID_PREFIX",
    "Balance",
    "Candle",
    "Exchange",
    "Fill",
    "Market",
    "Order",
    "OrderBook",
    "OrderRequest",
    "OrderSide",
    "OrderStatus",
    "OrderType",
    "Position",
    "ProtectionKind",
    "Ticker",
    "client_order_id_for",
    "is_own_client_order_id",
    "new_client_order_id",
    "timeframe_delta",
]

OrderSide = Literal["buy", "sell"]
OrderType = Literal["market", "limit"]
OrderStatus = Literal["open", "closed", "canceled", "rejected", "expired"]
ProtectionKind = Literal["stop_loss", "take_profit"]
"""What a protective order is: a stop that limits a loss, or a target that takes a profit."""

_TIMEFRAME = re.compile(r"^(\d+)([mhdw])$")
_UNIT_SECONDS = {"m": 60, "h": 3600, "d": 86400, "w": 604800}


def timeframe_delta(timeframe: str) -> timedelta:
    """The duration of one candle of ``timeframe`` (``5m``, ``1h``, ``1d``, ``1w``).

    Raises:
        ValueError: The timeframe is not a count followed by m, h, d or w.
    """
    match = _TIMEFRAME.match(timeframe)
    if match is None or int(match.group(1)) <= 0:
        raise ValueError(f"unknown timeframe {timeframe!r}; use a form like 5m, 1h, 4h, 1d")
    return timedelta(seconds=int(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def new_client_order_id() -> str:
    """A fresh client order id: 32 characters every major exchange accepts."""
    return "ta" + uuid.uuid4().hex[:30]


def client_order_id_for(*parts: str) -> str:
    """A client order id derived from ``parts`` (a desk, turn and tool call): the same call
    run again gets the same id, which the exchange recognises instead of trading twice.

    Returns:
        32 characters, like :func:`new_client_order_id`.
    """
    digest = hashlib.sha256("\x00".join(parts).encode()).hexdigest()
    return "ta" + digest[:30]


CLIENT_ORDER_ID_PREFIX = "ta"
"""How every client order id this project makes begins (:func:`new_client_order_id`,
:func:`client_order_id_for`): 32 characters, this prefix, then lowercase hex."""

_HEX = frozenset("0123456789abcdef")


def is_own_client_order_id(client_order_id: str,
                           prefix: str = CLIENT_ORDER_ID_PREFIX) -> bool:
    """Whether ``client_order_id`` has the shape of the ids this project makes with
    ``prefix``: 32 characters, the prefix, then lowercase hex (an order a person placed on
    the exchange's site has another shape).

    Args:
        client_order_id: The id an exchange reports for an order.
        prefix: The prefix our ids carry.

    Returns:
        True for one of ours (or one made the same way).
    """
    rest = client_order_id[len(prefix):]
    return (len(client_order_id) == 32 and client_order_id.startswith(prefix)
            and bool(rest) and set(rest) <= _HEX)


@dataclass(frozen=True, slots=True)
class Market:
    """A tradable market.

    Attributes:
        symbol: The unified symbol (``BTC/USDT``).
        base: The currency bought and sold.
        quote: The currency prices are in.
        amount_step: The smallest amount increment, when the exchange has one.
        price_step: The smallest price increment, when the exchange has one.
        min_amount: The smallest order amount, when there is one.
        min_notional: The smallest order value in the quote currency, when there is one.
    """

    symbol: str
    base: str
    quote: str
    amount_step: Decimal | None = None
    price_step: Decimal | None = None
    min_amount: Decimal | None = None
    min_notional: Decimal | None = None


@dataclass(frozen=True, slots=True)
class Ticker:
    """The latest price of a market.

    Attributes:
        symbol: The market.
        last: The last trade price.
        bid: The best bid, when known.
        ask: The best ask, when known.
        change_24h: The relative change over 24 hours (0.012 = +1.2%), when known.
        volume_24h: The base volume over 24 hours, when known.
        at: When the price was observed, on the exchange clock.
    """

    symbol: str
    last: Decimal
    at: datetime
    bid: Decimal | None = None
    ask: Decimal | None = None
    change_24h: Decimal | None = None
    volume_24h: Decimal | None = None


@dataclass(frozen=True, slots=True)
class OrderBook:
    """The best levels of a market's order book.

    Attributes:
        symbol: The market.
        bids: ``(price, amount)`` best first.
        asks: ``(price, amount)`` best first.
        at: When it was observed.
        simulated: True when the book is made up from candles (the paper exchange on a
            replay), not a real book.
    """

    symbol: str
    bids: tuple[tuple[Decimal, Decimal], ...]
    asks: tuple[tuple[Decimal, Decimal], ...]
    at: datetime
    simulated: bool = False


@dataclass(frozen=True, slots=True)
class Candle:
    """One OHLCV candle.

    Attributes:
        symbol: The market.
        timeframe: The candle's duration (``5m``).
        opened_at: When the candle opened (UTC).
        open: The first price.
        high: The highest price.
        low: The lowest price.
        close: The last price.
        volume: The base volume traded.
    """

    symbol: str
    timeframe: str
    opened_at: datetime
    open: Decimal
    high: Decimal
    low: Decimal
    close: Decimal
    volume: Decimal

    @property
    def closes_at(self) -> datetime:
        """When the candle closes: its open time plus its timeframe."""
        return self.opened_at + timeframe_delta(self.timeframe)


@dataclass(frozen=True, slots=True)
class Balance:
    """How much of one currency the account holds.

    Attributes:
        currency: The currency code.
        free: Available for new orders.
        used: Held by open orders.
    """

    currency: str
    free: Decimal
    used: Decimal = Decimal(0)

    @property
    def total(self) -> Decimal:
        """Free plus used."""
        return self.free + self.used


@dataclass(frozen=True, slots=True)
class Position:
    """What the account holds in one market.

    Attributes:
        symbol: The market.
        side: ``long`` or ``short``.
        amount: The size, in the base currency, always positive.
        mark_price: The price it is valued at.
        entry_price: The average entry price, when known.
    """

    symbol: str
    side: Literal["long", "short"]
    amount: Decimal
    mark_price: Decimal
    entry_price: Decimal | None = None

    @property
    def notional(self) -> Decimal:
        """The position's value in the quote currency."""
        return self.amount * self.mark_price

    @property
    def signed_amount(self) -> Decimal:
        """The size, negative for a short."""
        return self.amount if self.side == "long" else -self.amount

    @property
    def unrealized_pnl(self) -> Decimal | None:
        """Profit or loss at the mark price, when the entry price is known."""
        if self.entry_price is None:
            return None
        return (self.mark_price - self.entry_price) * self.signed_amount


@dataclass(frozen=True, slots=True)
class OrderRequest:
    """An order to place.

    Attributes:
        symbol: The market.
        side: ``buy`` or ``sell``.
        type: ``market`` or ``limit``.
        amount: How much of the base currency.
        price: The limit price (limit orders only).
        client_order_id: The id the exchange will know the order by; set when missing.
        turn: The desk's turn that decided it (``flatten`` for a kill switch's), kept in the
            desk's books; never sent to the exchange.
        trigger: For a protective order held by the exchange: ``stop_loss`` or
            ``take_profit``; it waits until the price reaches ``trigger_price``, then
            becomes the market or limit order it describes.
        trigger_price: The price that sets a protective order off.
    """

    symbol: str
    side: OrderSide
    type: OrderType
    amount: Decimal
    price: Decimal | None = None
    client_order_id: str = field(default_factory=new_client_order_id)
    turn: str | None = None
    trigger: ProtectionKind | None = None
    trigger_price: Decimal | None = None

    def __post_init__(self) -> None:
        if (self.trigger is None) != (self.trigger_price is None):
            raise ValueError("a protective order needs both its kind and its trigger price")
        if self.type == "limit" and self.price is None:
            raise ValueError("a limit order needs a price")
        if self.type == "market" and self.price is not None:
            raise ValueError("a market order takes no price")


@dataclass(frozen=True, slots=True)
class Order:
    """An order as the exchange knows it.

    Attributes:
        id: The exchange's order id.
        client_order_id: Our id for it.
        symbol: The market.
        side: ``buy`` or ``sell``.
        type: ``market`` or ``limit``.
        amount: The amount asked for.
        price: The limit price, for a limit order.
        status: ``open``, ``closed`` (filled), ``canceled``, ``rejected`` or ``expired``.
        filled: The amount filled so far.
        average: The average fill price, once something filled.
        fee: The fees paid so far.
        fee_currency: The currency of ``fee``.
        created_at: When the exchange accepted it.
        trigger_price: For a protective order, the price that sets it off.
    """

    id: str
    client_order_id: str
    symbol: str
    side: OrderSide
    type: OrderType
    amount: Decimal
    price: Decimal | None
    status: OrderStatus
    filled: Decimal
    average: Decimal | None
    fee: Decimal
    fee_currency: str | None
    created_at: datetime
    trigger_price: Decimal | None = None

    @property
    def remaining(self) -> Decimal:
        """The amount still to fill."""
        return self.amount - self.filled


@dataclass(frozen=True, slots=True)
class Fill:
    """One execution of an order.

    Attributes:
        order_id: The order it fills.
        symbol: The market.
        side: ``buy`` or ``sell``.
        amount: The base amount.
        price: The execution price.
        fee: The fee paid.
        fee_currency: The fee's currency.
        liquidity: ``taker`` (it took the book's price) or ``maker`` (it rested).
        at: When it happened.
    """

    order_id: str
    symbol: str
    side: OrderSide
    amount: Decimal
    price: Decimal
    fee: Decimal
    fee_currency: str
    liquidity: Literal["maker", "taker"]
    at: datetime


@runtime_checkable
class Exchange(Protocol):
    """What a desk trades through.

    Reads are safe to repeat; :meth:`create_order` is never repeated by an implementation:
    after a timeout it looks the order up by its client order id instead. Every method
    raises :class:`~trading_agent.errors.OrderRejectedError` for what the exchange refuses
    (unknown symbol, funds, size) and :class:`~trading_agent.errors.ExchangeUnavailableError`
    when the exchange cannot be reached.
    """

    @property
    def name(self) -> str:
        """A short name for messages (``paper``, ``binance``, ``binance testnet``)."""
        ...

    def now(self) -> datetime:
        """The exchange clock: wall time for a live venue, replayed time for a replay."""
        ...

    async def markets(self) -> Mapping[str, Market]:
        """The tradable markets, by symbol."""
        ...

    async def fetch_ticker(self, symbol: str) -> Ticker:
        """The latest price of ``symbol``."""
        ...

    async def fetch_order_book(self, symbol: str, limit: int = 10) -> OrderBook:
        """The best ``limit`` levels on each side of ``symbol``'s book."""
        ...

    async def fetch_candles(self, symbol: str, timeframe: str = "5m", limit: int = 100,
                            since: datetime | None = None) -> Sequence[Candle]:
        """The latest ``limit`` candles (after ``since`` if given), oldest first."""
        ...

    async def fetch_balances(self) -> Mapping[str, Balance]:
        """The account's non-zero balances, by currency."""
        ...

    async def fetch_positions(self, symbols: Sequence[str] | None = None) -> Sequence[Position]:
        """The account's positions (spot holdings count as long positions)."""
        ...

    async def fetch_open_orders(self, symbol: str | None = None) -> Sequence[Order]:
        """Orders still resting on the book."""
        ...

    async def create_order(self, request: OrderRequest) -> Order:
        """Places an order; never sends the same request twice."""
        ...

    async def cancel_order(self, order_id: str, symbol: str) -> Order:
        """Cancels an open order and returns it as it now stands."""
        ...

    async def fetch_order(self, order_id: str, symbol: str) -> Order:
        """An order's current state."""
        ...

    async def close(self) -> None:
        """Releases connections and files; the exchange cannot be used afterwards."""
        ...
