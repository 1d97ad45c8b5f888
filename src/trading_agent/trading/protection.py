"""A position's protection: its stop-loss and its take-profit, the rule that fires them on
candles, and the checks an order's protection passes before any exchange sees it.

A protective order belongs to a desk's position in its books. It is born with an entry
(``place_order`` with ``stop_loss`` or ``take_profit``: it waits, ``pending``, until the
entry fills) or on a position already held (``set_protection``: ``active`` at once). While
active it is held somewhere (:data:`ProtectionHeld`):

- ``simulated``: a paper or backtest venue; the candles fire it by :func:`first_exit`;
- ``exchange``: a live venue holds it as a stop order of its own (its client order id
  stored before sending);
- ``daemon``: a live venue that cannot hold it; the daemon watches the price and sends a
  market order when it is crossed (this protection stops when the daemon does).

The fill rule on candles (paper and backtests), for a long position (a short mirrors it):

- a stop fires when a candle's low reaches it, and fills at its price; when the candle
  opened at or below it (the price gapped through it), at that open;
- a take-profit fires when a candle's high reaches it, and fills at its price, or at the
  open when the candle opened at or above it;
- when a stop and a take-profit both fall inside one candle, the stop is taken to have come
  first (the pessimistic rule): the position closes at the stop and the target is cancelled.

Its exit closes the round trip with ``exit_reason`` ``stop_loss`` or ``take_profit``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Literal, Protocol

from trading_agent.errors import RiskLimitError
from trading_agent.trading.books import ZERO
from trading_agent.trading.config import RiskLimits
from trading_agent.trading.exchange import Candle, OrderSide, ProtectionKind
from trading_agent.trading.formatting import format_amount, format_price

__all__ = [
    "PROTECTION_KINDS",
    "ProtectionHeld",
    "ProtectionRecords",
    "ProtectionStatus",
    "ProtectiveOrder",
    "check_entry_protection",
    "check_position_protection",
    "exit_price_on",
    "first_exit",
    "unheld_notice",
]

PROTECTION_KINDS: tuple[ProtectionKind, ...] = ("stop_loss", "take_profit")
"""Every kind of protective order."""

ProtectionHeld = Literal["simulated", "exchange", "daemon"]
"""Where an active protective order is held (see the module's text)."""

ProtectionStatus = Literal["pending", "active", "filled", "canceled"]
"""``pending`` until its entry fills; ``active`` while it protects; then ``filled`` (it
closed the position) or ``canceled`` (moved, removed, its sibling filled, the position
closed otherwise, or its entry never filled)."""


@dataclass(frozen=True, slots=True)
class ProtectiveOrder:
    """One stop or target of a desk's position.

    Attributes:
        id: Its number in the desk's records (0 before it is stored).
        symbol: The market.
        kind: ``stop_loss`` or ``take_profit``.
        side: The side of its exit order (``sell`` for a long).
        trigger_price: The price that fires it.
        client_order_id: The client order id of its exit (or of the order the exchange
            holds), stored before anything is sent; a replacement gets a new one.
        created_at: When it was set, on the exchange clock.
        entry_client_order_id: The entry it waits for, when it came with one.
        status: See :data:`ProtectionStatus`.
        held: Where it is held once active.
        amount: What it covers (the position's size when it was placed or fired).
        order_id: The exchange's id of the order that holds it (``exchange``) or of its
            exit (``simulated``, ``daemon``).
        checked_until: Candles up to this time were checked (``simulated``).
        exit_price: The price its exit filled at.
        trade_id: The round trip it protects (in the desk's books).
        note: Why it was cancelled, or how it fired.
    """

    id: int
    symbol: str
    kind: ProtectionKind
    side: OrderSide
    trigger_price: Decimal
    client_order_id: str
    created_at: datetime
    entry_client_order_id: str | None = None
    status: ProtectionStatus = "pending"
    held: ProtectionHeld | None = None
    amount: Decimal = ZERO
    order_id: str | None = None
    checked_until: datetime | None = None
    exit_price: Decimal | None = None
    trade_id: int | None = None
    note: str | None = None

    @property
    def is_live(self) -> bool:
        """Whether it still waits or protects."""
        return self.status in ("pending", "active")

    @property
    def title(self) -> str:
        """``BTC/USDT stop-loss at 16,500.00``."""
        what = "stop-loss" if self.kind == "stop_loss" else "take-profit"
        return f"{self.symbol} {what} at {format_price(self.trigger_price)}"

    def describe(self) -> str:
        """One line for the model and the operators."""
        where = {"simulated": "simulated from the candles",
                 "exchange": "held by the exchange",
                 "daemon": "watched by the daemon (it stops when the daemon does)",
                 None: "waiting for its entry to fill"}[self.held if self.status == "active"
                                                          else None]
        line = f"{self.title} ({self.side} exit)"
        if self.status in ("pending", "active"):
            return f"{line}, {where}"
        return f"{line}, {self.status}" + (f": {self.note}" if self.note else "")


class ProtectionRecords(Protocol):
    """A desk's protective orders in the store
    (``store.protective_orders.SqliteProtectiveOrders``).

    Attributes:
        desk: The desk.
    """

    desk: str

    async def add(self, order: ProtectiveOrder) -> ProtectiveOrder:
        """Stores a new protective order (before anything of it is sent).

        Returns:
            It with its id.
        """
        ...

    async def update(self, order: ProtectiveOrder) -> None:
        """Writes what changed of a stored protective order."""
        ...

    async def live(self) -> list[ProtectiveOrder]:
        """The pending and active ones, oldest first."""
        ...

    async def history(self, limit: int = 50) -> list[ProtectiveOrder]:
        """The latest ones, whatever their status, oldest first."""
        ...

    async def close(self) -> None:
        """Lets go of the store."""
        ...


def _protects_long(order: ProtectiveOrder) -> bool:
    return order.side == "sell"


def exit_price_on(order: ProtectiveOrder, candle: Candle) -> Decimal | None:
    """The price ``order`` fills at on ``candle`` by the module's rule, or None when the
    candle does not reach it."""
    trigger = order.trigger_price
    falls = (order.kind == "stop_loss") == _protects_long(order)  # fires on a fall
    if falls:
        if candle.low > trigger:
            return None
        return candle.open if candle.open <= trigger else trigger
    if candle.high < trigger:
        return None
    return candle.open if candle.open >= trigger else trigger


def first_exit(orders: Sequence[ProtectiveOrder], candle: Candle
               ) -> tuple[ProtectiveOrder, Decimal] | None:
    """Which of one position's protective orders ``candle`` fires first, and at what price:
    a stop before a target when both fall inside it (the pessimistic rule).

    Returns:
        The order and its fill price, or None when the candle reaches neither.
    """
    hits = [(order, price) for order in orders
            if (price := exit_price_on(order, candle)) is not None]
    if not hits:
        return None
    hits.sort(key=lambda hit: 0 if hit[0].kind == "stop_loss" else 1)
    return hits[0]


def _quote(symbol: str) -> str:
    return symbol.partition("/")[2].partition(":")[0]


def _check_sides(long: bool, price: Decimal, price_name: str, stop_loss: Decimal | None,
                 take_profit: Decimal | None) -> None:
    """A stop below the price and a target above it (for a long; a short mirrors)."""
    held = "long" if long else "short"
    if stop_loss is not None and (stop_loss >= price if long else stop_loss <= price):
        where = "below" if long else "above"
        raise RiskLimitError("stop_loss", f"Refused: stop_loss {format_price(stop_loss)} is on "
                             f"the wrong side of the {price_name} {format_price(price)}; a "
                             f"{held} position's stop must be {where} it.")
    if take_profit is not None and (take_profit <= price if long else take_profit >= price):
        where = "above" if long else "below"
        raise RiskLimitError("take_profit", f"Refused: take_profit {format_price(take_profit)} "
                             f"is on the wrong side of the {price_name} {format_price(price)}; "
                             f"a {held} position's target must be {where} it.")


def _check_loss(limits: RiskLimits, symbol: str, long: bool, entry: Decimal,
                stop_loss: Decimal | None, amount: Decimal, entry_name: str) -> None:
    if limits.max_loss_per_trade is None or stop_loss is None:
        return
    loss = (entry - stop_loss if long else stop_loss - entry) * amount
    if loss > limits.max_loss_per_trade:
        quote = _quote(symbol)
        base = symbol.partition("/")[0]
        raise RiskLimitError(
            "max_loss_per_trade",
            f"Refused (max_loss_per_trade): from the {entry_name} {format_price(entry)} to the "
            f"stop {format_price(stop_loss)} is {format_price(abs(entry - stop_loss))} {quote} "
            f"x {amount} {base} = {format_amount(loss, quote)} at risk, more than "
            f"max_loss_per_trade {format_amount(limits.max_loss_per_trade, quote)}; bring the "
            "stop closer or trade less.")


def check_entry_protection(limits: RiskLimits, *, symbol: str, side: OrderSide,
                           amount: Decimal, price: Decimal, opens: bool,
                           stop_loss: Decimal | None, take_profit: Decimal | None,
                           price_name: str = "price") -> None:
    """Checks the protection an order comes with.

    Args:
        limits: The desk's limits (``require_stop_loss``, ``max_loss_per_trade``).
        symbol: The market.
        side: The order's side.
        amount: Its amount.
        price: Its price: its limit price, or the price a market order would pay now.
        opens: Whether it opens or adds to a position (an entry); a reducing order takes
            no protection.
        stop_loss: The stop it asks for.
        take_profit: The target it asks for.
        price_name: What ``price`` is, for the message (``limit price``, ``ask``).

    Raises:
        RiskLimitError: The protection, or its absence, is refused; the message has the
            numbers.
    """
    protected = stop_loss is not None or take_profit is not None
    if not opens:
        if protected:
            raise RiskLimitError("stop_loss", "Refused: stop_loss and take_profit go with an "
                                 "order that opens or adds to a position; this one reduces it. "
                                 "Use set_protection to move the protection of what you hold.")
        return
    if limits.require_stop_loss and stop_loss is None:
        raise RiskLimitError("require_stop_loss", "Refused (require_stop_loss): this desk "
                             "must give every entry a stop_loss; place it again with "
                             "stop_loss set to the price at which the trade is wrong.")
    long = side == "buy"
    _check_sides(long, price, price_name, stop_loss, take_profit)
    _check_loss(limits, symbol, long, price, stop_loss, amount, price_name)


def check_position_protection(limits: RiskLimits, *, symbol: str, held: Decimal,
                              entry_price: Decimal | None, mark: Decimal,
                              stop_loss: Decimal | None, take_profit: Decimal | None,
                              removes_stop: bool) -> None:
    """Checks a protection set on (or moved for) a position already held.

    Args:
        limits: The desk's limits.
        symbol: The market.
        held: The desk's signed position (negative for a short).
        entry_price: Its average entry price.
        mark: The price now.
        stop_loss: The new stop, if it is set or moved.
        take_profit: The new target, if it is set or moved.
        removes_stop: Whether the stop is being removed.

    Raises:
        RiskLimitError: Refused, with the numbers.
    """
    if removes_stop and limits.require_stop_loss:
        raise RiskLimitError("require_stop_loss", "Refused (require_stop_loss): this desk's "
                             "positions must keep a stop; move it instead of removing it.")
    long = held > 0
    _check_sides(long, mark, "price now", stop_loss, take_profit)
    if entry_price is not None:
        _check_loss(limits, symbol, long, entry_price, stop_loss, abs(held), "entry price")


def unheld_notice(exchange: str, held: Sequence[ProtectionKind]) -> str | None:
    """What ``check-config`` and ``run`` say of an exchange that cannot hold every kind of
    protective order itself, or None when it can.

    Args:
        exchange: The exchange's name.
        held: The kinds it can hold.
    """
    missing = [kind for kind in PROTECTION_KINDS if kind not in held]
    if not missing:
        return None
    what = " and ".join("stop-loss" if kind == "stop_loss" else "take-profit"
                        for kind in missing)
    return (f"{exchange} cannot hold {what} orders itself (by ccxt's has flags): the daemon "
            "watches the price and sends a market order when it is crossed, so this "
            "protection stops when the daemon does.")
