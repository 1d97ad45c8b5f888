"""Fixtures of the store tests: a real SQLite file under the test's temporary folder."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from trading_agent.store import Store, database_path


class FakeClock:
    """Seconds since the epoch, moved by hand."""

    def __init__(self, now: float = 1_750_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return database_path(tmp_path / "state")


@pytest.fixture
async def store(db_path: Path, clock: FakeClock) -> AsyncIterator[Store]:
    opened = await Store.open(db_path, clock=clock)
    try:
        yield opened
    finally:
        await opened.close()
