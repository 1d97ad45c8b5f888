"""Fixtures of the store tests, each test run on both engines: a real SQLite file under the
test's temporary folder, and a PostgreSQL database of the test's own (skipped where no
server runs)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.postgres import fresh_database
from trading_agent.store import PostgresTarget, Store, StoreTarget, database_path


class FakeClock:
    """Seconds since the epoch, moved by hand."""

    def __init__(self, now: float = 1_750_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreTarget]:
    """Where the test's store lives: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield database_path(tmp_path / "state")
    else:
        with fresh_database() as database:
            yield database


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """A SQLite file, for the tests of what only SQLite has (its file, its pragmas)."""
    return database_path(tmp_path / "state")


@pytest.fixture
async def store(target: StoreTarget, clock: FakeClock) -> AsyncIterator[Store]:
    opened = await Store.open(target, clock=clock)
    try:
        yield opened
    finally:
        await opened.close()


def is_postgres(target: StoreTarget) -> bool:
    """Whether the test runs on PostgreSQL."""
    return isinstance(target, PostgresTarget)
