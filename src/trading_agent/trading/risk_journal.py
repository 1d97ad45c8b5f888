"""What the risk policy must remember across restarts: recent orders, each day's start, halts.

A restart must not reset the hourly order count or lift a daily-loss halt, so the policy
writes them here (appends and single-row updates in SQLite) and reads them back on open.
:meth:`RiskJournal.in_memory` keeps them only in memory (tests, throwaway runs).
"""

from __future__ import annotations

import sqlite3
from collections import deque
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from decimal import Decimal
from pathlib import Path

from trading_agent.store.database import Database, Migration

__all__ = ["DayState", "RiskJournal"]

COMPONENT = "risk_journal"
"""Its schema's name in ``schema_migrations``."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
    """CREATE TABLE IF NOT EXISTS risk_orders (
    seq INTEGER PRIMARY KEY,
    desk TEXT NOT NULL,
    client_order_id TEXT NOT NULL,
    at TEXT NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS risk_orders_at ON risk_orders (desk, at)",
    """CREATE TABLE IF NOT EXISTS risk_days (
    desk TEXT NOT NULL,
    day TEXT NOT NULL,
    start_equity TEXT NOT NULL,
    halted TEXT,
    PRIMARY KEY (desk, day)
)""",
)),)
"""Numbered migrations: a released one is never edited. The first is written with
``IF NOT EXISTS``: a file made before migrations were numbered already has them."""

_HOUR = timedelta(hours=1)


@dataclass(frozen=True)
class DayState:
    """One UTC day of one desk.

    Attributes:
        day: The UTC date.
        start_equity: The account's value when the day was first seen.
        halted: Why new orders are halted for the rest of the day, or None.
    """

    day: date
    start_equity: Decimal
    halted: str | None = None


class RiskJournal:
    """A desk's risk memory. Use :meth:`open` or :meth:`in_memory`.

    Args:
        desk: The desk's name.
        database: Where to persist, or None to keep everything in memory.
        orders: Times of the orders placed in the last hour, oldest first.
        days: Known days.
    """

    def __init__(self, desk: str, database: Database | None = None,
                 orders: list[datetime] | None = None,
                 days: dict[date, DayState] | None = None) -> None:
        self.desk = desk
        self._database = database
        self._orders: deque[datetime] = deque(orders or ())
        self._days: dict[date, DayState] = dict(days or {})

    @classmethod
    def in_memory(cls, desk: str = "default") -> RiskJournal:
        """A journal that forgets everything when the process ends."""
        return cls(desk)

    @classmethod
    async def open(cls, path: Path | str, desk: str, now: datetime) -> RiskJournal:
        """Opens the journal file and reads the last hour's orders and the recent days.

        Args:
            path: The SQLite file.
            desk: The desk's name.
            now: The exchange clock's current time.

        Raises:
            StoreError: The file cannot be opened.
        """
        database = await Database.open(path, MIGRATIONS, COMPONENT)
        since = (now - _HOUR).isoformat()
        recent_day = (now.date() - timedelta(days=1)).isoformat()

        def read(connection: sqlite3.Connection) -> tuple[list[datetime], dict[date, DayState]]:
            orders = [datetime.fromisoformat(at) for (at,) in connection.execute(
                "SELECT at FROM risk_orders WHERE desk = ? AND at > ? ORDER BY at",
                (desk, since))]
            days = {
                date.fromisoformat(day): DayState(date.fromisoformat(day), Decimal(equity),
                                                  halted)
                for day, equity, halted in connection.execute(
                    "SELECT day, start_equity, halted FROM risk_days "
                    "WHERE desk = ? AND day >= ?", (desk, recent_day))
            }
            return orders, days

        try:
            orders, days = await database.read(read)
        except BaseException:
            await database.close()
            raise
        return cls(desk, database, orders, days)

    def orders_in_hour_before(self, now: datetime) -> list[datetime]:
        """Times of the orders placed in the hour up to ``now``, oldest first."""
        while self._orders and self._orders[0] <= now - _HOUR:
            self._orders.popleft()
        return list(self._orders)

    async def record_order(self, client_order_id: str, at: datetime) -> None:
        """Remembers that an order was placed (or may have been) at ``at``."""
        if self._database is not None:
            desk = self.desk

            def write(connection: sqlite3.Connection) -> None:
                connection.execute("INSERT INTO risk_orders (desk, client_order_id, at) "
                                   "VALUES (?, ?, ?)", (desk, client_order_id,
                                                        at.isoformat()))

            await self._database.write(write)
        self._orders.append(at)

    def day(self, day: date) -> DayState | None:
        """What is known of ``day``, or None if it has not been seen."""
        return self._days.get(day)

    async def start_day(self, day: date, equity: Decimal) -> DayState:
        """Records the equity the day starts from (only the first call of a day counts)."""
        known = self._days.get(day)
        if known is not None:
            return known
        state = DayState(day, equity)
        await self._write_day(state)
        self._days = {d: s for d, s in self._days.items() if d >= day - timedelta(days=1)}
        self._days[day] = state
        return state

    async def halt(self, day: date, reason: str) -> DayState:
        """Halts new orders for the rest of ``day`` (which must have been started)."""
        state = DayState(day, self._days[day].start_equity, reason)
        await self._write_day(state)
        self._days[day] = state
        return state

    async def _write_day(self, state: DayState) -> None:
        if self._database is None:
            return
        row = (self.desk, state.day.isoformat(), str(state.start_equity), state.halted)

        def write(connection: sqlite3.Connection) -> None:
            connection.execute(
                "INSERT INTO risk_days (desk, day, start_equity, halted) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (desk, day) DO UPDATE SET halted = excluded.halted", row)

        await self._database.write(write)

    async def close(self) -> None:
        """Closes the file, if any."""
        if self._database is not None:
            await self._database.close()
