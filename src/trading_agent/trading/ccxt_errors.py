"""ccxt's exceptions, translated at the boundary into the project's, with secrets scrubbed.

============================================  ===========================================
ccxt                                          project
============================================  ===========================================
``NetworkError`` (``RequestTimeout``,         :class:`ExchangeUnavailableError` (retried
``DDoSProtection``, ``RateLimitExceeded``,    first, for reads)
``ExchangeNotAvailable``...)
``InsufficientFunds``, ``InvalidOrder``,      :class:`OrderRejectedError`, its message
``OrderNotFound``, ``BadSymbol``,             readable by the model
``BadRequest``, ``OperationRejected``...
``AuthenticationError``, anything else        :class:`ExchangeError`
============================================  ===========================================

The message keeps what the exchange said (its ``msg``) and drops what could leak: URL query
strings (they carry signatures) and any configured secret, wherever it appears.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import ccxt

from trading_agent.errors import ExchangeError, ExchangeUnavailableError, OrderRejectedError

__all__ = ["is_transient", "scrub", "translate"]

_QUERY = re.compile(r"(https?://[^\s?]+)\?\S*")
_EXCHANGE_SAYS = re.compile(
    r'"(?:msg|message|error_description|error|retMsg)"\s*:\s*"([^"]{1,300})"')
_MAX_LENGTH = 300

_REJECTIONS: tuple[tuple[type[Exception], str], ...] = (
    (ccxt.InsufficientFunds, "insufficient funds"),
    (ccxt.BadSymbol, "unknown symbol"),
    (ccxt.OrderNotFound, "no such order"),
    (ccxt.InvalidOrder, "invalid order"),
    (ccxt.ArgumentsRequired, "missing argument"),
    (ccxt.BadRequest, "bad request"),
    (ccxt.MarketClosed, "market closed"),
    (ccxt.OperationRejected, "rejected"),
)


def is_transient(exc: BaseException) -> bool:
    """Whether a read that failed with ``exc`` is worth trying again."""
    return isinstance(exc, ccxt.NetworkError)


def scrub(message: str, secrets: Iterable[str]) -> str:
    """``message`` without URL query strings or any of ``secrets``, cut to a sane length."""
    cleaned = _QUERY.sub(r"\1?…", message)
    for secret in secrets:
        if secret:
            cleaned = cleaned.replace(secret, "***")
    return cleaned if len(cleaned) <= _MAX_LENGTH else cleaned[:_MAX_LENGTH] + "…"


def _what_the_exchange_said(message: str, exchange_id: str) -> str:
    found = _EXCHANGE_SAYS.search(message)
    if found:
        return found.group(1)
    # ccxt starts its messages with the exchange id; the caller names the exchange already.
    return message.removeprefix(f"{exchange_id} ") if exchange_id else message


def translate(exc: Exception, *, exchange: str, action: str, secrets: Iterable[str] = (),
              exchange_id: str = "") -> ExchangeError:
    """The project error for a ccxt exception (raise it ``from exc``).

    Args:
        exc: What ccxt raised.
        exchange: The exchange's name, for the message.
        action: What was being done (``fetch ticker BTC/USDT``).
        secrets: Strings that must not appear in the message.
        exchange_id: The ccxt id, which ccxt puts at the start of its messages.
    """
    said = scrub(_what_the_exchange_said(str(exc), exchange_id), secrets)
    if isinstance(exc, ccxt.NetworkError):
        kind = {
            ccxt.RequestTimeout: "timed out",
            ccxt.RateLimitExceeded: "rate limit exceeded",
            ccxt.DDoSProtection: "rate limited (DDoS protection)",
        }.get(type(exc), "unreachable")
        return ExchangeUnavailableError(f"{exchange} {kind} during {action}: {said}")
    for error_class, reason in _REJECTIONS:
        if isinstance(exc, error_class):
            return OrderRejectedError(f"{exchange} refused {action}: {reason}: {said}")
    if isinstance(exc, ccxt.AuthenticationError):
        return ExchangeError(f"{exchange} refused the credentials during {action}: {said}")
    return ExchangeError(f"{exchange} failed during {action}: {said}")
