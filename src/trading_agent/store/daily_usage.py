"""Tokens and cost per desk and UTC day (the ``daily_usage`` table): every model request,
subagents' included, counted by the event log as usage events are stored, and read by the
spend caps and the operator's status."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime

from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration

__all__ = ["MIGRATIONS", "TABLES", "DailyUsage", "SqliteDailyUsage", "add_daily_usage",
           "utc_day"]

TABLES = ("daily_usage",)
"""The tables this module owns."""

MIGRATIONS: tuple[Migration, ...] = (
    (1, (
        # Tokens and cost per desk and UTC day (every model request, subagents' included).
        """CREATE TABLE daily_usage (
            desk TEXT NOT NULL,
            day TEXT NOT NULL,
            requests INTEGER NOT NULL,
            input_tokens INTEGER NOT NULL,
            output_tokens INTEGER NOT NULL,
            cost REAL,
            PRIMARY KEY (desk, day))""",
    )),
    (2, (
        # The prompt tokens the model's server served from its prompt cache (part of
        # input_tokens, priced apart); days stored before this are 0, as nothing was known.
        "ALTER TABLE daily_usage ADD COLUMN cached_input_tokens INTEGER NOT NULL DEFAULT 0",
    )),
)
"""Its part of the store's numbered migrations (see :mod:`~trading_agent.store.schema`)."""


@dataclass(frozen=True)
class DailyUsage:
    """A desk's model usage on one UTC day.

    Attributes:
        desk: The desk.
        day: The UTC day.
        requests: Model requests made (subagents' included).
        input_tokens: Prompt tokens, the cached ones included.
        output_tokens: Completion tokens.
        cost: Their cost, or None when no prices are configured.
        cached_input_tokens: The prompt tokens the server served from its prompt cache.
    """

    desk: str
    day: date
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float | None = None
    cached_input_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.input_tokens + self.output_tokens

    @property
    def cache_share(self) -> float | None:
        """The share of prompt tokens served from cache, or None when there were none."""
        if self.input_tokens <= 0:
            return None
        return min(self.cached_input_tokens, self.input_tokens) / self.input_tokens


def utc_day(at: float) -> str:
    """The UTC day of a time (seconds since the epoch), as the table keys it."""
    return datetime.fromtimestamp(at, UTC).date().isoformat()


def add_daily_usage(connection: Connection, desk: str, day: str, requests: int,
                    input_tokens: int, output_tokens: int, cost: float | None,
                    cached_input_tokens: int = 0) -> None:
    """Inside a write, adds requests' usage to a desk's day.

    Args:
        connection: The write's connection.
        desk: The desk.
        day: The UTC day (:func:`utc_day`).
        requests: How many requests.
        input_tokens: Their prompt tokens, the cached ones included.
        output_tokens: Their completion tokens.
        cost: Their cost, or None when unknown (the day's known cost stays).
        cached_input_tokens: Their prompt tokens served from the server's cache.
    """
    connection.execute(
        "INSERT INTO daily_usage (desk, day, requests, input_tokens, output_tokens, cost, "
        "cached_input_tokens) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (desk, day) DO UPDATE SET "
        "requests = daily_usage.requests + excluded.requests, "
        "input_tokens = daily_usage.input_tokens + excluded.input_tokens, "
        "output_tokens = daily_usage.output_tokens + excluded.output_tokens, "
        "cost = CASE WHEN excluded.cost IS NULL THEN daily_usage.cost "
        "ELSE COALESCE(daily_usage.cost, 0) + excluded.cost END, "
        "cached_input_tokens = daily_usage.cached_input_tokens + excluded.cached_input_tokens",
        (desk, day, requests, input_tokens, output_tokens, cost, cached_input_tokens))


class SqliteDailyUsage:
    """The desks' daily usage in the store.

    Args:
        database: The open store, its schema applied.
        clock: Seconds since the epoch (what "today" is).
    """

    def __init__(self, database: Database, *, clock: Callable[[], float] = time.time) -> None:
        self._db = database
        self._clock = clock

    async def add_usage(self, desk: str, *, input_tokens: int, output_tokens: int,
                        cost: float | None, at: float | None = None,
                        cached_input_tokens: int = 0) -> None:
        """Adds one model request's usage to the desk's day (usage events do it by
        themselves when the event log stores them; this is for requests without one).

        Args:
            desk: The desk.
            input_tokens: Prompt tokens, the cached ones included.
            output_tokens: Completion tokens.
            cost: Their cost, or None when unknown.
            at: When, seconds since the epoch (now by default).
            cached_input_tokens: The prompt tokens served from the server's cache.
        """
        day = utc_day(self._clock() if at is None else at)
        await self._db.write(lambda connection: add_daily_usage(
            connection, desk, day, 1, input_tokens, output_tokens, cost, cached_input_tokens),
            desk=desk)

    async def usage_on(self, desk: str, day: date | None = None) -> DailyUsage:
        """A desk's usage on a UTC day (today by default)."""
        day = day if day is not None else datetime.fromtimestamp(self._clock(), UTC).date()

        def read(connection: Connection) -> DailyUsage:
            row = connection.execute(
                "SELECT requests, input_tokens, output_tokens, cost, cached_input_tokens "
                "FROM daily_usage WHERE desk = ? AND day = ?", (desk, day.isoformat())).fetchone()
            if row is None:
                return DailyUsage(desk, day)
            return DailyUsage(desk, day, int(row[0]), int(row[1]), int(row[2]), row[3],
                              int(row[4]))

        return await self._db.read(read)
