"""Numbers written for people and models: ``12,500.00 USDT``, ``0.0125 BTC``, ``+1.23%``."""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Context, Decimal, localcontext

__all__ = ["format_amount", "format_percent", "format_price"]

# Half to even, whatever the current decimal context says (a library may have changed it):
# the same amount reads the same in every request, live and replayed.
_WRITING = Context(prec=40, rounding=ROUND_HALF_EVEN)


def format_amount(value: Decimal, currency: str = "") -> str:
    """Two decimals with thousands separators, or up to eight significant places below 1.

    Args:
        value: The amount.
        currency: Appended after a space, when given.
    """
    with localcontext(_WRITING):
        if abs(value) >= 1 or value == 0:
            text = f"{value:,.2f}"
        else:
            text = f"{value:,.8f}".rstrip("0").rstrip(".")
    return f"{text} {currency}" if currency else text


def format_price(value: Decimal) -> str:
    """A price with enough decimals for its size (``16,709.90``, ``0.04512``)."""
    magnitude = abs(value)
    places = 2 if magnitude >= 100 else 4 if magnitude >= 1 else 8
    with localcontext(_WRITING):
        text = f"{value:,.{places}f}"
    if places > 2:
        text = text.rstrip("0").rstrip(".")
    return text


def format_percent(ratio: Decimal) -> str:
    """A signed percentage from a ratio (0.0123 → ``+1.23%``)."""
    with localcontext(_WRITING):
        return f"{ratio * 100:+.2f}%"
