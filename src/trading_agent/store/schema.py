"""The store's tables, as numbered migrations (a released migration is never edited).

Each table family keeps its own tables' statements beside its queries (``MIGRATIONS`` in
:mod:`~trading_agent.store.transcripts`, :mod:`~trading_agent.store.images`,
:mod:`~trading_agent.store.held_calls`, :mod:`~trading_agent.store.operator_inbox`,
:mod:`~trading_agent.store.event_log`, :mod:`~trading_agent.store.daily_usage`,
:mod:`~trading_agent.store.schedule_state`, :mod:`~trading_agent.store.desk_holds`,
:mod:`~trading_agent.store.spend_resumes`, :mod:`~trading_agent.store.equity_samples`);
this module joins them, version by version, into the one ``store`` component every
database made since version 1 records in ``schema_migrations``. The families' tables were
created together (version 1 made six families' tables at once), so they stay one component:
a state file made before the split opens unchanged, and a family that changes its tables
adds its statements to its own ``MIGRATIONS`` under the next version of ``store``.

The trading layer's parts (paper books, journals, notes, the kill switch) are components of
their own in the same database, with their own migrations; the names here never clash with
theirs. Written for SQLite; PostgreSQL runs them through
:func:`~trading_agent.store.postgres_engine.postgres_schema`.
"""

from __future__ import annotations

from collections.abc import Sequence

import trading_agent.store.daily_usage as daily_usage
import trading_agent.store.desk_holds as desk_holds
import trading_agent.store.equity_samples as equity_samples
import trading_agent.store.event_log as event_log
import trading_agent.store.held_calls as held_calls
import trading_agent.store.images as images
import trading_agent.store.operator_inbox as operator_inbox
import trading_agent.store.schedule_state as schedule_state
import trading_agent.store.spend_resumes as spend_resumes
import trading_agent.store.transcripts as transcripts
from trading_agent.store.database import Migration

__all__ = ["COMPONENT", "FAMILIES", "MIGRATIONS", "TABLES", "joined"]

COMPONENT = "store"
"""This schema's name in ``schema_migrations``."""

FAMILIES: tuple[tuple[tuple[str, ...], Sequence[Migration]], ...] = tuple(
    (family.TABLES, family.MIGRATIONS) for family in (
        transcripts, images, event_log, operator_inbox, schedule_state, daily_usage,
        desk_holds, spend_resumes, equity_samples, held_calls))
"""Each family's tables and its part of the migrations."""

TABLES: tuple[str, ...] = tuple(table for tables, _ in FAMILIES for table in tables)
"""Every table of the component, each owned by one family."""


def joined(parts: Sequence[Sequence[Migration]]) -> tuple[Migration, ...]:
    """The families' migrations as one component's: each version's statements in the
    families' order, the versions in order.

    Args:
        parts: Each family's migrations.

    Returns:
        One migration per version any family has.
    """
    versions: dict[int, list[str]] = {}
    for migrations in parts:
        for version, statements in migrations:
            versions.setdefault(version, []).extend(statements)
    return tuple((version, tuple(versions[version])) for version in sorted(versions))


MIGRATIONS: tuple[Migration, ...] = joined([migrations for _, migrations in FAMILIES])
"""The store component's migrations, versions 1 to 6."""
