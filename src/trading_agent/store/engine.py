"""What the store asks of a database engine, and the transactions it runs on one.

Two engines: SQLite (:mod:`~trading_agent.store.sqlite_engine`, the embedded default) and
PostgreSQL (:mod:`~trading_agent.store.postgres_engine`, for a fleet of daemons). An
:class:`Engine` opens blocking :class:`Session` s, one per connection;
:class:`~trading_agent.store.database.Database` drives them from worker threads, one call at a
time per connection. The transactions themselves are written once, here, for both: the group
commit's batch (:func:`run_batch`) and the migrations (:func:`migrate`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from trading_agent.errors import StoreError
from trading_agent.store.connection import Connection

__all__ = ["Engine", "Migration", "Outcome", "Session", "migrate", "run_batch"]

Migration = tuple[int, Sequence[str]]
"""A schema version and the statements that bring the schema to it."""

Outcome = tuple[Any, BaseException | None]
"""A write's result, or what it raised."""

_SCHEMA_MIGRATIONS = (
    "CREATE TABLE IF NOT EXISTS schema_migrations ("
    " component TEXT NOT NULL, version INTEGER NOT NULL, applied_at REAL NOT NULL,"
    " PRIMARY KEY (component, version))")


class Session(Protocol):
    """One connection of an engine, used by one call at a time (in a worker thread)."""

    @property
    def connection(self) -> Connection:
        """What the store's calls run their queries on."""
        ...

    @property
    def in_transaction(self) -> bool:
        """Whether a transaction is open (SQLite rolls one back whole on a full disk)."""
        ...

    def ready(self) -> None:
        """Makes the connection usable before a call (PostgreSQL reconnects one the server
        dropped)."""
        ...

    def begin(self) -> None:
        """Starts a write transaction (SQLite takes the file's write lock at once)."""
        ...

    def begin_migration(self) -> None:
        """Starts a transaction during which no other process migrates the database."""
        ...

    def schema(self, statement: str) -> str:
        """A migration's statement (written for SQLite) as this engine runs it."""
        ...

    def close(self) -> None:
        """Closes the connection."""
        ...


class Engine(Protocol):
    """A database to connect to."""

    @property
    def name(self) -> str:
        """How messages name it (a file, or a URL without password)."""
        ...

    @property
    def errors(self) -> tuple[type[Exception], ...]:
        """The driver's errors, which the store raises as ``StoreError``."""
        ...

    def describe(self, error: Exception) -> str:
        """A driver's error as a message naming the database (never a password)."""
        ...

    def full_location(self, error: Exception) -> str | None:
        """Where space must be freed when ``error`` says the disk is full (the state
        directory, or the database server); None for any other error."""
        ...

    def has_room(self, session: Session) -> bool:
        """Whether the database has room to grow again after it was full (asked on the
        writer's session; what the engine cannot see counts as room)."""
        ...

    def connect(self) -> tuple[Session, Session | None]:
        """Opens (or creates) the database: a writer session and a reader session (None
        when reads must go through the writer: a SQLite ``:memory:`` database)."""
        ...


@contextmanager
def _transaction(session: Session, begin: Callable[[], None]) -> Iterator[Connection]:
    begin()
    try:
        yield session.connection
    except BaseException:
        if session.in_transaction:
            session.connection.execute("ROLLBACK")
        raise
    session.connection.execute("COMMIT")


def run_batch(session: Session, calls: Sequence[Callable[[Connection], Any]]
              ) -> tuple[list[Outcome], int]:
    """Runs ``calls`` in one transaction, each in its own savepoint, and commits once.

    A call that raises is rolled back to its savepoint and the others go on. An error that
    rolls back the whole transaction (SQLite does for a full disk or an I/O error) fails
    only that call: the calls that had succeeded are run again in a new transaction.

    Returns:
        Each call's (result, error), in order, and how many transactions were committed.

    Raises:
        Exception: ``BEGIN`` or ``COMMIT`` failed (the driver's error): no call took effect.
    """
    connection = session.connection
    outcomes: list[Outcome] = [(None, None)] * len(calls)
    pending = list(range(len(calls)))
    while pending:
        session.begin()
        try:
            survivors: list[int] = []
            for position, index in enumerate(pending):
                connection.execute("SAVEPOINT write")
                try:
                    outcomes[index] = (calls[index](connection), None)
                    connection.execute("RELEASE write")
                except Exception as exc:
                    outcomes[index] = (None, exc)
                    if not session.in_transaction:  # the engine rolled it all back
                        pending = survivors + pending[position + 1:]
                        break
                    connection.execute("ROLLBACK TO write")
                    connection.execute("RELEASE write")
                else:
                    survivors.append(index)
            else:
                connection.execute("COMMIT")
                return outcomes, 1
        except BaseException:
            if session.in_transaction:
                connection.execute("ROLLBACK")
            raise
    return outcomes, 0


def migrate(session: Session, migrations: Sequence[Migration], component: str) -> None:
    """Applies ``component``'s migrations not applied yet, each in a transaction of its own
    during which no other process migrates, and records them in ``schema_migrations``.

    Raises:
        StoreError: The database holds a newer schema of the component than this program
            knows.
        Exception: A statement failed (the driver's error); its migration was rolled back.
    """
    with _transaction(session, session.begin_migration) as connection:
        connection.execute(session.schema(_SCHEMA_MIGRATIONS))
        applied = {row[0] for row in connection.execute(
            "SELECT version FROM schema_migrations WHERE component = ?", (component,))}
    newest_known = max((version for version, _ in migrations), default=0)
    if applied and max(applied) > newest_known:
        raise StoreError(f"the store's {component} schema is version {max(applied)}, newer than "
                         f"this program knows ({newest_known}); run a newer trading-agent")
    for version, statements in migrations:
        if version in applied:
            continue
        with _transaction(session, session.begin_migration) as connection:
            # Checked again under the lock: another process may have just applied it.
            done = connection.execute(
                "SELECT 1 FROM schema_migrations WHERE component = ? AND version = ?",
                (component, version)).fetchone()
            if done is not None:
                continue
            for statement in statements:
                connection.execute(session.schema(statement))
            connection.execute(
                "INSERT INTO schema_migrations (component, version, applied_at) VALUES (?, ?, ?)",
                (component, version, time.time()))
