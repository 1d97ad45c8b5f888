"""What an account is worth in one currency, from an exchange's balances and prices."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal

from trading_agent.errors import ExchangeError
from trading_agent.trading.exchange import Balance, Exchange, Market

__all__ = ["Valuation", "convert", "value_account"]


@dataclass(frozen=True)
class Valuation:
    """An account's value, or a desk's equity by its books.

    Attributes:
        currency: The currency of ``total``.
        total: The value of every balance that could be priced.
        by_currency: Each balance's value (for the ``books`` basis: each market's profit).
        unpriced: Currencies held that have no market against ``currency`` (left out); for
            the ``books`` basis, markets without a mark.
        basis: What was valued: ``account``, the account's balances (a paper account is its
            desk's alone); ``books``, a desk's own profit by its books (a live desk, whose
            account may hold other desks' coins and the user's).
    """

    currency: str
    total: Decimal
    by_currency: dict[str, Decimal]
    unpriced: tuple[str, ...]
    basis: Literal["account", "books"] = "account"


async def convert(exchange: Exchange, amount: Decimal, currency: str, into: str,
                  markets: Mapping[str, Market] | None = None) -> Decimal | None:
    """``amount`` of ``currency`` in ``into`` at the last price, or None when no market links them.

    Args:
        exchange: Where the prices come from.
        amount: How much.
        currency: Of what.
        into: The target currency.
        markets: The exchange's markets, when the caller has them already.
    """
    if currency == into or not amount:
        return amount
    markets = markets if markets is not None else await exchange.markets()
    direct, inverse = f"{currency}/{into}", f"{into}/{currency}"
    try:
        if direct in markets:
            return amount * (await exchange.fetch_ticker(direct)).last
        if inverse in markets:
            price = (await exchange.fetch_ticker(inverse)).last
            return amount / price if price else None
    except ExchangeError:
        return None
    return None


async def value_account(exchange: Exchange, currency: str,
                        balances: Mapping[str, Balance] | None = None) -> Valuation:
    """The account's balances valued in ``currency`` at the last prices.

    Args:
        exchange: The exchange holding the account.
        currency: The currency to value in (the risk limits' quote currency).
        balances: The balances, when the caller has them already.
    """
    balances = balances if balances is not None else await exchange.fetch_balances()
    markets = await exchange.markets()
    by_currency: dict[str, Decimal] = {}
    unpriced: list[str] = []
    for code, balance in balances.items():
        value = await convert(exchange, balance.total, code, currency, markets)
        if value is None:
            unpriced.append(code)
        else:
            by_currency[code] = value
    return Valuation(currency, sum(by_currency.values(), Decimal(0)), by_currency,
                     tuple(unpriced))
