"""Every live order's client order id, written down before the order is sent.

The journal is how an order is never sent twice. The intent is committed (with full
durability, by the store) before the request leaves; when the answer is lost (a timeout, a
dropped connection, a crash), the order is looked up at the exchange by that id instead of
being sent again.

States: ``sending`` (committed, request in flight or its answer lost), ``placed`` (the
exchange has it), ``rejected`` (the exchange refused it), ``unknown`` (no answer, and a lookup
did not find it yet), ``lost`` (still not found at the exchange long after it was sent:
taken as never placed, so it no longer holds up new orders).

For reconciliation on start (:mod:`~trading_agent.trading.reconciliation`) the journal also
keeps each placed order's status as last seen (``open``, ``closed``...), so an order believed
open that is no longer on the book is looked up, and the account's balances as last seen,
so a change made while the daemon was away is reported. Both are tables of their own, added
to an older file as it is opened.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, Protocol

from trading_agent.trading.exchange import Balance, Order, OrderRequest, OrderStatus

__all__ = ["IntentState", "OrderIntent", "OrderJournal", "SeenBalances"]

IntentState = Literal["sending", "placed", "rejected", "unknown", "lost"]


@dataclass(frozen=True)
class OrderIntent:
    """An order as the journal knows it.

    Attributes:
        request: What was (to be) sent.
        exchange: The exchange's name.
        state: Where it stands.
        exchange_order_id: The exchange's id, once known.
        error: Why it was rejected or is unknown.
        created_at: When the intent was written.
    """

    request: OrderRequest
    exchange: str
    state: IntentState
    exchange_order_id: str | None
    error: str | None
    created_at: datetime


@dataclass(frozen=True)
class SeenBalances:
    """An account's balances as the daemon last saw them.

    Attributes:
        balances: The non-zero balances, by currency.
        seen_at: When they were seen.
    """

    balances: dict[str, Balance]
    seen_at: datetime


class OrderJournal(Protocol):
    """Every live order's client order id, written down before the order is sent (the
    store keeps it: ``store.order_journal.SqliteOrderJournal``)."""

    async def record(self, request: OrderRequest, exchange: str, at: datetime) -> None:
        """Commits the intent to send ``request``; call it before sending.

        Raises:
            StoreError: The id is already in the journal, or SQLite failed.
        """
        ...

    async def mark(self, client_order_id: str, state: IntentState, at: datetime, *,
                   exchange_order_id: str | None = None, error: str | None = None) -> None:
        """Records where an order stands now."""
        ...

    async def get(self, client_order_id: str) -> OrderIntent | None:
        """The intent with that id, or None."""
        ...

    async def unresolved(self, exchange: str) -> list[OrderIntent]:
        """Intents of ``exchange`` whose fate is not known (``sending`` or ``unknown``)."""
        ...

    async def get_by_exchange_order_id(self, exchange: str,
                                       exchange_order_id: str) -> OrderIntent | None:
        """The intent of ``exchange`` the exchange knows by ``exchange_order_id``, or None."""
        ...

    async def note_status(self, order: Order, at: datetime) -> None:
        """Remembers an order's status as just seen; ignored for an order not in the
        journal (someone else's)."""
        ...

    async def last_status(self, client_order_id: str) -> OrderStatus | None:
        """The order's status when last seen, or None when never noted."""
        ...

    async def believed_open(self, exchange: str) -> list[OrderIntent]:
        """Intents of ``exchange`` that may still be on the book: unresolved ones
        (``sending``, ``unknown``) and placed ones last seen open or never seen since,
        oldest first."""
        ...

    async def adopt(self, order: Order, exchange: str, at: datetime) -> bool:
        """Records an order found on the exchange that the journal did not know (placed with
        our client id by an earlier run whose journal entry is gone) as placed.

        Returns:
            False when the journal already had its client order id.
        """
        ...

    async def record_balances(self, exchange: str, balances: Mapping[str, Balance],
                              at: datetime) -> None:
        """Remembers the account's balances on ``exchange`` as seen at ``at``."""
        ...

    async def last_balances(self, exchange: str) -> SeenBalances | None:
        """The balances last recorded for ``exchange``, or None when never."""
        ...

    async def close(self) -> None:
        """Closes the file."""
        ...
