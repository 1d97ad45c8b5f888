"""The event log (the ``events`` table, and the highest id the bus gave in
``store_meta``): events arrive in batches from an
:class:`~trading_agent.agent.event_bus.EventBus` subscription, with the bus's ids, so that an
operator's stream that reconnects reads on from where it was.

How the daemon uses it::

    bus = EventBus(first_id=await events.last_event_id() + 1)
    group.start_soon(events.persist_events, bus.subscribe("store", max_buffer=50_000))

Usage events also add to the desks' daily usage (:mod:`~trading_agent.store.daily_usage`),
in the same transaction as the events.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Any

import anyio
import structlog

from trading_agent.agent.event_bus import Subscription
from trading_agent.agent.events import Event, UsageReported
from trading_agent.errors import StoreError
from trading_agent.jsontext import json_text
from trading_agent.store.connection import Connection
from trading_agent.store.daily_usage import add_daily_usage, utc_day
from trading_agent.store.database import Database, Migration
from trading_agent.store.fencing import FencedError

__all__ = ["DEFAULT_SKIPPED_EVENTS", "MIGRATIONS", "TABLES", "SqliteEventLog"]

TABLES = ("events", "store_meta")
"""The tables this module owns."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
    # Events, with the bus's ids (text deltas and heartbeats are left out by default).
    """CREATE TABLE events (
            id INTEGER PRIMARY KEY,
            desk TEXT NOT NULL,
            turn TEXT,
            type TEXT NOT NULL,
            at REAL NOT NULL,
            data TEXT NOT NULL)""",
    "CREATE INDEX events_by_desk ON events (desk, id)",
    # Small values the store keeps about itself (the highest event id the bus gave).
    """CREATE TABLE store_meta (
            key TEXT PRIMARY KEY,
            value TEXT NOT NULL)""",
)),)
"""Its part of the store's numbered migrations (see :mod:`~trading_agent.store.schema`)."""

DEFAULT_SKIPPED_EVENTS: frozenset[str] = frozenset({"text_delta", "thinking_delta",
                                                    "tool_heartbeat"})
"""Event types not stored by default: there are too many, and the messages keep their text."""

_log = structlog.get_logger(__name__)


class SqliteEventLog:
    """The event log in the store.

    Every event names its desk, so that a store opened with a fence refuses the events of
    a desk this daemon no longer holds (see :mod:`~trading_agent.store.fencing`).

    Args:
        database: The open store, its schema applied.
        keeps_high_water: Keeps the highest event id stored, which a restarted daemon numbers
            on from (not in a fleet).
    """

    def __init__(self, database: Database, *, keeps_high_water: bool = True) -> None:
        self._db = database
        self._keeps_high_water = keeps_high_water
        self.events_not_stored = 0
        """Events :meth:`persist_events` dropped because the database refused them twice."""

    async def persist_events(self, subscription: Subscription, *,
                             skip: Collection[str] = DEFAULT_SKIPPED_EVENTS,
                             batch_size: int = 500, retry_after: float = 0.5,
                             sleep: Callable[[float], Awaitable[None]] = anyio.sleep) -> None:
        """Drains a bus subscription into the store, in batches, until it is closed.

        Close the subscription to end it: what is buffered is written first. Cancelling it
        loses what is still buffered. Usage events also add to the desks' daily usage.

        A batch the database refuses (a full disk, a lock held too long) is tried once more after
        ``retry_after`` seconds, then dropped and counted in :attr:`events_not_stored`: the
        event log is a record, and losing some of it must not stop the desks (an exception
        here would end the task group the daemon runs in). Any other error in writing a
        batch (a bug) is logged and handled the same way.

        Args:
            subscription: A subscription to the daemon's bus (give it a large buffer).
            skip: Event types not stored.
            batch_size: The most events written in one transaction.
            retry_after: Seconds to wait before the one retry of a failed batch.
            sleep: The sleep used for that wait (tests pass a fast one).
        """
        async for first in subscription:
            batch = [first]
            while len(batch) < batch_size:
                event = subscription.get_nowait()
                if event is None:
                    break
                batch.append(event)
            await self._append_batch(batch, skip, retry_after, sleep)

    async def _append_batch(self, batch: list[Event], skip: Collection[str],
                            retry_after: float,
                            sleep: Callable[[float], Awaitable[None]]) -> None:
        for attempt in (1, 2):
            try:
                await self.append_events(batch, skip=skip)
                return
            except StoreError as exc:
                _log.error("events_store_failed", error=str(exc), events=len(batch),
                           attempt=attempt)
            except Exception as exc:
                # A bug, not the database refusing: treated the same, since the event log must
                # never end the task group the daemon runs in.
                _log.exception("events_store_failed", error=repr(exc), events=len(batch),
                               attempt=attempt)
            if attempt == 1:
                await sleep(retry_after)
        self.events_not_stored += len(batch)
        _log.error("events_not_stored", count=len(batch), total=self.events_not_stored,
                   reason="the store refused them twice")

    async def append_events(self, events: Iterable[Event], *,
                            skip: Collection[str] = DEFAULT_SKIPPED_EVENTS) -> int:
        """Stores events (idempotent on their ids) and adds usage events to daily usage.

        The events (and usage) of a desk this daemon no longer holds are not stored, when
        the store has a fence; the others are.

        Args:
            events: Events as the bus published them (with their ids).
            skip: Event types not stored (they still count in the highest id seen).

        Returns:
            How many were stored.
        """
        rows: list[tuple[int, str, str | None, str, float, str]] = []
        usage: dict[tuple[str, str], list[float | None]] = defaultdict(
            lambda: [0, 0, 0, None, 0])
        highest = 0
        dropped = 0
        for event in events:
            if event.id <= 0:  # made by a subscription (a drop report), not by the bus
                dropped += int(getattr(event, "count", 0))
                continue
            highest = max(highest, event.id)
            if isinstance(event, UsageReported):
                totals = usage[(event.desk, utc_day(event.at))]
                totals[0] = (totals[0] or 0) + 1
                totals[1] = (totals[1] or 0) + event.input_tokens
                totals[2] = (totals[2] or 0) + event.output_tokens
                if event.cost is not None:
                    totals[3] = (totals[3] or 0.0) + event.cost
                totals[4] = (totals[4] or 0) + event.cached_input_tokens
            if event.type in skip:
                continue
            rows.append((event.id, event.desk, event.turn, event.type, event.at,
                         json_text(event.to_dict(), default=str)))
        if dropped:
            _log.warning("events_not_stored", count=dropped,
                         reason="the store's subscription fell behind")
        if not rows and not usage and not highest:
            return 0

        def write(connection: Connection) -> tuple[int, dict[str, str]]:
            refused = self._refused_desks(connection, {row[1] for row in rows} | {
                desk for desk, _ in usage})
            stored = connection.executemany(
                "INSERT INTO events (id, desk, turn, type, at, data) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [row for row in rows if row[1] not in refused]).rowcount
            for (desk, day), (requests, input_tokens, output_tokens, cost,
                              cached_input_tokens) in usage.items():
                if desk not in refused:
                    add_daily_usage(connection, desk, day, int(requests or 0),
                               int(input_tokens or 0), int(output_tokens or 0), cost,
                               int(cached_input_tokens or 0))
            if highest and self._keeps_high_water:
                connection.execute(
                    "INSERT INTO store_meta (key, value) VALUES ('event_high_water', ?) "
                    "ON CONFLICT (key) DO UPDATE SET value = CASE "
                    "WHEN CAST(excluded.value AS BIGINT) > CAST(store_meta.value AS BIGINT) "
                    "THEN excluded.value ELSE store_meta.value END",
                    (str(highest),))
            return max(stored, 0), refused

        stored, refused = await self._db.write(write)
        for desk, reason in refused.items():
            _log.warning("events_not_stored", desk=desk, reason=reason,
                         count=sum(row[1] == desk for row in rows))
        return stored

    def _refused_desks(self, connection: Connection, desks: Collection[str]) -> dict[str, str]:
        """The desks among ``desks`` this daemon no longer holds, and why (the fence's
        word), checked inside a write that concerns them all."""
        refused: dict[str, str] = {}
        for desk in sorted(desks):
            try:
                self._db.check_fence(connection, desk)
            except FencedError as exc:
                refused[desk] = str(exc)
        return refused

    async def events_since(self, after_id: int, desk: str | None = None,
                           limit: int = 1000) -> list[dict[str, Any]]:
        """Stored events with an id above ``after_id``, oldest first (for a stream that
        reconnects).

        Args:
            after_id: The last id the reader has.
            desk: Only this desk's events; None for all.
            limit: The most events.

        Returns:
            Each event as its ``to_dict()`` data.
        """

        def read(connection: Connection) -> list[dict[str, Any]]:
            if desk is None:
                cursor = connection.execute(
                    "SELECT data FROM events WHERE id > ? ORDER BY id LIMIT ?", (after_id, limit))
            else:
                cursor = connection.execute(
                    "SELECT data FROM events WHERE desk = ? AND id > ? ORDER BY id LIMIT ?",
                    (desk, after_id, limit))
            return [json.loads(row[0]) for row in cursor]

        return await self._db.read(read)

    async def last_event_id(self) -> int:
        """The highest event id the store has seen (stored or skipped); 0 when none.

        Start the bus at one more (``EventBus(first_id=...)``) so ids keep increasing across
        restarts, even past the ids of skipped text deltas an operator's stream already saw.
        """

        def read(connection: Connection) -> int:
            stored = connection.execute("SELECT COALESCE(MAX(id), 0) FROM events").fetchone()[0]
            meta = connection.execute(
                "SELECT value FROM store_meta WHERE key = 'event_high_water'").fetchone()
            return max(int(stored), int(meta[0]) if meta is not None else 0)

        return await self._db.read(read)
