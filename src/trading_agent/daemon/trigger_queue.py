"""A desk's queue of triggers waiting for it to be free.

- Market triggers (ticks, candle closes) are coalesced: while one waits for a symbol, a newer
  one replaces it in place and ``Trigger.merged`` counts how many it stands for.
- Operator messages, commands and resume notices go before market and schedule triggers, in
  arrival order: a person waiting for an answer should not wait behind a backlog.
- Nothing else is ever dropped, and a trigger whose id is already queued is not queued twice
  (a restore after a failure re-reads the store's pending messages).
"""

from __future__ import annotations

import dataclasses
from collections import deque

import anyio

from trading_agent.agent.trigger import Trigger

__all__ = ["TriggerQueue"]

_COALESCED = frozenset({"tick", "candle"})
_URGENT = frozenset({"operator", "command", "resume"})


class TriggerQueue:
    """Triggers in the order a desk should take them."""

    def __init__(self) -> None:
        self._urgent: deque[Trigger] = deque()
        self._normal: list[Trigger] = []
        self._ids: set[str] = set()
        self._changed = anyio.Event()

    def put(self, trigger: Trigger) -> None:
        """Queues a trigger; never blocks.

        Args:
            trigger: The trigger; a tick or candle replaces a queued one of the same source.
        """
        if trigger.id in self._ids:
            return
        if trigger.kind in _COALESCED:
            for index, queued in enumerate(self._normal):
                if queued.kind == trigger.kind and queued.source == trigger.source:
                    self._ids.discard(queued.id)
                    self._normal[index] = dataclasses.replace(
                        trigger, merged=queued.merged + trigger.merged)
                    self._ids.add(trigger.id)
                    return
        if trigger.kind in _URGENT:
            self._urgent.append(trigger)
        else:
            self._normal.append(trigger)
        self._ids.add(trigger.id)
        self._changed.set()

    def put_first(self, trigger: Trigger) -> None:
        """Puts a trigger ahead of every other (a resume notice, a turn to run again)."""
        if trigger.id in self._ids:
            return
        self._urgent.appendleft(trigger)
        self._ids.add(trigger.id)
        self._changed.set()

    def take(self) -> Trigger | None:
        """Removes and returns the next trigger, or None when the queue is empty."""
        if self._urgent:
            trigger = self._urgent.popleft()
        elif self._normal:
            trigger = self._normal.pop(0)
        else:
            return None
        self._ids.discard(trigger.id)
        return trigger

    async def wait(self) -> None:
        """Returns at once if a trigger waits, else when one is queued or :meth:`wake` is
        called (the caller checks again why it woke)."""
        if not len(self):
            self._changed = anyio.Event()
            await self._changed.wait()

    async def changed(self) -> None:
        """Returns when a trigger is queued or :meth:`wake` is called, whatever already
        waits (a held desk waits so, its queue full)."""
        self._changed = anyio.Event()
        await self._changed.wait()

    def wake(self) -> None:
        """Wakes a waiter without queueing anything (so it sees the desk is stopping)."""
        self._changed.set()

    def __contains__(self, trigger_id: object) -> bool:
        return trigger_id in self._ids

    def __len__(self) -> int:
        return len(self._urgent) + len(self._normal)
