"""The live event stream: one bus subscription, a ring of recent events, many readers.

:class:`EventHub` subscribes to the daemon's :class:`~trading_agent.agent.event_bus.EventBus`
once and keeps the last N events, every type, text deltas included, each already encoded as a
server-sent-events frame: a hundred watchers cost one JSON encoding per event, not a hundred.
A reader is a cursor (the last event id it has seen) walking the ring, so a slow watcher
falls behind on its own and never holds memory or the desks back.

:func:`sse_frames` is one watcher's stream. It resumes after any event id: ids the ring still
holds come from the ring; older ones come from the store (``DeskControl.events_since``, which
keeps every event but text deltas and heartbeats), and the two are joined at the ring's floor
so nothing is sent twice and nothing in between is skipped. Ids only grow, so the cursor alone
de-duplicates.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import structlog

from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import Event, EventsDropped
from trading_agent.jsontext import json_text

__all__ = [
    "STREAM_CURSOR_HEADER",
    "EventFeed",
    "EventHub",
    "StoredEvents",
    "StreamItem",
    "encode_frame",
    "sse_frames",
]

STREAM_CURSOR_HEADER = "X-Stream-Cursor"
"""The response header naming the event id a stream started after, so that a client that
asked for events "from now" and lost the connection before the first one resumes there."""

_log = structlog.get_logger(__name__)

EventFeed = Callable[["int | None"], AsyncIterator[tuple[int, dict[str, Any]]]]
"""``(after) -> (id, event)...``: a fleet's events, every daemon's, numbered by its stream
(:meth:`~trading_agent.fleet.control.FleetControl.event_feed`); the hub reads it instead of
the daemon's own bus."""

StoredEvents = Callable[[int, "str | None", int], Awaitable[list[dict[str, Any]]]]
"""``(after_id, desk, limit) -> events``: the store's events after an id, oldest first."""

_STORE_PAGE = 500
"""How many stored events one catch-up query reads."""

_BATCH = 500
"""The most events sent in one write."""


def encode_frame(event_id: int, data: dict[str, Any]) -> bytes:
    """One server-sent event: ``id:`` then the event as one JSON ``data:`` line.

    Args:
        event_id: The event's id (what a reconnecting client sends back as Last-Event-ID).
        data: The event as JSON-ready data, with its ``type``.

    Returns:
        The frame's bytes.
    """
    # json_text: a lone surrogate in model text must not make the frame unencodable.
    return f"id: {event_id}\ndata: {json_text(data, default=str)}\n\n".encode()


@dataclass(frozen=True, slots=True)
class StreamItem:
    """One event in the ring: its id, desk and encoded frame."""

    id: int
    desk: str
    frame: bytes


class EventHub:
    """Keeps the newest events of a bus for the operator streams.

    Args:
        bus: The daemon's event bus; the hub subscribes at once, so every event published
            after construction reaches it.
        capacity: How many events the ring keeps.
    """

    def __init__(self, bus: EventBus, capacity: int = 20_000, *,
                 feed: EventFeed | None = None) -> None:
        # The bus drops for a subscriber that lags this far; the hub only copies, so it
        # never should, but a reconnecting reader would then find a gap the store fills.
        self._feed = feed
        self._subscription = bus.subscribe("operator-api", max_buffer=max(capacity, 100_000),
                                           accept=lambda _: feed is None)
        self._items: deque[StreamItem] = deque(maxlen=capacity)
        self._floor: int | None = None
        self._changed = anyio.Event()
        self._closed = False
        self.dropped_total = 0
        """Events the bus dropped before the hub read them (should stay 0)."""

    @property
    def floor(self) -> int | None:
        """The lowest id the ring vouches for: every event from here on is in it (None
        until the first event arrives)."""
        return self._floor

    @property
    def last_id(self) -> int | None:
        """The newest event's id, or None."""
        return self._items[-1].id if self._items else None

    @property
    def closed(self) -> bool:
        """Whether the hub stopped (the server is shutting down)."""
        return self._closed

    async def run(self) -> None:
        """Copies events from the bus (or the fleet's feed) into the ring until cancelled or
        closed."""
        if self._feed is not None:
            await self._run_feed(self._feed)
            return
        subscription = self._subscription
        try:
            while not self._closed:
                try:
                    event: Event | None = await subscription.get()
                except anyio.EndOfStream:
                    break
                # Drain what else waits, so a burst wakes the readers once.
                while event is not None:
                    self._add(event)
                    event = subscription.get_nowait()
                self._wake()
        finally:
            subscription.close()

    async def _run_feed(self, feed: EventFeed) -> None:
        """Copies the fleet's events (already numbered by its stream) into the ring."""
        async for event_id, data in feed(self.last_id):
            if self._closed:
                return
            self._add_item(event_id, str(data.get("desk", "*")), data)
            self._wake()

    def publish_directly(self, event: Event) -> None:
        """Adds an already-published event (tests and benchmarks without a running hub)."""
        self._add(event)
        self._wake()

    def _add(self, event: Event) -> None:
        if isinstance(event, EventsDropped):
            self.dropped_total += event.count
            _log.warning("operator_stream_events_dropped", count=event.count)
            return
        self._add_item(event.id, event.desk, event)

    def _add_item(self, event_id: int, desk: str, data: Event | dict[str, Any]) -> None:
        items = self._items
        if items and event_id <= items[-1].id:
            return  # never out of order: ids are the cursor
        if len(items) == items.maxlen:
            self._floor = items[1].id if len(items) > 1 else event_id
        encoded = data.to_dict() if isinstance(data, Event) else data
        items.append(StreamItem(event_id, desk, encode_frame(event_id, encoded)))
        if self._floor is None:
            self._floor = event_id

    def _wake(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    def close(self) -> None:
        """Stops the hub; every waiting reader returns and its stream ends."""
        self._closed = True
        self._subscription.close()
        self._wake()

    def covers(self, cursor: int) -> bool:
        """Whether every event after ``cursor`` that still matters is in the ring."""
        return self._floor is not None and cursor + 1 >= self._floor

    def after(self, cursor: int, desk: str | None = None) -> tuple[list[StreamItem], int]:
        """The ring's events after ``cursor`` (call only when :meth:`covers` is true).

        Args:
            cursor: The last id the reader has seen.
            desk: Only this desk's events; None for all.

        Returns:
            The events, oldest first, and the reader's new cursor.
        """
        found: list[StreamItem] = []
        # Readers are almost always near the newest end: walk back from it.
        for item in reversed(self._items):
            if item.id <= cursor:
                break
            if desk is None or item.desk in (desk, "*"):
                found.append(item)
        found.reverse()
        last = self.last_id
        return found, max(cursor, last if last is not None else cursor)

    def tail_cursor(self, count: int, desk: str | None = None) -> int | None:
        """A cursor that shows the last ``count`` matching events the ring holds.

        Returns:
            The cursor, or None when the ring is empty (start with the next event).
        """
        if not self._items:
            return None
        seen = 0
        for item in reversed(self._items):
            if desk is None or item.desk in (desk, "*"):
                seen += 1
                if seen > count:
                    return item.id
        assert self._floor is not None
        return self._floor - 1

    async def wait_beyond(self, cursor: int | None) -> None:
        """Waits until an event newer than ``cursor`` (any event, for None) is in the ring,
        or the hub closes. Bound it with ``anyio.move_on_after``."""
        while not self._closed:
            last = self.last_id
            if last is not None and (cursor is None or last > cursor):
                return
            await self._changed.wait()


async def sse_frames(hub: EventHub, stored: StoredEvents, *, cursor: int | None,
                     desk: str | None = None, follow: bool = True,
                     keepalive_seconds: float = 15.0,
                     linger_seconds: float = 0.0) -> AsyncIterator[bytes]:
    """One watcher's stream, as server-sent-event frames.

    Args:
        hub: The ring of recent events.
        stored: The store's events, for ids the ring no longer holds.
        cursor: Send events after this id; None: only events from now on.
        desk: Only this desk's events; None for all.
        follow: Keep streaming new events; False ends once caught up.
        keepalive_seconds: A comment line after this much silence, so dead connections show.
        linger_seconds: After new events arrive, wait this long for more before sending, so
            a busy daemon sends few large writes instead of many small ones.

    Yields:
        SSE frames.
    """
    yield b"retry: 2000\n\n"
    if cursor is None:
        # "From now": the ring's newest event is the start, or the first one to arrive.
        if hub.last_id is None:
            if not follow:
                return
            while hub.last_id is None and not hub.closed:
                with anyio.move_on_after(keepalive_seconds) as waited:
                    await hub.wait_beyond(None)
                if waited.cancelled_caught:
                    yield b": keepalive\n\n"
            floor = hub.floor
            cursor = floor - 1 if floor is not None else 0
        else:
            cursor = hub.last_id
    while not hub.closed:
        if hub.covers(cursor):
            items, cursor = hub.after(cursor, desk)
            # Whatever is waiting goes out as one write: per-event sends cost far more than
            # the bytes (a watcher catching up, or a burst of text deltas).
            for start in range(0, len(items), _BATCH):
                yield b"".join(item.frame for item in items[start:start + _BATCH])
                # A write that does not fill the socket's buffer never yields: let the loop
                # run (a closed connection is noticed, other streams get their turn).
                await anyio.lowlevel.checkpoint()
        else:
            rows = await stored(cursor, desk, _STORE_PAGE)
            floor = hub.floor  # read after the await: the ring may have moved on
            older = [row for row in rows
                     if int(row["id"]) > cursor and (floor is None or int(row["id"]) < floor)]
            if older:
                yield b"".join(encode_frame(int(row["id"]), row) for row in older)
                cursor = int(older[-1]["id"])
                await anyio.lowlevel.checkpoint()
                continue
            if floor is not None:
                # The store holds nothing between the cursor and the ring: join the ring.
                cursor = floor - 1
                continue
        if not follow:
            return
        with anyio.move_on_after(keepalive_seconds) as waited:
            await hub.wait_beyond(cursor)
        if waited.cancelled_caught:
            yield b": keepalive\n\n"
        elif linger_seconds > 0:
            # Let a burst gather: one write of many events costs about what one event does.
            await anyio.sleep(linger_seconds)
