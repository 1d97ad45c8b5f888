"""Numbers written for people and models: ``12,500.00 USDT``, ``0.0125 BTC``, ``+1.23%``."""

from __future__ import annotations

from decimal import Decimal

__all__ = ["format_amount", "format_percent", "format_price"]


def format_amount(value: Decimal, currency: str = "") -> str:
    """Two decimals with thousands separators, or up to eight significant places below 1.

    Args:
        value: The amount.
        currency: Appended after a space, when given.
    """
    if abs(value) >= 1 or value == 0:
        text = f"{value:,.2f}"
    else:
        text = f"{value:,.8f}".rstrip("0").rstrip(".")
    return f"{text} {currency}" if currency else text


def format_price(value: Decimal) -> str:
    """A price with enough decimals for its size (``16,709.90``, ``0.04512``)."""
    magnitude = abs(value)
    places = 2 if magnitude >= 100 else 4 if magnitude >= 1 else 8
    text = f"{value:,.{places}f}"
    if places > 2:
        text = text.rstrip("0").rstrip(".")
    return text


def format_percent(ratio: Decimal) -> str:
    """A signed percentage from a ratio (0.0123 → ``+1.23%``)."""
    return f"{ratio * 100:+.2f}%"
