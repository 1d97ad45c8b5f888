"""The audit of operator actions: who did what, to which desk, from where, when, and how it
ended.

Every request of the operator API that may change something (see
:data:`~trading_agent.operator.route_roles.ROUTE_ROLES`) is recorded once answered, refused
ones included (a role too low, a bad body): ``ok`` (answered 2xx), ``refused`` (4xx) or
``error`` (5xx). The daemon keeps them in its store
(``store/operator_audit.py``, adapted by the application layer); without one (tests), in
memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal, Protocol

__all__ = ["AuditEntry", "AuditLog", "MemoryAudit", "Outcome"]

Outcome = Literal["ok", "refused", "error"]


@dataclass(frozen=True)
class AuditEntry:
    """One operator action.

    Attributes:
        at: When it was answered (UTC).
        who: The operator's name, as its credential says.
        role: The operator's role.
        action: What it asked (``approve``, ``kill-switch``...).
        desk: The desk it concerned; empty for the daemon as a whole.
        surface: Where it came from: ``socket`` or ``tcp`` (the listener), or what the
            client says it is (``cli``, ``web``, ``chat``) and the listener, as ``web/tcp``.
        outcome: ``ok``, ``refused`` or ``error``.
        detail: The answer's status and, when refused or failed, its error code.
    """

    at: datetime
    who: str
    role: str
    action: str
    desk: str
    surface: str
    outcome: Outcome
    detail: str = ""

    def as_json(self) -> dict[str, Any]:
        """The entry as the API shows it (``at`` in ISO 8601)."""
        data = asdict(self)
        data["at"] = self.at.isoformat()
        return data


class AuditLog(Protocol):
    """Where audit entries are kept."""

    async def record_action(self, entry: AuditEntry) -> None:
        """Keeps one entry."""
        ...

    async def actions(self, *, desk: str | None = None, since: datetime | None = None,
                      limit: int = 200) -> list[AuditEntry]:
        """The newest entries (at most ``limit``), oldest first, filtered by desk and time."""
        ...


class MemoryAudit:
    """An :class:`AuditLog` in memory (a daemon without a store: tests)."""

    def __init__(self) -> None:
        self.entries: list[AuditEntry] = []

    async def record_action(self, entry: AuditEntry) -> None:
        """Keeps one entry."""
        self.entries.append(entry)

    async def actions(self, *, desk: str | None = None, since: datetime | None = None,
                      limit: int = 200) -> list[AuditEntry]:
        """The newest entries (at most ``limit``), oldest first."""
        found = [e for e in self.entries
                 if (desk is None or e.desk == desk) and (since is None or e.at >= since)]
        return found[-limit:]
