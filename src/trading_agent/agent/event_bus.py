"""The event bus: every step of every desk, fanned out to subscribers that never stall a desk.

Publishing is synchronous and never waits: each subscriber has a bounded buffer, and when a
subscriber falls behind its newest events are dropped and counted; the next thing it reads is
an :class:`EventsDropped` saying how many. A subscriber that raises only hurts itself.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any

import anyio

from trading_agent.agent.events import Event, EventsDropped

__all__ = ["EventBus", "Subscription"]


class Subscription:
    """One subscriber's bounded queue of events; iterate it with ``async for``.

    Args:
        bus: The bus it reads from.
        name: Who subscribes, named in drop reports.
        max_buffer: The most events held before new ones are dropped.
        accept: Which events it wants (None for all).
    """

    def __init__(self, bus: EventBus, name: str, max_buffer: int,
                 accept: Callable[[Event], bool] | None) -> None:
        self._bus = bus
        self.name = name
        self._max_buffer = max_buffer
        self._accept = accept
        self._buffer: deque[Event] = deque()
        self._wakeup = anyio.Event()
        self.dropped = 0
        """Events dropped since the last drop report."""
        self.dropped_total = 0
        """Events dropped over the subscription's life."""
        self.closed = False

    def _offer(self, event: Event) -> None:
        if self._accept is not None and not self._accept(event):
            return
        if len(self._buffer) >= self._max_buffer:
            self.dropped += 1
            self.dropped_total += 1
        else:
            self._buffer.append(event)
        self._wakeup.set()

    def get_nowait(self) -> Event | None:
        """The next event if one is waiting, else None."""
        if self.dropped:
            report = EventsDropped(desk="*", subscriber=self.name, count=self.dropped)
            self.dropped = 0
            return report
        if self._buffer:
            return self._buffer.popleft()
        return None

    async def get(self) -> Event:
        """Waits for the next event.

        Raises:
            anyio.EndOfStream: The subscription was closed.
        """
        while True:
            event = self.get_nowait()
            if event is not None:
                return event
            if self.closed:
                raise anyio.EndOfStream
            self._wakeup = anyio.Event()
            await self._wakeup.wait()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        while True:
            try:
                yield await self.get()
            except anyio.EndOfStream:
                return

    def close(self) -> None:
        """Stops receiving; a waiting reader ends its iteration."""
        if not self.closed:
            self.closed = True
            self._bus._remove(self)
            self._wakeup.set()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class EventBus:
    """Fans events out to subscribers; a child bus tags what it publishes (for subagents).

    Args:
        first_id: The id of the first event published; a daemon restarting on a store passes
            one past the last stored id, so ids stay unique and increasing across restarts.
    """

    def __init__(self, first_id: int = 1) -> None:
        self._subscriptions: list[Subscription] = []
        self._sequence = itertools.count(first_id)
        self._root = self
        self._tags: dict[str, Any] = {}

    def child(self, **tags: Any) -> EventBus:
        """A view of this bus whose events carry ``tags`` (such as a subagent's id).

        Args:
            **tags: Event fields to set: ``subagent``, ``parent_call``, ``turn``.

        Returns:
            A bus that publishes to the same subscribers.
        """
        child = EventBus.__new__(EventBus)
        child._root = self._root
        child._tags = {**self._tags, **tags}
        return child

    def publish(self, event: Event) -> Event:
        """Numbers the event and hands it to every subscriber; never blocks.

        Args:
            event: The event.

        Returns:
            The event as published, with its sequence ``id`` and any tags.
        """
        root = self._root
        if self._tags:
            event = dataclasses.replace(event, **self._tags)
        object.__setattr__(event, "id", next(root._sequence))
        for subscription in root._subscriptions:
            subscription._offer(event)
        return event

    def subscribe(self, name: str, *, max_buffer: int = 10_000,
                  accept: Callable[[Event], bool] | None = None) -> Subscription:
        """Starts receiving events.

        Args:
            name: Who subscribes, for drop reports.
            max_buffer: The most events held; past it new events are dropped and counted.
            accept: Only events for which this returns True are kept.

        Returns:
            The subscription; close it (or use ``with``) when done.
        """
        subscription = Subscription(self._root, name, max_buffer, accept)
        self._root._subscriptions.append(subscription)
        return subscription

    def dropped_totals(self) -> dict[str, int]:
        """Events dropped over each live subscription's life, by subscriber name."""
        totals: dict[str, int] = {}
        for subscription in self._root._subscriptions:
            totals[subscription.name] = totals.get(subscription.name, 0) + \
                subscription.dropped_total
        return totals

    def _remove(self, subscription: Subscription) -> None:
        root = self._root
        if subscription in root._subscriptions:
            root._subscriptions.remove(subscription)
