"""The desks' standing instructions, in the store
(:class:`~trading_agent.daemon.pins.PinRecords`): they survive a restart and a reload."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration
from trading_agent.store.targets import StoreTarget

__all__ = ["COMPONENT", "MIGRATIONS", "Pin", "SqlitePins"]

COMPONENT = "pinned_instructions"
"""Its schema's name in ``schema_migrations``."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
    """CREATE TABLE pinned_instructions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    desk TEXT NOT NULL,
    text TEXT NOT NULL,
    by TEXT NOT NULL,
    at TEXT NOT NULL
)""",
    "CREATE INDEX pinned_instructions_desk ON pinned_instructions (desk, id)",
)),)
"""Numbered migrations: a released one is never edited."""


@dataclass(frozen=True)
class Pin:
    """One standing instruction.

    Attributes:
        id: Its number, unique in the store.
        desk: The desk it is pinned to.
        text: The instruction, sent verbatim.
        by: Who pinned it.
        at: When (aware, UTC).
    """

    id: int
    desk: str
    text: str
    by: str
    at: datetime

    def to_dict(self) -> dict[str, Any]:
        """As the API and the CLI show it."""
        return {"id": self.id, "desk": self.desk, "text": self.text, "by": self.by,
                "at": self.at.isoformat()}


class SqlitePins:
    """The pins in the store (SQLite or PostgreSQL). Use :meth:`open`.

    Args:
        database: The open store, its schema applied.
    """

    def __init__(self, database: Database) -> None:
        self._database = database

    @classmethod
    async def open(cls, target: StoreTarget) -> SqlitePins:
        """Opens (or creates) the state file, or the PostgreSQL store.

        Raises:
            StoreError: The store cannot be opened.
        """
        return cls(await Database.open(target, MIGRATIONS, COMPONENT))

    async def load(self) -> list[Pin]:
        """Every desk's pins, oldest first."""

        def read(connection: Connection) -> list[Pin]:
            return [Pin(int(pin_id), desk, text, by, datetime.fromisoformat(at))
                    for pin_id, desk, text, by, at in connection.execute(
                        "SELECT id, desk, text, by, at FROM pinned_instructions ORDER BY id")]

        return await self._database.read(read)

    async def add(self, desk: str, text: str, by: str, at: datetime) -> Pin:
        """Keeps a new pin; returns it with its id."""

        def insert(connection: Connection) -> int:
            row = connection.execute(
                "INSERT INTO pinned_instructions (desk, text, by, at) VALUES (?, ?, ?, ?) "
                "RETURNING id", (desk, text, by, at.isoformat())).fetchone()
            return int(row[0])

        return Pin(await self._database.write(insert), desk, text, by, at)

    async def remove(self, desk: str, pin_id: int) -> bool:
        """Forgets a pin of the desk; False when it had none of that id."""

        def delete(connection: Connection) -> bool:
            return connection.execute(
                "DELETE FROM pinned_instructions WHERE desk = ? AND id = ? RETURNING id",
                (desk, pin_id)).fetchone() is not None

        return await self._database.write(delete)

    async def close(self) -> None:
        """Lets go of the store."""
        await self._database.close()
