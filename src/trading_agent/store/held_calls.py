"""Calls held for an operator's approval, and how each approval ended (the ``held_calls``
table): stored before the call went on or was refused, so that recovery
(:mod:`~trading_agent.store.recovery`) knows a call cut off while it waited never ran, and a
fleet's daemon knows which desk an approval id belongs to."""

from __future__ import annotations

import time
from collections.abc import Callable

from trading_agent.store.database import Database, Migration

__all__ = ["MIGRATIONS", "TABLES", "SqliteHeldCalls"]

TABLES = ("held_calls",)
"""The tables this module owns."""

MIGRATIONS: tuple[Migration, ...] = ((6, (
    # Calls held for an operator's approval, and how that ended (NULL while waiting):
    # stored before the call went on or was refused.
    """CREATE TABLE held_calls (
            desk TEXT NOT NULL,
            turn TEXT NOT NULL,
            call_id TEXT NOT NULL,
            approval_id TEXT NOT NULL,
            outcome TEXT,
            at REAL NOT NULL,
            PRIMARY KEY (desk, approval_id))""",
    "CREATE INDEX held_calls_by_turn ON held_calls (desk, turn)",
)),)
"""Its part of the store's numbered migrations (see :mod:`~trading_agent.store.schema`)."""


class SqliteHeldCalls:
    """The held calls in the store.

    Args:
        database: The open store, its schema applied.
        clock: Seconds since the epoch.
    """

    def __init__(self, database: Database, *, clock: Callable[[], float] = time.time) -> None:
        self._db = database
        self._clock = clock

    async def record_approval(self, desk: str, turn: str, call_id: str, approval_id: str,
                              outcome: str | None) -> None:
        """Records a call held for an operator's approval (``outcome`` None while it waits),
        then how its approval ended; stored before the call goes on or is refused."""
        at = self._clock()
        await self._db.write(lambda connection: connection.execute(
            "INSERT INTO held_calls (desk, turn, call_id, approval_id, outcome, at) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (desk, approval_id) DO UPDATE SET "
            "outcome = excluded.outcome, at = excluded.at",
            (desk, turn, call_id, approval_id, outcome, at)), desk=desk)

    async def held_calls(self, desk: str, turn: str) -> dict[str, str]:
        """The turn's calls held for an operator's approval: ``pending`` while they waited,
        else the outcome (the latest approval of a call wins)."""
        rows = await self._db.read(lambda connection: connection.execute(
            "SELECT call_id, outcome FROM held_calls WHERE desk = ? AND turn = ? "
            "ORDER BY rowid", (desk, turn)).fetchall())
        return {str(call_id): str(outcome or "pending") for call_id, outcome in rows}

    async def approval_desk(self, approval_id: str) -> str | None:
        """The desk whose call was held under an approval id, or None when none was (a
        fleet's operator may answer an approval on any daemon: this says which desk, and so
        which daemon, holds it)."""
        row = await self._db.read(lambda connection: connection.execute(
            "SELECT desk FROM held_calls WHERE approval_id = ? ORDER BY at DESC LIMIT 1",
            (approval_id,)).fetchone())
        return None if row is None else str(row[0])
