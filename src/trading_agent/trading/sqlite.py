"""A SQLite file the trading layer writes to, off the event loop.

One connection per component (the paper ledger, the order journal, the risk journal, the
desk's notes), in WAL mode so readers never block the writer. Calls run one at a time in a
worker thread (``anyio.to_thread``; inline in a backtest, see :mod:`trading_agent.blocking`);
a call that is cancelled still finishes its transaction,
so the file never holds half an order. Tables are appended to or updated row by row, never
rewritten whole. A file created here is 0600 (its ``-wal`` and ``-shm`` files follow): it holds
the account's orders and balances.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar

import anyio

from trading_agent.blocking import run_blocking
from trading_agent.errors import StoreError

__all__ = ["SqliteDatabase"]

T = TypeVar("T")

_PRIVATE_FILE = 0o600
_NOT_FILES = frozenset({"", ":memory:"})
"""Paths SQLite takes for a database of its own, not a file to create."""


class SqliteDatabase:
    """One connection to a SQLite file.

    Use :meth:`open`; the constructor runs blocking calls.

    Args:
        path: The file (``:memory:`` for a throwaway database).
        synchronous: ``FULL`` waits for the disk on every commit; ``NORMAL`` (enough in WAL
            mode to never corrupt the file) may lose the last commits on a power cut.
    """

    def __init__(self, path: Path | str,
                 synchronous: Literal["NORMAL", "FULL"] = "NORMAL") -> None:
        self.path = str(path)
        try:
            if self.path not in _NOT_FILES and not os.path.lexists(self.path):
                # SQLite would create it 0644 less the umask; its -wal and -shm take its mode.
                os.close(os.open(self.path, os.O_CREAT | os.O_RDONLY | os.O_CLOEXEC,
                                 _PRIVATE_FILE))
            self._connection = sqlite3.connect(self.path, check_same_thread=False,
                                               timeout=10.0)
            self._connection.execute("PRAGMA journal_mode=WAL")
            self._connection.execute(f"PRAGMA synchronous={synchronous}")
            self._connection.execute("PRAGMA foreign_keys=ON")
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open the database {self.path}: {exc}") from exc
        self._lock = anyio.Lock()
        self._closed = False

    @classmethod
    async def open(cls, path: Path | str, schema: str = "",
                   synchronous: Literal["NORMAL", "FULL"] = "NORMAL") -> SqliteDatabase:
        """Opens (or creates) the file and applies ``schema`` (idempotent DDL).

        Raises:
            StoreError: The file cannot be opened or the schema applied.
        """
        database = await anyio.to_thread.run_sync(cls, path, synchronous)
        if schema:
            await database.run(lambda connection: connection.executescript(schema))
        return database

    async def run(self, call: Callable[[sqlite3.Connection], T]) -> T:
        """Runs ``call(connection)`` in a worker thread, alone on the connection.

        A call that writes wraps its statements in ``with connection:`` (one transaction).

        Raises:
            StoreError: SQLite failed, or the database is closed.
        """
        async with self._lock:
            if self._closed:
                raise StoreError(f"the database {self.path} is closed")
            try:
                return await run_blocking(call, self._connection)
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: {exc}") from exc

    def run_blocking(self, call: Callable[[sqlite3.Connection], T]) -> T:
        """Runs ``call(connection)`` on the calling thread (scripts, benchmarks' baselines).

        Raises:
            StoreError: SQLite failed.
        """
        try:
            return call(self._connection)
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: {exc}") from exc

    async def close(self) -> None:
        """Closes the connection once pending calls have finished (idempotent)."""
        async with self._lock:
            if not self._closed:
                self._closed = True
                await anyio.to_thread.run_sync(self._connection.close)

    def __repr__(self) -> str:
        return f"SqliteDatabase({self.path!r}{', closed' if self._closed else ''})"
