"""Account tools: ``get_balance`` (the account's), ``get_positions`` and ``get_trade_record``
(the desk's own, from its books)."""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal

from pydantic import BaseModel, ConfigDict, Field

from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.tools.text import format_time, readable_errors
from trading_agent.trading.books import RoundTrip
from trading_agent.trading.desk_books import DeskBooks, ProfitSummary
from trading_agent.trading.exchange import Exchange
from trading_agent.trading.formatting import format_amount, format_percent, format_price
from trading_agent.trading.protection_keeper import ProtectionKeeper
from trading_agent.trading.valuation import value_account

__all__ = ["NoArguments", "RecordArguments", "record_text", "register_account_tools",
           "register_record_tool"]


class NoArguments(BaseModel):
    """A tool that takes no arguments."""

    model_config = ConfigDict(extra="forbid")


def register_account_tools(registry: ToolRegistry, *, exchange: Exchange,
                           quote_currency: str,
                           protection: ProtectionKeeper | None = None) -> None:
    """Registers ``get_balance`` and ``get_positions``.

    Args:
        registry: Where to register them.
        exchange: The desk's exchange.
        quote_currency: The currency balances are valued in.
        protection: The desk's protection keeper: ``get_positions`` shows each position's
            stop and target.
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

    @registry.tool(description="This desk's own open positions (what it bought itself, not the "
                               "whole account) with size, entry price, mark price, value and "
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
            if protection is not None:
                with readable_errors("read the protection"):
                    guarded = await protection.live(p.symbol)
                lines.extend(f"  protection: {order.describe()}" for order in guarded)
        return "\n".join(lines)


class RecordArguments(BaseModel):
    """How much of the desk's record to read."""

    model_config = ConfigDict(extra="forbid")

    trades: int = Field(default=10, ge=1, le=100,
                        description="How many of the latest round-trip trades to list")


def register_record_tool(registry: ToolRegistry, *, books: DeskBooks) -> None:
    """Registers ``get_trade_record``: the desk's round trips and profit, from its books.

    Args:
        registry: Where to register it.
        books: The desk's books.
    """

    @registry.tool(description="Your own trading record: your latest round-trip trades (entry, "
                               "exit, profit) and your profit today and all time, so you can "
                               "judge how your decisions went.")
    async def get_trade_record(arguments: RecordArguments, context: ToolContext) -> str:
        with readable_errors("read the trade record"):
            trades = await books.trades()
            summary = await books.summary()
        return record_text(trades[-arguments.trades:], summary, len(trades))


def record_text(trades: Sequence[RoundTrip], summary: ProfitSummary, total: int) -> str:
    """The record as the model reads it.

    Args:
        trades: The round trips to list, oldest first.
        summary: Profit today and all time.
        total: How many round trips the desk has made in all.
    """
    if not trades:
        lines = ["No trades yet: no position was ever opened."]
    else:
        shown = f"the last {len(trades)} of {total}" if total > len(trades) else f"all {total}"
        lines = [f"Round-trip trades ({shown}, oldest first):"]
    for trade in trades:
        quote = trade.symbol.partition("/")[2].split(":")[0]
        base = trade.symbol.partition("/")[0]
        line = (f"#{trade.id} {trade.symbol} {trade.side} {format_amount(trade.amount)} {base}, "
                f"opened {format_time(trade.opened_at)} at {format_price(trade.entry_price)}")
        if trade.is_open:
            line += f", still open ({format_amount(trade.amount - trade.exited)} {base} held)"
        else:
            assert trade.closed_at is not None and trade.exit_price is not None
            line += (f", closed {format_time(trade.closed_at)} at "
                     f"{format_price(trade.exit_price)} ({trade.exit_reason})")
        sign = "+" if trade.profit >= 0 else ""
        line += (f": profit {sign}{format_amount(trade.profit, quote)} "
                 f"({sign}{trade.profit_percent:.2f}%), fees {format_amount(trade.fees, quote)}")
        lines.append(line)
    unrealized = ("unknown (no price)" if summary.unrealized is None
                  else _signed(summary.unrealized))
    rate = ("" if summary.win_rate is None
            else f", {summary.wins} of {summary.trades_closed} closed trades won "
                 f"({summary.win_rate:.0%})")
    lines.append(f"Realized profit today {_signed(summary.realized_today)}, all time "
                 f"{_signed(summary.realized_total)} (fees {format_amount(summary.fees_total)} "
                 f"paid); unrealized now {unrealized}{rate}.")
    return "\n".join(lines)


def _signed(amount: Decimal) -> str:
    return ("+" if amount >= 0 else "") + format_amount(amount)
