"""The risk policy's memory in the store
(:class:`~trading_agent.trading.risk_journal.RiskRecords`): recent orders and each day's
start and halt, so a restart neither resets the hourly count nor lifts a daily-loss halt."""

from __future__ import annotations

from datetime import date, datetime
from decimal import Decimal

from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration
from trading_agent.store.fencing import Fence
from trading_agent.store.targets import StoreTarget
from trading_agent.trading.risk_journal import DayState

__all__ = ["COMPONENT", "MIGRATIONS", "SqliteRiskRecords"]

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
)), (2, (
    # What a day's start equity measured: every day kept so far was the account's value;
    # a live desk's days are now its own equity by its books (``books``), and a day of the
    # other basis is started again rather than compared (a false loss on the upgrade day).
    "ALTER TABLE risk_days ADD COLUMN basis TEXT NOT NULL DEFAULT 'account'",
)),)
"""Numbered migrations: a released one is never edited. The first is written with
``IF NOT EXISTS``: a file made before migrations were numbered already has them."""


class SqliteRiskRecords:
    """Every desk's risk memory in the store. Use :meth:`open`.

    Args:
        database: The open store, its schema applied (and its fence: each record is fenced
            on the desk it names).
    """

    def __init__(self, database: Database) -> None:
        self._database = database

    @classmethod
    async def open(cls, target: StoreTarget, *, fence: Fence | None = None) -> SqliteRiskRecords:
        """Opens (or creates) the records in the state file, or the PostgreSQL store.

        Args:
            target: The store.
            fence: Checks before each record is written that this daemon still holds the
                desk the record names.

        Raises:
            StoreError: The store cannot be opened.
        """
        return cls(await Database.open(target, MIGRATIONS, COMPONENT, fence=fence))

    async def load(self, desk: str, since: datetime,
                   from_day: date) -> tuple[list[datetime], dict[date, DayState]]:
        """The desk's orders placed after ``since`` and its days from ``from_day`` on."""

        def read(connection: Connection) -> tuple[list[datetime], dict[date, DayState]]:
            orders = [datetime.fromisoformat(at) for (at,) in connection.execute(
                "SELECT at FROM risk_orders WHERE desk = ? AND at > ? ORDER BY at",
                (desk, since.isoformat()))]
            days = {
                date.fromisoformat(day): DayState(date.fromisoformat(day), Decimal(equity),
                                                  halted, basis)
                for day, equity, halted, basis in connection.execute(
                    "SELECT day, start_equity, halted, basis FROM risk_days "
                    "WHERE desk = ? AND day >= ?", (desk, from_day.isoformat()))
            }
            return orders, days

        return await self._database.read(read)

    async def add_order(self, desk: str, client_order_id: str, at: datetime) -> None:
        """Keeps an order placed (or that may have been)."""

        def write(connection: Connection) -> None:
            connection.execute("INSERT INTO risk_orders (desk, client_order_id, at) "
                               "VALUES (?, ?, ?)", (desk, client_order_id, at.isoformat()))

        await self._database.write(write, desk=desk)

    async def put_day(self, desk: str, state: DayState) -> None:
        """Keeps a day's start equity, its basis and its halt. The start equity stays the
        first one seen for its basis; only a day started again on another basis replaces it
        (:meth:`~trading_agent.trading.risk_journal.RiskJournal.rebase_day`)."""
        row = (desk, state.day.isoformat(), str(state.start_equity), state.halted, state.basis)

        def write(connection: Connection) -> None:
            connection.execute(
                "INSERT INTO risk_days (desk, day, start_equity, halted, basis) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (desk, day) DO UPDATE SET "
                "start_equity = CASE WHEN risk_days.basis = excluded.basis "
                "THEN risk_days.start_equity ELSE excluded.start_equity END, "
                "halted = excluded.halted, basis = excluded.basis", row)

        await self._database.write(write, desk=desk)

    async def close(self) -> None:
        """Lets go of the store."""
        await self._database.close()
