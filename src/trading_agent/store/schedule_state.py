"""The slot each desk's schedule last fired for (the ``schedule_state`` table), so that a
restarted daemon neither fires a slot twice nor forgets one it missed (see
:mod:`trading_agent.daemon.schedules`)."""

from __future__ import annotations

from datetime import UTC, datetime

from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration

__all__ = ["MIGRATIONS", "TABLES", "SqliteScheduleState", "mark_fired"]

TABLES = ("schedule_state",)
"""The tables this module owns."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
    # The slot each schedule last fired for.
    """CREATE TABLE schedule_state (
            desk TEXT NOT NULL,
            schedule TEXT NOT NULL,
            last_fired_at REAL NOT NULL,
            PRIMARY KEY (desk, schedule))""",
)),)
"""Its part of the store's numbered migrations (see :mod:`~trading_agent.store.schema`)."""


class SqliteScheduleState:
    """The schedules' last slots in the store.

    Args:
        database: The open store, its schema applied.
    """

    def __init__(self, database: Database) -> None:
        self._db = database

    async def schedule_last_fired(self, desk: str) -> dict[str, datetime]:
        """The slot each of a desk's schedules last fired for, by schedule name (UTC)."""

        def read(connection: Connection) -> dict[str, datetime]:
            return {name: datetime.fromtimestamp(at, UTC) for name, at in connection.execute(
                "SELECT schedule, last_fired_at FROM schedule_state WHERE desk = ?", (desk,))}

        return await self._db.read(read)

    async def record_schedule_fired(self, desk: str, schedule: str, slot: datetime) -> None:
        """Remembers that a schedule fired for ``slot`` (call when the desk takes its turn).

        Args:
            desk: The desk.
            schedule: The schedule's name.
            slot: The slot it fired for (an aware datetime).
        """

        await self._db.write(lambda connection: mark_fired(connection, desk, schedule, slot),
                             desk=desk)


def mark_fired(connection: Connection, desk: str, schedule: str, slot: datetime) -> None:
    """Records, in the caller's transaction, that a schedule fired for ``slot`` (the
    transcripts store it with the trigger's message: both or neither)."""
    connection.execute(
        "INSERT INTO schedule_state (desk, schedule, last_fired_at) VALUES (?, ?, ?) "
        "ON CONFLICT (desk, schedule) DO UPDATE SET last_fired_at = excluded.last_fired_at",
        (desk, schedule, slot.timestamp()))
