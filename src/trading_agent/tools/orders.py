"""Order tools: ``place_order`` (dangerous: it passes the approval gate), ``cancel_order``,
``get_order`` and ``list_open_orders``.

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

from collections.abc import Sequence
from decimal import Decimal
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.tools.market import SymbolArguments
from trading_agent.tools.text import describe_order, readable_errors, resolve_symbol
from trading_agent.trading.exchange import Exchange, Order, OrderRequest, client_order_id_for
from trading_agent.trading.formatting import format_amount, format_price
from trading_agent.trading.risk import RiskPolicy

__all__ = ["PLACE_ORDER_MARGIN_SECONDS", "OrderArguments", "OrderIdArguments",
           "register_order_tools"]

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

    @model_validator(mode="after")
    def _price_matches_type(self) -> OrderArguments:
        if self.type == "limit" and self.price is None:
            raise ValueError("a limit order needs a price")
        if self.type == "market" and self.price is not None:
            raise ValueError("a market order takes no price; use type limit to set one")
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


def register_order_tools(registry: ToolRegistry, *, exchange: Exchange,
                         risk_policy: RiskPolicy, symbols: Sequence[str]) -> None:
    """Registers ``place_order``, ``cancel_order``, ``get_order`` and ``list_open_orders``.

    Args:
        registry: Where to register them.
        exchange: The desk's exchange (for reads and cancels).
        risk_policy: The desk's risk policy on that exchange (for orders).
        symbols: The desk's symbols.
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
            await risk_policy.check(request)

    @registry.tool(description="Place a market or limit order. It is checked against the "
                               "desk's risk limits first; a refusal explains which limit.",
                   dangerous=True,
                   timeout_seconds=risk_policy.max_place_seconds + PLACE_ORDER_MARGIN_SECONDS,
                   precheck=check_order)
    async def place_order(arguments: OrderArguments, context: ToolContext) -> str:
        request = _order_request(arguments, context)
        with readable_errors(f"place the order ({request.side} {request.amount} "
                             f"{request.symbol})"):
            # Checks the limits again at current prices, under the lock, then sends.
            order = await risk_policy.place_order(request)
        return _placed(order)

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
