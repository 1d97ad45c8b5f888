"""What the risk policy must remember across restarts: recent orders, each day's start, halts.

A restart must not reset the hourly order count or lift a daily-loss halt, so the policy
writes them here and reads them back on open; the store keeps them (:class:`RiskRecords`,
``store.risk_records.SqliteRiskRecords``).
:meth:`RiskJournal.in_memory` keeps them only in memory (tests, throwaway runs).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Protocol

__all__ = ["DayState", "RiskJournal", "RiskRecords"]

_HOUR = timedelta(hours=1)


@dataclass(frozen=True)
class DayState:
    """One UTC day of one desk.

    Attributes:
        day: The UTC date.
        start_equity: The desk's equity when the day was first seen (or when its basis
            last changed).
        halted: Why new orders are halted for the rest of the day, or None.
        basis: What ``start_equity`` measured (see
            :attr:`~trading_agent.trading.valuation.Valuation.basis`): ``account``, the
            account's value (every day kept before desks kept books is one), or ``books``,
            the desk's own equity by its books. A day is only ever compared with an equity
            of its own basis.
    """

    day: date
    start_equity: Decimal
    halted: str | None = None
    basis: str = "account"


class RiskRecords(Protocol):
    """Where a desk's risk memory is kept across restarts."""

    async def load(self, desk: str, since: datetime,
                   from_day: date) -> tuple[list[datetime], dict[date, DayState]]:
        """The desk's orders placed after ``since`` (oldest first), and its days from
        ``from_day`` on."""
        ...

    async def add_order(self, desk: str, client_order_id: str, at: datetime) -> None:
        """Keeps an order placed (or that may have been)."""
        ...

    async def put_day(self, desk: str, state: DayState) -> None:
        """Keeps a day's start and halt."""
        ...

    async def close(self) -> None:
        """Lets go of the file."""
        ...


class RiskJournal:
    """A desk's risk memory. Use :meth:`restore` or :meth:`in_memory`.

    Args:
        desk: The desk's name.
        records: Where it is kept, or None to keep everything in memory.
        orders: Times of the orders placed in the last hour, oldest first.
        days: Known days.
    """

    def __init__(self, desk: str, records: RiskRecords | None = None,
                 orders: list[datetime] | None = None,
                 days: dict[date, DayState] | None = None) -> None:
        self.desk = desk
        self._records = records
        self._orders: deque[datetime] = deque(orders or ())
        self._days: dict[date, DayState] = dict(days or {})

    @classmethod
    def in_memory(cls, desk: str = "default") -> RiskJournal:
        """A journal that forgets everything when the process ends."""
        return cls(desk)

    @classmethod
    async def restore(cls, records: RiskRecords, desk: str, now: datetime) -> RiskJournal:
        """The desk's journal as kept in ``records`` (the last hour's orders and the recent
        days), which it keeps from then on (and closes).

        Args:
            records: Where it is kept.
            desk: The desk's name.
            now: The exchange clock's current time.

        Raises:
            StoreError: They cannot be read.
        """
        try:
            orders, days = await records.load(desk, now - _HOUR,
                                              now.date() - timedelta(days=1))
        except BaseException:
            await records.close()
            raise
        return cls(desk, records, orders, days)

    def orders_in_hour_before(self, now: datetime) -> list[datetime]:
        """Times of the orders placed in the hour up to ``now``, oldest first."""
        while self._orders and self._orders[0] <= now - _HOUR:
            self._orders.popleft()
        return list(self._orders)

    async def record_order(self, client_order_id: str, at: datetime) -> None:
        """Remembers that an order was placed (or may have been) at ``at``."""
        if self._records is not None:
            await self._records.add_order(self.desk, client_order_id, at)
        self._orders.append(at)

    def day(self, day: date) -> DayState | None:
        """What is known of ``day``, or None if it has not been seen."""
        return self._days.get(day)

    async def start_day(self, day: date, equity: Decimal, basis: str = "account") -> DayState:
        """Records the equity the day starts from (only the first call of a day counts)."""
        known = self._days.get(day)
        if known is not None:
            return known
        state = DayState(day, equity, basis=basis)
        await self._write_day(state)
        self._days = {d: s for d, s in self._days.items() if d >= day - timedelta(days=1)}
        self._days[day] = state
        return state

    async def rebase_day(self, day: date, equity: Decimal, basis: str) -> DayState:
        """Starts ``day`` (which must have been started) again from ``equity`` on another
        basis: a day started on the account's value (before an upgrade) is never compared
        with the desk's own equity, which would read the difference as a loss or a gain. A
        halt of the day stands."""
        state = DayState(day, equity, self._days[day].halted, basis)
        await self._write_day(state)
        self._days[day] = state
        return state

    async def halt(self, day: date, reason: str) -> DayState:
        """Halts new orders for the rest of ``day`` (which must have been started)."""
        known = self._days[day]
        state = DayState(day, known.start_equity, reason, known.basis)
        await self._write_day(state)
        self._days[day] = state
        return state

    async def _write_day(self, state: DayState) -> None:
        if self._records is not None:
            await self._records.put_day(self.desk, state)

    async def close(self) -> None:
        """Lets go of where it is kept, if anywhere."""
        if self._records is not None:
            await self._records.close()
