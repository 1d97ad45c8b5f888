"""The operator API's audit (:class:`~trading_agent.operator.audit.AuditLog`) kept in the
store's ``operator_audit`` table: the operator package and the store do not know each
other, so the application layer joins them."""

from __future__ import annotations

from datetime import datetime

from trading_agent.operator.audit import AuditEntry, Outcome
from trading_agent.store.operator_audit import AuditRow, SqliteOperatorAudit

__all__ = ["StoredAudit"]


class StoredAudit:
    """An :class:`~trading_agent.operator.audit.AuditLog` on the store.

    Args:
        table: The store's audit table.
    """

    def __init__(self, table: SqliteOperatorAudit) -> None:
        self._table = table

    async def record_action(self, entry: AuditEntry) -> None:
        """Keeps one entry."""
        await self._table.record(AuditRow(entry.at, entry.who, entry.role, entry.action,
                                          entry.desk, entry.surface, entry.outcome,
                                          entry.detail))

    async def actions(self, *, desk: str | None = None, since: datetime | None = None,
                      limit: int = 200) -> list[AuditEntry]:
        """The newest entries (at most ``limit``), oldest first."""
        return [AuditEntry(row.at, row.who, row.role, row.action, row.desk, row.surface,
                           _outcome(row.outcome), row.detail)
                for row in await self._table.rows(desk=desk, since=since, limit=limit)]


def _outcome(text: str) -> Outcome:
    return "ok" if text == "ok" else "refused" if text == "refused" else "error"
