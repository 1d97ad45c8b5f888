"""The kill switches that are on, in the store
(:class:`~trading_agent.trading.kill_switch.HaltRecords`): a halt survives a restart."""

from __future__ import annotations

from datetime import datetime

from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration
from trading_agent.store.targets import StoreTarget
from trading_agent.trading.kill_switch import Halt

__all__ = ["COMPONENT", "MIGRATIONS", "SqliteHalts"]

COMPONENT = "kill_switch"
"""Its schema's name in ``schema_migrations``."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
    """CREATE TABLE IF NOT EXISTS kill_switch (
    scope TEXT PRIMARY KEY,
    by TEXT NOT NULL,
    at TEXT NOT NULL,
    reason TEXT NOT NULL
)""",
)),)
"""Numbered migrations: a released one is never edited. The first is written with
``IF NOT EXISTS``: a file made before migrations were numbered already has them."""


class SqliteHalts:
    """The switches in the store. Use :meth:`open`.

    Args:
        database: The open store, its schema applied.
    """

    def __init__(self, database: Database) -> None:
        self._database = database

    @classmethod
    async def open(cls, target: StoreTarget) -> SqliteHalts:
        """Opens (or creates) the state file, or the PostgreSQL store.

        Raises:
            StoreError: The store cannot be opened.
        """
        return cls(await Database.open(target, MIGRATIONS, COMPONENT))

    async def load(self) -> dict[str, Halt]:
        """The switches that are on, by scope."""

        def read(connection: Connection) -> dict[str, Halt]:
            return {scope: Halt(scope, by, datetime.fromisoformat(at), reason)
                    for scope, by, at, reason in connection.execute(
                        "SELECT scope, by, at, reason FROM kill_switch")}

        return await self._database.read(read)

    async def put(self, halt: Halt) -> None:
        """Keeps a switch that went on."""
        row = (halt.scope, halt.by, halt.at.isoformat(), halt.reason)
        await self._database.write(lambda connection: connection.execute(
            "INSERT INTO kill_switch (scope, by, at, reason) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (scope) DO UPDATE SET by = excluded.by, at = excluded.at, "
            "reason = excluded.reason", row))

    async def delete(self, scope: str) -> None:
        """Forgets a switch that went off."""
        await self._database.write(lambda connection: connection.execute(
            "DELETE FROM kill_switch WHERE scope = ?", (scope,)))

    async def close(self) -> None:
        """Lets go of the store."""
        await self._database.close()
