"""A PostgreSQL database of a test's own, on the machine's server (127.0.0.1:5432, trust
authentication): created empty for the test, dropped after it; the test skips, saying so,
where no server runs."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from trading_agent.store.targets import PostgresTarget

__all__ = ["SKIP_REASON", "fresh_database"]

HOST, PORT = "127.0.0.1", 5432
USERS = ("root", "postgres")
"""The roles tried, in order (both exist on the machine; either may create a database)."""

SKIP_REASON = f"PostgreSQL is not running on {HOST}:{PORT}"


def _admin() -> tuple[psycopg.Connection[tuple[object, ...]], str]:
    """A connection to the ``postgres`` database and its role; skips without a server."""
    failure: psycopg.Error | None = None
    for user in USERS:
        try:
            connection = psycopg.connect(host=HOST, port=PORT, user=user, dbname="postgres",
                                         autocommit=True, connect_timeout=5)
        except psycopg.Error as exc:
            failure = exc
            continue
        return connection, user
    pytest.skip(f"{SKIP_REASON} ({failure})")


@contextmanager
def fresh_database(password: str | None = None) -> Iterator[PostgresTarget]:
    """A new, empty database (``ta_test_<random>``), dropped with ``WITH (FORCE)`` after.

    Args:
        password: The password the target carries (trust authentication ignores it).

    Yields:
        The database as a store target.
    """
    admin, user = _admin()
    name = f"ta_test_{secrets.token_hex(6)}"
    try:
        admin.execute(f"CREATE DATABASE {name}")
        try:
            yield PostgresTarget(f"postgresql://{user}@{HOST}:{PORT}/{name}", password)
        finally:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        admin.close()
