"""The audit of operator actions in the store, on SQLite and PostgreSQL: appended, filtered by
desk and time, newest kept when limited, and still there once opened again."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from trading_agent.store import StoreTarget
from trading_agent.store.operator_audit import AuditRow, SqliteOperatorAudit


async def test_actions_are_kept_and_filtered(target: StoreTarget) -> None:
    start = datetime(2026, 12, 5, 9, 0, tzinfo=UTC)
    audit = await SqliteOperatorAudit.open(target)
    try:
        for minute, (who, action, desk, outcome) in enumerate([
                ("vera", "approve", "alpha", "refused"), ("tina", "pause", "alpha", "ok"),
                ("olga", "kill-switch", "*", "ok"), ("tina", "send", "beta", "error")]):
            await audit.record(AuditRow(
                start + timedelta(minutes=minute), who, "trader", action, desk, "web/tcp",
                outcome, "" if outcome == "ok" else "403 forbidden_role"))
    finally:
        await audit.close()
    audit = await SqliteOperatorAudit.open(target)
    try:
        alpha = await audit.rows(desk="alpha")
        assert [(e.who, e.action, e.outcome) for e in alpha] == [
            ("vera", "approve", "refused"), ("tina", "pause", "ok")]
        assert alpha[0].at == start and alpha[0].detail == "403 forbidden_role"
        later = await audit.rows(since=start + timedelta(minutes=2))
        assert [e.action for e in later] == ["kill-switch", "send"]
        assert [e.action for e in await audit.rows(limit=2)] == ["kill-switch", "send"]
    finally:
        await audit.close()
