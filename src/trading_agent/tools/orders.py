"""Order tools: ``place_order`` (dangerous: it passes the approval gate), ``cancel_order``,
``get_order``, ``list_open_orders`` and ``set_protection``.

``place_order`` takes an optional ``stop_loss`` and ``take_profit``: the protection of the
position the order opens or adds to, checked with the limits (``require_stop_loss``,
``max_loss_per_trade``, each on the right side of the price) and stored before the entry is
sent; it becomes active once the entry fills. ``set_protection`` sets, moves or removes the
protection of a position held (see :mod:`trading_agent.trading.protection`).

Every order goes through the desk's :class:`~trading_agent.trading.risk.RiskPolicy`, which
checks the limits and places it under one lock. A refusal (a risk limit, the exchange)
comes back as a :class:`~trading_agent.errors.ToolError` whose message the model reads.

Risk comes before approval: ``place_order``'s precheck runs the same checks before the
approval gate is asked, so an operator is never asked to approve an order the limits refuse
(the model reads the refusal at once). An approved order is checked again when it is sent,
at the prices of that moment.

An order's client order id comes from the desk, turn and tool call, so the same call run
twice places one order; ``place_order``'s timeout exceeds the longest the risk policy can
take, so an order is never abandoned while the exchange may be taking it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from decimal import Decimal
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.errors import ToolError, TradingAgentError
from trading_agent.tools.market import SymbolArguments
from trading_agent.tools.text import describe_order, readable_errors, resolve_symbol
from trading_agent.trading.exchange import Exchange, Order, OrderRequest, client_order_id_for
from trading_agent.trading.formatting import format_amount, format_price
from trading_agent.trading.protection import (
    ProtectiveOrder,
    check_entry_protection,
    check_position_protection,
)
from trading_agent.trading.protection_keeper import KEEP, ProtectionKeeper
from trading_agent.trading.risk import RiskPolicy

__all__ = ["PLACE_ORDER_MARGIN_SECONDS", "OrderArguments", "OrderIdArguments",
           "ProtectionArguments", "register_order_tools"]

PLACE_ORDER_MARGIN_SECONDS = 15.0
"""How much longer ``place_order``'s timeout is than the risk policy's longest order."""


class OrderArguments(BaseModel):
    """An order to place."""

    model_config = ConfigDict(extra="forbid")

    symbol: str = Field(description="Market symbol such as BTC/USDT")
    side: Literal["buy", "sell"]
    type: Literal["market", "limit"] = Field(
        description="market fills now at the best price; limit rests at your price")
    amount: Decimal = Field(gt=0, description="Quantity of the base currency (BTC in BTC/USDT)")
    price: Decimal | None = Field(default=None, gt=0,
                                  description="Limit price in the quote currency; limit only")
    stop_loss: Decimal | None = Field(
        default=None, gt=0, description="Optional stop-loss price for the position this order "
        "opens or adds to (below the price for a buy); it closes the position if reached")
    take_profit: Decimal | None = Field(
        default=None, gt=0, description="Optional take-profit price for the position this order "
        "opens or adds to (above the price for a buy)")

    @model_validator(mode="after")
    def _price_matches_type(self) -> OrderArguments:
        if self.type == "limit" and self.price is None:
            raise ValueError("a limit order needs a price")
        if self.type == "market" and self.price is not None:
            raise ValueError("a market order takes no price; use type limit to set one")
        return self


class ProtectionArguments(BaseModel):
    """The protection of a position held: what to set, move or remove."""

    model_config = ConfigDict(extra="forbid")

    symbol: str = Field(description="The position's market, such as BTC/USDT")
    stop_loss: Decimal | None = Field(default=None, gt=0,
                                      description="Set or move the stop-loss to this price")
    take_profit: Decimal | None = Field(default=None, gt=0,
                                        description="Set or move the take-profit to this price")
    remove_stop_loss: bool = Field(default=False, description="Remove the stop-loss")
    remove_take_profit: bool = Field(default=False, description="Remove the take-profit")

    @model_validator(mode="after")
    def _something_to_do(self) -> ProtectionArguments:
        if self.stop_loss is not None and self.remove_stop_loss:
            raise ValueError("either move the stop_loss or remove it, not both")
        if self.take_profit is not None and self.remove_take_profit:
            raise ValueError("either move the take_profit or remove it, not both")
        if self.stop_loss is None and self.take_profit is None and \
                not self.remove_stop_loss and not self.remove_take_profit:
            raise ValueError("give a stop_loss or take_profit price, or remove one")
        return self


class OrderIdArguments(BaseModel):
    """An order, by id."""

    model_config = ConfigDict(extra="forbid")

    order_id: str = Field(min_length=1, description="The order id from place_order or "
                                                    "list_open_orders")
    symbol: str = Field(description="The order's market, such as BTC/USDT")


def _placed(order: Order) -> str:
    base = order.symbol.partition("/")[0]
    if order.status == "closed":
        verb = "bought" if order.side == "buy" else "sold"
        price = format_price(order.average) if order.average is not None else "?"
        fee = f", fee {format_amount(order.fee, order.fee_currency or '')}" if order.fee else ""
        return (f"Order {order.id} filled: {verb} {order.filled} {base} on {order.symbol} at "
                f"{price} ({order.type}){fee}.")
    if order.status == "open" and order.type == "market":
        return (f"Order {order.id} accepted: {order.side} market {order.amount} {base} on "
                f"{order.symbol}. It fills at the open of the next candle; see it with "
                f"get_order(order_id={order.id!r}).")
    if order.status == "open":
        return (f"Order {order.id} placed and resting: {order.side} {order.type} "
                f"{order.amount} {base} on {order.symbol} @ "
                f"{format_price(order.price or Decimal(0))}, filled {order.filled} so far. "
                f"Cancel it with cancel_order(order_id={order.id!r}).")
    return f"Order {order.id} is {order.status}: {describe_order(order)}."


def _order_request(arguments: OrderArguments, context: ToolContext) -> OrderRequest:
    """The order a call asks for; its client id is the call's, so a re-run places one."""
    return OrderRequest(arguments.symbol.strip().upper(), arguments.side, arguments.type,
                        arguments.amount, arguments.price,
                        client_order_id_for(context.desk, context.turn, context.call_id),
                        context.turn)


def _protection_text(orders: Sequence[ProtectiveOrder]) -> str:
    if not orders:
        return "No stop-loss or take-profit protects it now."
    return "Protection: " + "; ".join(order.describe() for order in orders) + "."


async def _check_protection(arguments: OrderArguments, request: OrderRequest,
                            exchange: Exchange, risk_policy: RiskPolicy) -> None:
    """The order's protection against the limits, at the price it would trade at now."""
    limits = risk_policy.limits
    if not limits.require_stop_loss and limits.max_loss_per_trade is None and \
            arguments.stop_loss is None and arguments.take_profit is None:
        return
    held = sum((p.signed_amount for p in await exchange.fetch_positions([request.symbol])
                if p.symbol == request.symbol), Decimal(0))
    opens = held == 0 or (held > 0) == (request.side == "buy")
    if request.price is not None:
        price, name = request.price, "limit price"
    else:
        ticker = await exchange.fetch_ticker(request.symbol)
        if request.side == "buy":
            price, name = ticker.ask or ticker.last, "ask"
        else:
            price, name = ticker.bid or ticker.last, "bid"
    check_entry_protection(limits, symbol=request.symbol, side=request.side,
                           amount=request.amount, price=price, opens=opens,
                           stop_loss=arguments.stop_loss, take_profit=arguments.take_profit,
                           price_name=name)


def register_order_tools(registry: ToolRegistry, *, exchange: Exchange,
                         risk_policy: RiskPolicy, symbols: Sequence[str],
                         protection: ProtectionKeeper | None = None) -> None:
    """Registers ``place_order``, ``cancel_order``, ``get_order``, ``list_open_orders`` and,
    given a protection keeper, ``set_protection``.

    Args:
        registry: Where to register them.
        exchange: The desk's exchange (for reads and cancels).
        risk_policy: The desk's risk policy on that exchange (for orders).
        symbols: The desk's symbols.
        protection: The desk's protection keeper; without one, an order's stop_loss and
            take_profit are refused.
    """

    async def check_order(arguments: OrderArguments, context: ToolContext) -> None:
        """Refuses, before any approval is asked, an order the risk limits refuse now.

        Not under the risk policy's order lock, and nothing is placed: this only spares the
        operator a question whose answer cannot matter. The order is checked again, under
        the lock, when it is sent: prices, positions and other orders may change while an
        operator decides, and only that check guards the money.
        """
        request = _order_request(arguments, context)
        with readable_errors(f"check the order ({request.side} {request.amount} "
                             f"{request.symbol})"):
            await _check_protection(arguments, request, exchange, risk_policy)
            await risk_policy.check(request)

    @registry.tool(description="Place a market or limit order, optionally with a stop_loss "
                               "and a take_profit that protect the position it opens. It is "
                               "checked against the desk's risk limits first; a refusal "
                               "explains which limit.",
                   dangerous=True,
                   timeout_seconds=risk_policy.max_place_seconds + PLACE_ORDER_MARGIN_SECONDS,
                   precheck=check_order)
    async def place_order(arguments: OrderArguments, context: ToolContext) -> str:
        request = _order_request(arguments, context)
        protected = arguments.stop_loss is not None or arguments.take_profit is not None
        with readable_errors(f"place the order ({request.side} {request.amount} "
                             f"{request.symbol})"):
            await _check_protection(arguments, request, exchange, risk_policy)
            if protected:
                if protection is None:
                    raise ToolError("this desk's venue keeps no protection: place the order "
                                    "without stop_loss and take_profit")
                # Stored before the entry is sent: a crash in between keeps the intent.
                await protection.attach(request, arguments.stop_loss, arguments.take_profit)
            try:
                # Checks the limits again at current prices, under the lock, then sends.
                order = await risk_policy.place_order(request)
            except TradingAgentError:
                if protection is not None:
                    if protected:
                        await protection.entry_refused(request)
                    # A stop the exchange held was cancelled for this order: placed again.
                    with contextlib.suppress(TradingAgentError):
                        await protection.step()
                raise
            if protection is None:
                return _placed(order)
            # The protection follows the position at once: an entry's starts, a stop
            # cancelled for a reducing order is placed again for what is left. The order
            # is placed whatever happens here: a failure waits for the next candle's step.
            try:
                await protection.step()
            except TradingAgentError as exc:
                return (f"{_placed(order)} Its protection could not be updated yet ({exc}); "
                        "it is tried again on the next candle.")
            if not protected:
                return _placed(order)
            live = await protection.live(request.symbol)
        if order.status == "closed":
            return f"{_placed(order)} {_protection_text(live)}"
        return (f"{_placed(order)} Its stop_loss/take_profit wait for it to fill, then protect "
                "the position.")

    @registry.tool(description="Cancel an open order.")
    async def cancel_order(arguments: OrderIdArguments, context: ToolContext) -> str:
        with readable_errors(f"cancel order {arguments.order_id}"):
            order = await exchange.cancel_order(arguments.order_id,
                                                arguments.symbol.strip().upper())
        return f"Canceled. {describe_order(order)}"

    @registry.tool(description="The current status of one order.")
    async def get_order(arguments: OrderIdArguments, context: ToolContext) -> str:
        with readable_errors(f"read order {arguments.order_id}"):
            order = await exchange.fetch_order(arguments.order_id,
                                               arguments.symbol.strip().upper())
        return describe_order(order)

    @registry.tool(description="Orders resting on the book, oldest first.")
    async def list_open_orders(arguments: SymbolArguments, context: ToolContext) -> str:
        symbol = resolve_symbol(arguments.symbol, symbols) if arguments.symbol else None
        with readable_errors("list the open orders"):
            orders = await exchange.fetch_open_orders(symbol)
        where = f" on {symbol}" if symbol else ""
        if not orders:
            return f"No open orders{where}."
        header = f"{len(orders)} open order{'s' if len(orders) > 1 else ''}{where}:"
        return "\n".join([header, *(describe_order(o) for o in orders)])

    if protection is not None:
        keeper = protection

        @registry.tool(description="Set, move or remove the stop-loss and take-profit of a "
                                   "position you hold. The stop closes the whole position if "
                                   "the price falls to it (rises, for a short); the target if "
                                   "it rises to it. Setting one side replaces the old one.")
        async def set_protection(arguments: ProtectionArguments, context: ToolContext) -> str:
            symbol = resolve_symbol(arguments.symbol, symbols)
            with readable_errors(f"set the protection of {symbol}"):
                held = [p for p in await exchange.fetch_positions([symbol])
                        if p.symbol == symbol]
                if not held:
                    raise ToolError(f"This desk holds no {symbol} position; a stop_loss or "
                                    "take_profit goes with place_order for a new one.")
                position = held[0]
                check_position_protection(
                    risk_policy.limits, symbol=symbol, held=position.signed_amount,
                    entry_price=position.entry_price, mark=position.mark_price,
                    stop_loss=arguments.stop_loss, take_profit=arguments.take_profit,
                    removes_stop=arguments.remove_stop_loss)
                stop: Decimal | Literal["keep"] | None = None \
                    if arguments.remove_stop_loss else (arguments.stop_loss or KEEP)
                target: Decimal | Literal["keep"] | None = None \
                    if arguments.remove_take_profit else (arguments.take_profit or KEEP)
                live = await keeper.set(symbol, stop_loss=stop, take_profit=target)
            return f"{symbol} {position.side} {position.amount}: {_protection_text(live)}"
