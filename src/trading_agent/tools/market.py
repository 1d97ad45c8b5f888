"""Market data tools: ``get_ticker``, ``get_order_book``, ``get_candles``."""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal

from pydantic import BaseModel, ConfigDict, Field

from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.errors import ToolError
from trading_agent.tools.text import candles_table, format_time, readable_errors, resolve_symbol
from trading_agent.trading.exchange import Exchange
from trading_agent.trading.formatting import format_amount, format_percent, format_price

__all__ = ["CandlesArguments", "OrderBookArguments", "SymbolArguments",
           "register_market_tools"]

TIMEFRAME_PATTERN = r"^\d+[mhdw]$"


class SymbolArguments(BaseModel):
    """A market."""

    model_config = ConfigDict(extra="forbid")

    symbol: str | None = Field(default=None, description="Market symbol such as BTC/USDT; "
                               "the desk's first symbol when omitted")


class OrderBookArguments(SymbolArguments):
    """A market and how deep to look."""

    depth: int = Field(default=10, ge=1, le=50, description="Levels on each side")


class CandlesArguments(SymbolArguments):
    """A market, a timeframe and how many candles."""

    timeframe: str = Field(default="5m", pattern=TIMEFRAME_PATTERN,
                           description="Candle length: 5m, 15m, 1h, 4h, 1d")
    limit: int = Field(default=30, ge=1, le=300, description="How many candles, newest last")


def register_market_tools(registry: ToolRegistry, *, exchange: Exchange,
                          symbols: Sequence[str]) -> None:
    """Registers ``get_ticker``, ``get_order_book`` and ``get_candles``.

    Args:
        registry: Where to register them.
        exchange: Where the data comes from.
        symbols: The desk's symbols; the first is the default.
    """
    listed = ", ".join(symbols) or "any"

    @registry.tool(description=f"Last price, bid, ask and 24h change of a market. "
                               f"Desk symbols: {listed}.")
    async def get_ticker(arguments: SymbolArguments, context: ToolContext) -> str:
        symbol = resolve_symbol(arguments.symbol, symbols)
        with readable_errors(f"read the ticker of {symbol}"):
            ticker = await exchange.fetch_ticker(symbol)
        parts = [f"{symbol} last {format_price(ticker.last)}"]
        if ticker.bid is not None and ticker.ask is not None:
            parts.append(f"bid {format_price(ticker.bid)} / ask {format_price(ticker.ask)}")
        day = []
        if ticker.change_24h is not None:
            day.append(f"24h {format_percent(ticker.change_24h)}")
        if ticker.volume_24h is not None:
            day.append(f"volume {format_amount(ticker.volume_24h)} "
                       f"{symbol.partition('/')[0]}")
        if day:
            parts.append(", ".join(day))
        parts.append(f"at {format_time(ticker.at)}")
        return " · ".join(parts)

    @registry.tool(description="The best bids and asks of a market, with the spread.")
    async def get_order_book(arguments: OrderBookArguments, context: ToolContext) -> str:
        symbol = resolve_symbol(arguments.symbol, symbols)
        with readable_errors(f"read the order book of {symbol}"):
            book = await exchange.fetch_order_book(symbol, arguments.depth)
        if not book.bids or not book.asks:
            raise ToolError(f"The {symbol} order book is empty.")
        note = " (simulated from candles: paper fills ignore depth)" if book.simulated else ""
        lines = [f"{symbol} order book at {format_time(book.at)}{note}", "asks, best last:"]
        lines += [f"  {format_price(p)}  {format_amount(a)}" for p, a in reversed(book.asks)]
        lines.append("bids, best first:")
        lines += [f"  {format_price(p)}  {format_amount(a)}" for p, a in book.bids]
        best_bid, best_ask = book.bids[0][0], book.asks[0][0]
        spread = best_ask - best_bid
        middle = (best_ask + best_bid) / 2
        lines.append(f"spread {format_price(spread)} "
                     f"({spread / middle * 10000:.1f} bps), mid {format_price(middle)}")
        return "\n".join(lines)

    @registry.tool(description="OHLCV candles of a market as a CSV table, oldest first, "
                               "with a one-line summary.")
    async def get_candles(arguments: CandlesArguments, context: ToolContext) -> str:
        symbol = resolve_symbol(arguments.symbol, symbols)
        with readable_errors(f"read {arguments.timeframe} candles of {symbol}"):
            candles = list(await exchange.fetch_candles(symbol, arguments.timeframe,
                                                        arguments.limit))
        if not candles:
            raise ToolError(f"No {arguments.timeframe} candles of {symbol} yet.")
        first, last = candles[0], candles[-1]
        change = last.close / first.open - 1 if first.open else Decimal(0)
        summary = (f"{symbol} {arguments.timeframe}: {len(candles)} candles from "
                   f"{format_time(first.opened_at)} to {format_time(last.opened_at)} (open "
                   f"times, UTC). Close {format_price(last.close)}, change "
                   f"{format_percent(change)}, high {format_price(max(c.high for c in candles))}, "
                   f"low {format_price(min(c.low for c in candles))}.")
        now = exchange.now()
        if last.closes_at > now:
            summary += (" The last candle is still forming: its close is the price at "
                        f"{format_time(now)}.")
        return summary + "\n" + candles_table(candles)
