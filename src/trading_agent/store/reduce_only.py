"""The desks in reduce-only, in the store
(:class:`~trading_agent.trading.reduce_only.ReduceOnlyRecords`): it survives a restart."""

from __future__ import annotations

from datetime import datetime

from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration
from trading_agent.store.targets import StoreTarget
from trading_agent.trading.reduce_only import ReduceOnly

__all__ = ["COMPONENT", "MIGRATIONS", "SqliteReduceOnly"]

COMPONENT = "reduce_only"
"""Its schema's name in ``schema_migrations``."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
    """CREATE TABLE reduce_only (
    desk TEXT PRIMARY KEY,
    by TEXT NOT NULL,
    reason TEXT NOT NULL,
    at TEXT NOT NULL,
    until TEXT,
    protection TEXT
)""",
)),)
"""Numbered migrations: a released one is never edited."""


class SqliteReduceOnly:
    """The reduce-only states in the store. Use :meth:`open`.

    Args:
        database: The open store, its schema applied.
    """

    def __init__(self, database: Database) -> None:
        self._database = database

    @classmethod
    async def open(cls, target: StoreTarget) -> SqliteReduceOnly:
        """Opens (or creates) the state file, or the PostgreSQL store.

        Raises:
            StoreError: The store cannot be opened.
        """
        return cls(await Database.open(target, MIGRATIONS, COMPONENT))

    async def load(self) -> dict[str, ReduceOnly]:
        """The desks in reduce-only, by desk."""

        def read(connection: Connection) -> dict[str, ReduceOnly]:
            return {desk: ReduceOnly(desk, by, reason, datetime.fromisoformat(at),
                                     None if until is None else datetime.fromisoformat(until),
                                     protection)
                    for desk, by, reason, at, until, protection in connection.execute(
                        "SELECT desk, by, reason, at, until, protection FROM reduce_only")}

        return await self._database.read(read)

    async def put(self, state: ReduceOnly) -> None:
        """Keeps a desk's reduce-only."""
        row = (state.desk, state.by, state.reason, state.at.isoformat(),
               None if state.until is None else state.until.isoformat(), state.protection)
        await self._database.write(lambda connection: connection.execute(
            "INSERT INTO reduce_only (desk, by, reason, at, until, protection) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (desk) DO UPDATE SET by = excluded.by, "
            "reason = excluded.reason, at = excluded.at, until = excluded.until, "
            "protection = excluded.protection", row))

    async def delete(self, desk: str) -> None:
        """Forgets a desk's reduce-only."""
        await self._database.write(lambda connection: connection.execute(
            "DELETE FROM reduce_only WHERE desk = ?", (desk,)))

    async def close(self) -> None:
        """Lets go of the store."""
        await self._database.close()
