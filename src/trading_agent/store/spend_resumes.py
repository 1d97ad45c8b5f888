"""The desks an operator resumed after a spend cap paused them (the ``spend_resumes``
table): no cap pauses such a desk again that UTC day, a restart included (see
:mod:`trading_agent.daemon.spend`)."""

from __future__ import annotations

from datetime import date

from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration

__all__ = ["MIGRATIONS", "TABLES", "SqliteSpendResumes"]

TABLES = ("spend_resumes",)
"""The tables this module owns."""

MIGRATIONS: tuple[Migration, ...] = ((3, (
    # An operator resumed a desk a spend cap paused: no cap pauses it again that day.
    """CREATE TABLE spend_resumes (
            desk TEXT NOT NULL,
            day TEXT NOT NULL,
            PRIMARY KEY (desk, day))""",
)),)
"""Its part of the store's numbered migrations (see :mod:`~trading_agent.store.schema`)."""


class SqliteSpendResumes:
    """The spend caps' resumes in the store.

    Args:
        database: The open store, its schema applied.
    """

    def __init__(self, database: Database) -> None:
        self._db = database

    async def record_spend_resume(self, desk: str, day: date) -> None:
        """Records that an operator resumed a desk a spend cap had paused on ``day``."""

        def write(connection: Connection) -> None:
            connection.execute("INSERT INTO spend_resumes (desk, day) VALUES (?, ?) "
                               "ON CONFLICT DO NOTHING", (desk, day.isoformat()))

        await self._db.write(write, desk=desk)

    async def spend_resumes(self, day: date) -> set[str]:
        """The desks an operator resumed from a spend cap's pause on ``day``."""

        def read(connection: Connection) -> set[str]:
            return {desk for (desk,) in connection.execute(
                "SELECT desk FROM spend_resumes WHERE day = ?", (day.isoformat(),))}

        return await self._db.read(read)
