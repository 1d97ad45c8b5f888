"""Account tools: ``get_balance`` and ``get_positions``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.tools.text import format_time, readable_errors
from trading_agent.trading.exchange import Exchange
from trading_agent.trading.formatting import format_amount, format_percent, format_price
from trading_agent.trading.valuation import value_account

__all__ = ["NoArguments", "register_account_tools"]


class NoArguments(BaseModel):
    """A tool that takes no arguments."""

    model_config = ConfigDict(extra="forbid")


def register_account_tools(registry: ToolRegistry, *, exchange: Exchange,
                           quote_currency: str) -> None:
    """Registers ``get_balance`` and ``get_positions``.

    Args:
        registry: Where to register them.
        exchange: The desk's exchange.
        quote_currency: The currency balances are valued in.
    """

    @registry.tool(description=f"The account's balances (free and held by open orders), "
                               f"each valued in {quote_currency}, and the total.")
    async def get_balance(arguments: NoArguments, context: ToolContext) -> str:
        with readable_errors("read the balances"):
            balances = await exchange.fetch_balances()
            valuation = await value_account(exchange, quote_currency, balances)
        if not balances:
            return f"The {exchange.name} account is empty."
        lines = [f"Balances on {exchange.name} at {format_time(exchange.now())}:"]
        for currency, balance in balances.items():
            value = valuation.by_currency.get(currency)
            worth = f" = {format_amount(value, quote_currency)}" if (
                value is not None and currency != quote_currency) else ""
            lines.append(f"{currency}: free {format_amount(balance.free)}, in orders "
                         f"{format_amount(balance.used)}, total {format_amount(balance.total)}"
                         f"{worth}")
        total = f"Total value {format_amount(valuation.total, quote_currency)}"
        if valuation.unpriced:
            total += f" (not counting {', '.join(valuation.unpriced)}: no price)"
        lines.append(total + ".")
        return "\n".join(lines)

    @registry.tool(description="Open positions with size, entry price, mark price, value and "
                               "unrealized profit or loss.")
    async def get_positions(arguments: NoArguments, context: ToolContext) -> str:
        with readable_errors("read the positions"):
            positions = await exchange.fetch_positions()
        if not positions:
            return "No open positions."
        lines = []
        for p in positions:
            base = p.symbol.partition("/")[0]
            quote = p.symbol.partition("/")[2].split(":")[0]
            line = (f"{p.symbol} {p.side} {format_amount(p.amount)} {base}, mark "
                    f"{format_price(p.mark_price)}, value {format_amount(p.notional, quote)}")
            pnl = p.unrealized_pnl
            if p.entry_price is not None and pnl is not None:
                cost = p.entry_price * p.amount
                share = f" ({format_percent(pnl / cost)})" if cost else ""
                line += (f", entry {format_price(p.entry_price)}, unrealized "
                         f"{'+' if pnl >= 0 else ''}{format_amount(pnl, quote)}{share}")
            lines.append(line)
        return "\n".join(lines)
