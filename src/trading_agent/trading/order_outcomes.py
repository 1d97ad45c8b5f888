"""What became of an order the daemon never answered: looked up on the exchange on restore.

When the daemon dies mid tool round (``kill -9``, a crash), the store answers each call left
without a result when the desk is restored. For ``place_order`` "it may or may not have
taken effect" is not enough: a model that places it again doubles its exposure. The order's
client order id is derived from the desk, the turn and the call (``tools/orders.py`` places
every order with ``client_order_id_for(desk, turn, call_id)``), so :class:`OrderOutcomes`
computes it again from what the store knows of the call and looks the order up:

- on the paper exchange, in its books (refused paper orders leave no record);
- on a ccxt exchange, in its order journal first (an intent is committed before any order
  leaves, so no entry means never sent), then at the exchange by client order id.

The tool result then says what happened: filled (amount, price, fee), resting (id, price,
how to cancel it), rejected, or never sent (safe to place again if still wanted; a call
that waited for an operator's approval never reached the exchange). Only when the lookup
itself fails does it fall back to "may or may not have taken effect", with the client
order id to check.

Wiring (the store does not import this layer; it calls any resolver of this shape)::

    store.transcripts.set_call_outcomes(desk_name, OrderOutcomes(venue.exchange))
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Protocol, runtime_checkable

import anyio

from trading_agent.errors import ExchangeError, OrderRejectedError, StoreError
from trading_agent.trading.exchange import Exchange, Order, client_order_id_for
from trading_agent.trading.formatting import format_amount, format_price
from trading_agent.trading.order_journal import OrderIntent, OrderJournal

__all__ = ["CANCEL_ORDER", "PLACE_ORDER", "InterruptedCall", "OrderLookup", "OrderOutcome",
           "OrderOutcomes"]

PLACE_ORDER = "place_order"
"""The tool whose interrupted calls are looked up by client order id."""

CANCEL_ORDER = "cancel_order"
"""The tool whose interrupted calls are looked up by the order id they name: a cancel that
took effect must not read as one that may not have."""

_NOT_APPROVED = {
    "pending": "it was waiting for an operator's approval when the daemon stopped",
    "denied": "an operator denied it",
    "timed_out": "nobody approved it in time",
    "cancelled": "its approval was cancelled",
}


class InterruptedCall(Protocol):
    """A call the daemon never answered, as the store describes it
    (``store.InterruptedCall`` has this shape)."""

    @property
    def desk(self) -> str:
        """The desk."""
        ...

    @property
    def tool(self) -> str:
        """The tool's name."""
        ...

    @property
    def arguments(self) -> str:
        """The arguments, as the raw JSON text the model wrote."""
        ...

    @property
    def call_id(self) -> str:
        """The call's id."""
        ...

    @property
    def turn_id(self) -> str | None:
        """The turn it was made in; None when the store could not tell."""
        ...

    @property
    def approval(self) -> str | None:
        """None when never held for approval; ``pending`` when still waiting; else the
        approval's outcome."""
        ...


@runtime_checkable
class OrderLookup(Protocol):
    """An exchange that finds an order by our client order id (both kinds do)."""

    async def fetch_order_by_client_id(self, client_order_id: str, symbol: str) -> Order:
        """The order placed with ``client_order_id``.

        Raises:
            OrderRejectedError: The exchange has no such order.
        """
        ...


@runtime_checkable
class _Journaled(Protocol):
    """An exchange that writes every order to a journal before sending it (ccxt)."""

    @property
    def order_journal(self) -> OrderJournal | None:
        """The journal, or None when it places no orders."""
        ...


@dataclass(frozen=True)
class OrderOutcome:
    """What became of an interrupted order call.

    Attributes:
        text: The tool result the model reads.
        is_error: True when no order stands for the call (never sent, rejected) or its fate
            is still unknown.
    """

    text: str
    is_error: bool


class OrderOutcomes:
    """Looks up the ``place_order`` calls a restore finds unanswered (a store resolver).

    Args:
        exchange: The desk's exchange.
        journal: The order journal of a ccxt exchange; by default the exchange's own.
        timeout_seconds: The longest one lookup may take; past it the call is answered as
            not known (the desk waits for these lookups before its first turn).
    """

    def __init__(self, exchange: Exchange, *, journal: OrderJournal | None = None,
                 timeout_seconds: float = 30.0) -> None:
        self._exchange = exchange
        if journal is None and isinstance(exchange, _Journaled):
            journal = exchange.order_journal
        self._journal = journal
        self._timeout = timeout_seconds

    async def __call__(self, call: InterruptedCall) -> OrderOutcome | None:
        """What became of ``call``; None for another tool, or when its turn is unknown (its
        client order id cannot be computed): the store's default answer then stands.

        Args:
            call: The interrupted call.

        Returns:
            The outcome, looked up; never raises for a failed lookup (it says so instead).
        """
        if call.tool == CANCEL_ORDER:
            return await self._cancel_outcome(call)
        if call.tool != PLACE_ORDER or call.turn_id is None:
            return None
        client_id = client_order_id_for(call.desk, call.turn_id, call.call_id)
        outcome: OrderOutcome | None = None
        failure = f"no answer within {self._timeout:g} s"
        with anyio.move_on_after(self._timeout):
            try:
                outcome = await self._look_up(call, client_id)
            except (ExchangeError, StoreError) as exc:
                failure = str(exc)
        if outcome is None:
            return self._unknown(client_id, failure)
        return outcome

    async def _look_up(self, call: InterruptedCall, client_id: str) -> OrderOutcome:
        exchange = self._exchange
        if not isinstance(exchange, OrderLookup):
            raise ExchangeError(f"{exchange.name} cannot look orders up by client order id")
        symbol = _symbol(call.arguments)
        intent: OrderIntent | None = None
        if self._journal is not None:
            intent = await self._journal.get(client_id)
            if intent is None:
                return self._never_sent(client_id, call.approval, "the order journal, "
                                        "written before any order goes out, has no entry "
                                        "for it")
            if intent.state == "rejected":
                return OrderOutcome(
                    f"{self._lead(client_id)}the exchange REJECTED it"
                    f"{': ' + intent.error if intent.error else ''}. Nothing was placed; "
                    "place a corrected order if you still want one.", is_error=True)
            symbol = intent.request.symbol
        try:
            order = await exchange.fetch_order_by_client_id(client_id, symbol)
        except OrderRejectedError:
            if intent is not None:
                return self._not_found_after_sending(client_id, intent.created_at)
            return self._never_sent(client_id, call.approval, "there is no order with that id")
        return self._found(client_id, order)

    async def _cancel_outcome(self, call: InterruptedCall) -> OrderOutcome | None:
        """Whether a cut-off cancel took effect: its order looked up by id. None (the
        store's default answer) when the call names no order or the lookup fails."""
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            return None
        order_id = arguments.get("order_id") if isinstance(arguments, dict) else None
        if not isinstance(order_id, str) or not order_id.strip():
            return None
        order: Order | None = None
        with anyio.move_on_after(self._timeout):
            try:
                order = await self._exchange.fetch_order(order_id.strip(),
                                                         _symbol(call.arguments))
            except (ExchangeError, StoreError):
                return None
        if order is None:
            return None
        lead = (f"The daemon stopped before this cancel_order call answered. Looked up after "
                f"the restart on {self._exchange.name}: ")
        return self._found(order.client_order_id, order, lead=lead)

    def _lead(self, client_id: str) -> str:
        return (f"The daemon stopped before this place_order call answered. Looked up after "
                f"the restart on {self._exchange.name} by its client order id {client_id}: ")

    def _found(self, client_id: str, order: Order, *, lead: str | None = None) -> OrderOutcome:
        lead = lead if lead is not None else self._lead(client_id)
        base = order.symbol.partition("/")[0]
        what = f"{order.side} {order.type} {_plain(order.amount)} {base} on {order.symbol}"
        at = f" @ {format_price(order.price)}" if order.price is not None else ""
        calls = f"order_id={order.id!r}, symbol={order.symbol!r}"
        if order.status == "closed":
            verb = "bought" if order.side == "buy" else "sold"
            price = format_price(order.average) if order.average is not None else "?"
            return OrderOutcome(
                f"{lead}order {order.id} FILLED: {verb} {_plain(order.filled)} {base} on "
                f"{order.symbol} at {price} ({order.type}){_fee(order)}. It is done: do not "
                "place it again.", is_error=False)
        if order.status == "open" and order.type == "market":
            return OrderOutcome(
                f"{lead}order {order.id} was ACCEPTED and waits to fill: {what}; it fills "
                f"at the open of the next candle. Do not place it again; see it with "
                f"get_order({calls}).", is_error=False)
        if order.status == "open":
            return OrderOutcome(
                f"{lead}order {order.id} is RESTING on the book: {what}{at}, filled "
                f"{_plain(order.filled)} so far. Do not place it again; cancel it with "
                f"cancel_order({calls}) if you no longer want it.", is_error=False)
        if order.status == "rejected":
            return OrderOutcome(
                f"{lead}order {order.id} was REJECTED by the exchange: {what}{at}, nothing "
                "filled. Place a new order if you still want one.", is_error=True)
        filled = (f"; {_plain(order.filled)} {base} filled before that"
                  f"{' at ' + format_price(order.average) if order.average else ''}"
                  f"{_fee(order)}" if order.filled else "; nothing filled")
        return OrderOutcome(
            f"{lead}order {order.id} was placed ({what}{at}) and is now "
            f"{order.status.upper()}{filled}. Nothing more will fill; place a new order if "
            "you still want one.", is_error=False)

    def _never_sent(self, client_id: str, approval: str | None, how: str) -> OrderOutcome:
        why = _NOT_APPROVED.get(approval or "approved")
        because = f"{why}, so it never reached the exchange" if why else how
        again = " (it will wait for approval again)" if why else ""
        return OrderOutcome(
            f"{self._lead(client_id)}it was NEVER SENT: {because}. Nothing was bought or "
            f"sold; it is safe to place it again if you still want it{again}.", is_error=True)

    def _not_found_after_sending(self, client_id: str, sent_at: datetime) -> OrderOutcome:
        return OrderOutcome(
            f"{self._lead(client_id)}it was sent at {sent_at:%Y-%m-%d %H:%M:%S} UTC, but the "
            "exchange has no order with that id. It most likely never arrived, but that is "
            "not certain: check list_open_orders and your balances before placing it again.",
            is_error=True)

    def _unknown(self, client_id: str, failure: str) -> OrderOutcome:
        return OrderOutcome(
            f"Error: the call to place_order was interrupted before it finished; it may or "
            f"may not have taken effect, and looking it up on {self._exchange.name} failed "
            f"({failure}). Its client order id is {client_id}: check list_open_orders and "
            "get_order before placing it again.", is_error=True)


def _symbol(arguments: str) -> str:
    """The ``symbol`` argument as the order tool reads it, or empty."""
    try:
        data = json.loads(arguments)
    except ValueError:
        return ""
    symbol = data.get("symbol") if isinstance(data, dict) else None
    return symbol.strip().upper() if isinstance(symbol, str) else ""


def _plain(value: Decimal) -> str:
    """A decimal without exponent or trailing zeros (``0.01``, ``2``)."""
    text = f"{value:f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _fee(order: Order) -> str:
    return f", fee {format_amount(order.fee, order.fee_currency or '')}" if order.fee else ""
