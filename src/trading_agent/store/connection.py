"""What a store call is handed: a connection speaking the SQL that SQLite and PostgreSQL share.

Every component writes its queries once, with ``?`` placeholders, for both engines: on SQLite
the call gets the ``sqlite3.Connection`` itself; on PostgreSQL a thin wrapper
(:mod:`trading_agent.store.postgres_engine`) that only turns ``?`` into the driver's
placeholder. So a query keeps to the subset both speak:

- ``INSERT ... ON CONFLICT (...) DO NOTHING`` or ``DO UPDATE``, never ``INSERT OR IGNORE`` or
  ``INSERT OR REPLACE``; in ``DO UPDATE SET`` the old row's columns are named with their
  table (``daily_usage.requests + excluded.requests``): PostgreSQL finds a bare name
  ambiguous.
- ``rowid`` only for ordering and finding rows (PostgreSQL tables get a ``rowid`` identity
  column, see :func:`~trading_agent.store.postgres_engine.postgres_schema`).
- No SQLite-only functions (two-argument ``MAX``, ``CAST(... AS BLOB)``), no ``x IS ?``
  (write ``IS NULL`` or ``= ?`` as the value asks), no parameter whose type only its value
  says (``? IS NULL``), a subquery in ``FROM`` named (``AS latest``).
- Integers, floats, text and bytes as parameters; never a ``bool`` for an integer column
  (PostgreSQL refuses a boolean there): pass ``int(flag)``.
- ``LIKE`` is case-sensitive on PostgreSQL and not on SQLite: compare ``LOWER(column)``.

A cursor gives rows as tuples (``fetchone``, ``fetchall``, iteration) and ``rowcount``;
``executemany``'s ``rowcount`` is the sum over its rows on both engines.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

__all__ = ["Connection", "Cursor"]


class Cursor(Protocol):
    """The rows and count of one statement (``sqlite3.Cursor``, ``psycopg.Cursor``)."""

    @property
    def rowcount(self) -> int:
        """The rows the statement changed (summed over ``executemany``'s rows)."""
        ...

    def fetchone(self) -> Any:
        """The next row as a tuple, or None."""
        ...

    def fetchall(self) -> list[Any]:
        """The remaining rows as tuples."""
        ...

    def __iter__(self) -> Iterator[Any]: ...


class Connection(Protocol):
    """The connection a store call runs its queries on (``sqlite3.Connection`` on SQLite).

    A write call must not commit, roll back or start a transaction: the store runs it in a
    savepoint of its group commit.
    """

    def execute(self, sql: str, parameters: Sequence[Any] = (), /) -> Cursor:
        """Runs one statement with ``?`` placeholders."""
        ...

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> Cursor:
        """Runs one statement once for each row of parameters."""
        ...
