"""How trading values read in a tool result: compact lines a model reads well.

No raw exchange JSON reaches the model: each value has one short, stable wording, numbers
with thousands separators and times in UTC.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime

from trading_agent.errors import ConfigError, ExchangeError, ToolError
from trading_agent.trading.exchange import Candle, Order
from trading_agent.trading.formatting import format_amount, format_price

__all__ = [
    "candles_table",
    "describe_order",
    "format_time",
    "readable_errors",
    "resolve_symbol",
]


def format_time(moment: datetime) -> str:
    """``2023-01-03 17:45 UTC``."""
    return f"{moment:%Y-%m-%d %H:%M} UTC"


def _plain(value: object) -> str:
    """A decimal without exponent or trailing zeros, for tables (``16612``, ``0.125``)."""
    text = f"{value:f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def describe_order(order: Order) -> str:
    """One line: id, what, price, status, fill and fee."""
    base = order.symbol.partition("/")[0]
    what = f"{order.side} {order.type} {_plain(order.amount)} {base}"
    price = f" @ {format_price(order.price)}" if order.price is not None else ""
    line = f"{order.id}: {what} on {order.symbol}{price}, {order.status}"
    if order.filled:
        average = f" at {format_price(order.average)}" if order.average is not None else ""
        line += f", filled {_plain(order.filled)}{average}"
    if order.fee:
        line += f", fee {format_amount(order.fee, order.fee_currency or '')}"
    return line + f" (placed {order.created_at:%m-%d %H:%M} UTC, client id {order.client_order_id})"


def candles_table(candles: Sequence[Candle]) -> str:
    """A CSV table with a header, times as ``MM-DD HH:MM`` (candle opens, UTC)."""
    lines = ["time,open,high,low,close,volume"]
    lines.extend(
        f"{c.opened_at:%m-%d %H:%M},{_plain(c.open)},{_plain(c.high)},{_plain(c.low)},"
        f"{_plain(c.close)},{_plain(round(c.volume, 3))}"
        for c in candles)
    return "\n".join(lines)


def resolve_symbol(symbol: str | None, symbols: Sequence[str]) -> str:
    """The symbol asked for, or the desk's first one.

    Raises:
        ToolError: No symbol given and the desk has none.
    """
    if symbol:
        return symbol.strip().upper()
    if not symbols:
        raise ToolError("Name a symbol, such as BTC/USDT.")
    return symbols[0]


@contextmanager
def readable_errors(action: str) -> Iterator[None]:
    """Turns exchange and configuration errors into a :class:`ToolError` the model reads.

    A :class:`~trading_agent.errors.RiskLimitError` is a ToolError already and passes as is.

    Args:
        action: What the tool was doing, for the message (``place the order``).
    """
    try:
        yield
    except ToolError:
        raise
    except (ExchangeError, ConfigError) as exc:
        raise ToolError(f"Could not {action}: {exc}") from exc
