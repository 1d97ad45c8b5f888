"""The audit of operator actions in the store (the ``operator_audit`` table), a component of
its own: appended to, never rewritten. The operator API reads and writes it through its
``AuditLog`` (the application layer adapts one to the other: the store imports no operator
code)."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration
from trading_agent.store.targets import StoreTarget

__all__ = ["COMPONENT", "MIGRATIONS", "AuditRow", "SqliteOperatorAudit"]

COMPONENT = "operator_audit"
"""Its schema's name in ``schema_migrations``."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
    """CREATE TABLE operator_audit (
    id INTEGER PRIMARY KEY,
    at TEXT NOT NULL,
    who TEXT NOT NULL,
    role TEXT NOT NULL,
    action TEXT NOT NULL,
    desk TEXT NOT NULL,
    surface TEXT NOT NULL,
    outcome TEXT NOT NULL,
    detail TEXT NOT NULL
)""",
    "CREATE INDEX operator_audit_by_desk ON operator_audit (desk, at)",
    "CREATE INDEX operator_audit_by_time ON operator_audit (at)",
)),)
"""Numbered migrations: a released one is never edited."""

_COLUMNS = "at, who, role, action, desk, surface, outcome, detail"


class AuditRow(NamedTuple):
    """One operator action as the table keeps it (see ``operator.audit.AuditEntry``)."""

    at: datetime
    who: str
    role: str
    action: str
    desk: str
    surface: str
    outcome: str
    detail: str


class SqliteOperatorAudit:
    """The audit in the store (SQLite or PostgreSQL). Use :meth:`open`.

    Args:
        database: The open store, this component's schema applied.
    """

    def __init__(self, database: Database) -> None:
        self._database = database

    @classmethod
    async def open(cls, target: StoreTarget) -> SqliteOperatorAudit:
        """Opens (or creates) the state file, or the PostgreSQL store.

        Raises:
            StoreError: The store cannot be opened.
        """
        return cls(await Database.open(target, MIGRATIONS, COMPONENT))

    async def record(self, row: AuditRow) -> None:
        """Keeps one action."""
        values = (row.at.isoformat(), *row[1:])
        await self._database.write(lambda connection: connection.execute(
            f"INSERT INTO operator_audit ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            values))

    async def rows(self, *, desk: str | None = None, since: datetime | None = None,
                   limit: int = 200) -> list[AuditRow]:
        """The newest entries (at most ``limit``), oldest first."""
        where: list[str] = []
        parameters: list[object] = []
        if desk is not None:
            where.append("desk = ?")
            parameters.append(desk)
        if since is not None:
            where.append("at >= ?")
            parameters.append(since.isoformat())
        clause = f"WHERE {' AND '.join(where)} " if where else ""
        parameters.append(limit)

        def read(connection: Connection) -> list[AuditRow]:
            found = connection.execute(
                f"SELECT {_COLUMNS} FROM operator_audit {clause}ORDER BY id DESC LIMIT ?",
                tuple(parameters)).fetchall()
            return [AuditRow(datetime.fromisoformat(row[0]), *row[1:])
                    for row in reversed(found)]

        return await self._database.read(read)

    async def close(self) -> None:
        """Lets go of the store."""
        await self._database.close()

