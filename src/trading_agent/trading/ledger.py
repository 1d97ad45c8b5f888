"""The paper exchange's books in SQLite: orders, fills, balances, positions.

Every change the paper exchange makes is one :class:`LedgerChanges`, written in one
transaction: order rows inserted or updated, fills and balance changes appended, current
balances and positions updated row by row. Reopening the file gives back exactly the open
orders, balances and positions that were last committed. Amounts are stored as decimal text,
so nothing is rounded on the way through. Several accounts (desks) may share one file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Protocol

from trading_agent.trading.exchange import Fill, Order

__all__ = ["BalanceChange", "LedgerChanges", "LedgerSnapshot", "PaperBooks", "PaperOrder"]

@dataclass(frozen=True, slots=True)
class PaperOrder:
    """An order with what it holds back from the balances while it rests.

    Attributes:
        order: The order.
        reserved: The amount moved from free to used for it.
        reserved_currency: The currency of ``reserved``.
    """

    order: Order
    reserved: Decimal
    reserved_currency: str


@dataclass(frozen=True, slots=True)
class BalanceChange:
    """One movement of one currency, as the audit trail keeps it.

    Attributes:
        currency: The currency.
        free_delta: The change of the free amount.
        used_delta: The change of the amount held by orders.
        reason: Why (``fill``, ``fee``, ``reserve``, ``release``, ``deposit``).
        order_id: The order that caused it, if any.
    """

    currency: str
    free_delta: Decimal
    used_delta: Decimal
    reason: str
    order_id: str | None = None


@dataclass
class LedgerChanges:
    """Everything one paper-exchange operation changes, committed together.

    Attributes:
        at: When, on the exchange clock.
        orders: Orders to insert or update.
        fills: Fills to append.
        balance_changes: Movements to append.
        balances: New ``(free, used)`` of each currency touched.
        positions: New ``(amount, cost)`` of each symbol touched (cost None when unknown).
    """

    at: datetime
    orders: list[PaperOrder] = field(default_factory=list)
    fills: list[Fill] = field(default_factory=list)
    balance_changes: list[BalanceChange] = field(default_factory=list)
    balances: dict[str, tuple[Decimal, Decimal]] = field(default_factory=dict)
    positions: dict[str, tuple[Decimal, Decimal | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class LedgerSnapshot:
    """An account as last committed.

    Attributes:
        exists: Whether the account was ever opened.
        balances: ``(free, used)`` by currency.
        positions: ``(amount, cost)`` by symbol.
        open_orders: Resting orders, oldest first.
        order_count: How many orders the account has placed (the next order id's number).
    """

    exists: bool
    balances: dict[str, tuple[Decimal, Decimal]]
    positions: dict[str, tuple[Decimal, Decimal | None]]
    open_orders: list[PaperOrder]
    order_count: int


class PaperBooks(Protocol):
    """One paper account's books, kept by the store
    (``store.paper_books.SqlitePaperBooks``): every change committed whole, reopened as it
    was last committed.

    Attributes:
        account: The account's name (the desk's).
    """

    account: str

    async def load(self) -> LedgerSnapshot:
        """The account as last committed."""
        ...

    async def create_account(self, changes: LedgerChanges) -> None:
        """Marks the account opened and commits its starting balances and positions."""
        ...

    async def commit(self, changes: LedgerChanges, *,
                     new_client_order_id: str | None = None) -> bool:
        """Writes ``changes`` in one transaction.

        Args:
            changes: What to write.
            new_client_order_id: The client order id of the new order among ``changes``,
                if any: when the account already has an order with that id, nothing is
                written and the result is False.

        Returns:
            True once written.

        Raises:
            StoreError: SQLite failed; nothing was written.
        """
        ...

    async def find_order(self, *, order_id: str | None = None,
                         client_order_id: str | None = None) -> PaperOrder | None:
        """An order of this account by its id or its client order id, or None."""
        ...

    async def fills(self, order_id: str | None = None) -> list[Fill]:
        """The account's fills (of one order if given), oldest first."""
        ...

    async def close(self) -> None:
        """Closes the file."""
        ...
