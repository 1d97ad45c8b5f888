"""Events of the operator's controls over money and thinking: the kill switch, a pause and a
resume, a cancelled turn, a spend alert, a reload.

They travel on the daemon's bus like every other step, so the store keeps them and every
stream (``events``, ``chat``, the web page) shows them. A daemon-wide one has desk ``*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from trading_agent.agent.events import Event
from trading_agent.trading.books import BookFill

__all__ = [
    "ConfigReloaded",
    "DeskPaused",
    "DeskResumed",
    "KillSwitchChanged",
    "ModelSwitched",
    "OrderFilled",
    "PinsChanged",
    "ProtectionReported",
    "ReduceOnlyChanged",
    "SpendAlert",
    "StorageChanged",
    "TurnCancelled",
    "TurnRetried",
    "order_filled",
]


@dataclass(frozen=True, kw_only=True)
class KillSwitchChanged(Event):
    """A kill switch went on or off (desk ``*``: every desk's).

    Attributes:
        on: Whether it is now on.
        by: Who switched it (an operator; ``risk limit max_daily_loss``; ``daemon``).
        reason: Why.
        text: One line, as the chat shows it.
    """

    type: ClassVar[str] = "kill_switch"
    on: bool
    by: str
    reason: str
    text: str


@dataclass(frozen=True, kw_only=True)
class PinsChanged(Event):
    """An operator pinned a standing instruction to a desk, or took one off.

    Attributes:
        action: ``pinned`` or ``unpinned``.
        by: Who did it.
        pin_id: The pin's id.
        pin_text: The instruction.
        pins: How many operator pins the desk has now.
        text: One line, as the chat shows it.
    """

    type: ClassVar[str] = "pins_changed"
    action: Literal["pinned", "unpinned"]
    by: str
    pin_id: int
    pin_text: str
    pins: int
    text: str


@dataclass(frozen=True, kw_only=True)
class ReduceOnlyChanged(Event):
    """A desk went into reduce-only (it may only shrink its positions), or out of it.

    Attributes:
        on: Whether it is now in reduce-only.
        by: Who set it (an operator, ``protection NAME``, ``spend cap``), or who lifted it
            (an operator, or ``daemon`` when its time was up).
        reason: Why it was set, with the protection's numbers.
        until: When it lifts by itself (ISO 8601, the desk's clock), or None.
        protection: The protection that set it, when one did.
        text: One line, as the chat shows it.
    """

    type: ClassVar[str] = "reduce_only"
    on: bool
    by: str
    reason: str
    until: str | None = None
    protection: str | None = None
    text: str


@dataclass(frozen=True, kw_only=True)
class ModelSwitched(Event):
    """A desk now talks to another model (its spend cap reached, ``on_cap = "fallback"``).

    Attributes:
        model: The model it talks to now.
        previous: The one before.
        reason: Why.
    """

    type: ClassVar[str] = "model_switched"
    model: str
    previous: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class DeskPaused(Event):
    """A desk stopped taking turns until it is resumed (or ``until``).

    Attributes:
        by: Who paused it (an operator, or ``spend cap``).
        reason: Why; the desk's status shows it.
        until: When it resumes by itself (seconds since the epoch), or None.
    """

    type: ClassVar[str] = "desk_paused"
    by: str
    reason: str
    until: float | None = None


@dataclass(frozen=True, kw_only=True)
class DeskResumed(Event):
    """A paused desk takes turns again.

    Attributes:
        by: Who resumed it (an operator, or ``daemon`` at the day's turn).
        waiting: Triggers that waited for it.
    """

    type: ClassVar[str] = "desk_resumed"
    by: str
    waiting: int = 0


@dataclass(frozen=True, kw_only=True)
class TurnCancelled(Event):
    """An operator ended a desk's running turn.

    Attributes:
        by: The operator.
        now: True when it was cut at once (its unfinished calls stored as interrupted), False
            when it ends at its next safe point (every tool call answered).
    """

    type: ClassVar[str] = "turn_cancelled"
    by: str
    now: bool


@dataclass(frozen=True, kw_only=True)
class TurnRetried(Event):
    """An operator took the desk's last answer out of what it is sent, to run that turn
    again from the same trigger.

    Attributes:
        by: The operator.
        dropped: How many messages left what is sent (the store keeps them, marked).
        trigger_text: The trigger the turn runs again from.
    """

    type: ClassVar[str] = "turn_retried"
    by: str
    dropped: int
    trigger_text: str


@dataclass(frozen=True, kw_only=True)
class SpendAlert(Event):
    """A daily spend cap is 80% used, or used up (and the desk paused).

    Attributes:
        scope: ``desk`` (the desk's own cap) or ``daemon`` (every desk's together).
        measure: ``tokens`` or ``cost``.
        used: How much is used today (UTC).
        cap: The cap.
        share: ``used / cap``.
        text: One line, as the chat shows it.
    """

    type: ClassVar[str] = "spend_alert"
    scope: Literal["desk", "daemon"]
    measure: Literal["tokens", "cost"]
    used: float
    cap: float
    share: float
    text: str


@dataclass(frozen=True, kw_only=True)
class StorageChanged(Event):
    """The disk holding the store became full, or a write got through again (desk ``*``).

    While it is full, what cannot be stored is refused (an operator's message with HTTP
    507) and desks wait; nothing accepted before is lost.

    Attributes:
        full: Whether it is full now.
        location: Where space must be freed (the state directory, or the database).
        text: One line, as the chat shows it.
    """

    type: ClassVar[str] = "storage"
    full: bool
    location: str
    text: str


@dataclass(frozen=True, kw_only=True)
class ConfigReloaded(Event):
    """The config file was read again (desk ``*``).

    Attributes:
        ok: False when it was refused (then nothing changed).
        changes: What changed, one line each; or why it was refused.
    """

    type: ClassVar[str] = "config_reloaded"
    ok: bool
    changes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class OrderFilled(Event):
    """One of the desk's orders filled, as its books counted it: at once (a market order),
    or later (a resting order, on a paper candle or at the exchange). Made by
    :func:`order_filled`.

    Attributes:
        order_id: The order.
        symbol: Its market.
        side: ``buy`` or ``sell``.
        amount: The base amount filled, as text.
        price: The price, as text.
        fee: The fee, as text, with ``fee_currency``.
        fee_currency: The fee's currency.
        text: One line, as the chat shows it.
    """

    type: ClassVar[str] = "order_filled"
    order_id: str
    symbol: str
    side: str
    amount: str
    price: str
    fee: str
    fee_currency: str
    text: str


def order_filled(desk: str, fill: BookFill) -> OrderFilled:
    """The event for a fill the desk's books counted.

    Args:
        desk: The desk.
        fill: The fill.
    """
    base = fill.symbol.partition("/")[0]
    verb = "bought" if fill.side == "buy" else "sold"
    fee = f"fee {fill.fee} {fill.fee_currency}" if fill.fee_currency else "no fee"
    return OrderFilled(
        desk=desk, order_id=fill.order_id, symbol=fill.symbol, side=fill.side,
        amount=str(fill.amount), price=str(fill.price), fee=str(fill.fee),
        fee_currency=fill.fee_currency or "",
        text=f"Order {fill.order_id} filled: {verb} {fill.amount} {base} on {fill.symbol} at "
             f"{fill.price} ({fee})")


@dataclass(frozen=True, kw_only=True)
class ProtectionReported(Event):
    """Something happened to the protection of one of the desk's positions: its stop or
    target closed the position (``fired``; ``while_down`` when it fired while the daemon
    was not running and was found on restart), or the exchange could not hold it and the
    daemon watches the price instead (``watched``, ``lost``).

    Attributes:
        what: ``fired``, ``watched`` or ``lost``.
        symbol: The market.
        kind: ``stop_loss`` or ``take_profit``.
        trigger_price: Its price, as text.
        exit_price: The exit's price, as text (empty unless fired).
        profit: The round trip's profit, as text (empty when unknown).
        while_down: Found at start: it fired while the daemon was down.
        text: One line, as the chat shows it.
    """

    type: ClassVar[str] = "protection"
    what: str
    symbol: str
    kind: str
    trigger_price: str
    exit_price: str
    profit: str
    while_down: bool
    text: str
