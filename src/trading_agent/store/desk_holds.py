"""Paused desks (the ``desk_holds`` table): a desk an operator or a spend cap paused stays
paused across a restart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration

__all__ = ["MIGRATIONS", "TABLES", "HoldFields", "SqliteDeskHolds", "StoredHold"]

TABLES = ("desk_holds",)
"""The tables this module owns."""

MIGRATIONS: tuple[Migration, ...] = ((3, (
    # A desk an operator (or a spend cap) paused stays paused across a restart.
    """CREATE TABLE desk_holds (
            desk TEXT PRIMARY KEY,
            held_by TEXT NOT NULL,
            reason TEXT NOT NULL,
            held_at REAL NOT NULL,
            until REAL)""",
)),)
"""Its part of the store's numbered migrations (see :mod:`~trading_agent.store.schema`)."""


@dataclass(frozen=True)
class StoredHold:
    """A paused desk, as the store keeps it.

    Attributes:
        by: Who paused it.
        reason: Why.
        at: When (seconds since the epoch).
        until: When it resumes by itself, or None.
    """

    by: str
    reason: str
    at: float
    until: float | None = None


class HoldFields(Protocol):
    """What is stored of a pause (:class:`StoredHold`, or the daemon's own ``Hold``)."""

    @property
    def by(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def at(self) -> float: ...
    @property
    def until(self) -> float | None: ...


class SqliteDeskHolds:
    """The desks' pauses in the store.

    Args:
        database: The open store, its schema applied.
    """

    def __init__(self, database: Database) -> None:
        self._db = database

    async def desk_hold(self, desk: str) -> StoredHold | None:
        """Why a desk is paused, as last recorded, or None when it is not."""

        def read(connection: Connection) -> StoredHold | None:
            row = connection.execute("SELECT held_by, reason, held_at, until FROM desk_holds "
                                     "WHERE desk = ?", (desk,)).fetchone()
            return None if row is None else StoredHold(row[0], row[1], row[2], row[3])

        return await self._db.read(read)

    async def record_desk_hold(self, desk: str, hold: HoldFields | None) -> None:
        """Records that a desk is paused (``hold``) or no longer is (None); written before
        the pause is acknowledged."""

        def write(connection: Connection) -> None:
            if hold is None:
                connection.execute("DELETE FROM desk_holds WHERE desk = ?", (desk,))
            else:
                connection.execute(
                    "INSERT INTO desk_holds (desk, held_by, reason, held_at, until) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (desk) DO UPDATE SET "
                    "held_by = excluded.held_by, reason = excluded.reason, "
                    "held_at = excluded.held_at, until = excluded.until",
                    (desk, hold.by, hold.reason, hold.at, hold.until))

        await self._db.write(write, desk=desk)
