"""The store's SQLite file: one writer connection, one reader, migrations, off the event loop.

Why ``synchronous=FULL``: in WAL mode ``NORMAL`` never corrupts the file, but a power cut
may lose the last commits. The store promises an operator that a message is kept *before*
it says so, and it keeps the record of orders and fills; a promise that a power cut can
take back is not one. ``FULL`` costs one fsync per commit, and the store commits a few
times per model round (events are written in batches), so the cost is small.

Each connection runs one call at a time in a worker thread (``anyio.to_thread``). A call
that is cancelled still runs to its end (the thread is never abandoned), so a transaction
is never cut in half. Writes take the write lock up front (``BEGIN IMMEDIATE``), so a
second process or component writing the same file waits (``busy_timeout``) instead of
failing half-way.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import anyio

from trading_agent.errors import StoreError

__all__ = ["Database", "Migration", "transaction"]

T = TypeVar("T")

Migration = tuple[int, Sequence[str]]
"""A schema version and the statements that bring the schema to it."""

_BUSY_TIMEOUT_MS = 10_000


@contextmanager
def transaction(connection: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction, holding the write lock from its start.

    Args:
        connection: A connection in autocommit mode (``isolation_level=None``).

    Yields:
        The connection.
    """
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield connection
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


def _connect(path: Path, *, read_only: bool) -> sqlite3.Connection:
    connection = sqlite3.connect(path, check_same_thread=False, isolation_level=None,
                                 timeout=_BUSY_TIMEOUT_MS / 1000)
    connection.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
    if read_only:
        connection.execute("PRAGMA query_only=ON")
    else:
        mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"{path}: SQLite refused WAL mode (journal mode {mode})")
        connection.execute("PRAGMA synchronous=FULL")
        connection.execute("PRAGMA foreign_keys=ON")
    return connection


class _Connection:
    """A connection used by one call at a time, in a worker thread."""

    def __init__(self, path: Path, connection: sqlite3.Connection) -> None:
        self._path = path
        self._connection = connection
        self._lock = anyio.Lock()
        self._closed = False

    async def run(self, call: Callable[[sqlite3.Connection], T]) -> T:
        async with self._lock:
            if self._closed:
                raise StoreError(f"the store {self._path} is closed")
            try:
                return await anyio.to_thread.run_sync(call, self._connection)
            except sqlite3.Error as exc:
                raise StoreError(f"{self._path}: {exc}") from exc

    async def close(self) -> None:
        async with self._lock:
            if not self._closed:
                self._closed = True
                await anyio.to_thread.run_sync(self._connection.close)


class Database:
    """The SQLite file: a writer and a reader connection (WAL lets them work at once).

    Use :meth:`open`.

    Args:
        path: The file.
        writer: The writing connection.
        reader: The reading connection.
    """

    def __init__(self, path: Path, writer: sqlite3.Connection,
                 reader: sqlite3.Connection) -> None:
        self.path = path
        self._writer = _Connection(path, writer)
        self._reader = _Connection(path, reader)

    @classmethod
    async def open(cls, path: Path, migrations: Sequence[Migration],
                   component: str) -> Database:
        """Opens (or creates) the file and brings ``component``'s schema up to date.

        Args:
            path: The file; its folder is created if missing.
            migrations: The component's migrations, in version order.
            component: Whose schema it is, in the ``schema_migrations`` table.

        Raises:
            StoreError: The file cannot be opened, or a migration failed.
        """

        def connect() -> Database:
            path.parent.mkdir(parents=True, exist_ok=True)
            writer = _connect(path, read_only=False)
            try:
                _migrate(writer, migrations, component)
                reader = _connect(path, read_only=True)
            except BaseException:
                writer.close()
                raise
            return cls(path, writer, reader)

        try:
            return await anyio.to_thread.run_sync(connect)
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open the store {path}: {exc}") from exc

    async def write(self, call: Callable[[sqlite3.Connection], T]) -> T:
        """Runs ``call`` in one write transaction on the writer connection.

        Raises:
            StoreError: SQLite failed (the transaction was rolled back), or the store is closed.
        """

        def in_transaction(connection: sqlite3.Connection) -> T:
            with transaction(connection):
                return call(connection)

        return await self._writer.run(in_transaction)

    async def read(self, call: Callable[[sqlite3.Connection], T]) -> T:
        """Runs ``call`` on the reader connection (it sees every committed write).

        Raises:
            StoreError: SQLite failed, or the store is closed.
        """
        return await self._reader.run(call)

    async def close(self) -> None:
        """Closes both connections once their calls have finished (idempotent)."""
        await self._writer.close()
        await self._reader.close()


def _migrate(connection: sqlite3.Connection, migrations: Sequence[Migration],
             component: str) -> None:
    """Applies the migrations not applied yet, each in its own transaction."""
    connection.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " component TEXT NOT NULL, version INTEGER NOT NULL, applied_at REAL NOT NULL,"
        " PRIMARY KEY (component, version))")
    with transaction(connection):
        applied = {row[0] for row in connection.execute(
            "SELECT version FROM schema_migrations WHERE component = ?", (component,))}
    newest_known = max((version for version, _ in migrations), default=0)
    if applied and max(applied) > newest_known:
        raise StoreError(f"the store's {component} schema is version {max(applied)}, newer than "
                         f"this program knows ({newest_known}); run a newer trading-agent")
    for version, statements in migrations:
        with transaction(connection):
            # Checked again under the write lock: another process may have just applied it.
            done = connection.execute(
                "SELECT 1 FROM schema_migrations WHERE component = ? AND version = ?",
                (component, version)).fetchone()
            if done is not None:
                continue
            for statement in statements:
                connection.execute(statement)
            connection.execute(
                "INSERT INTO schema_migrations (component, version, applied_at) VALUES (?, ?, ?)",
                (component, version, time.time()))
