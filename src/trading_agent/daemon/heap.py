"""Keeps the daemon's long-lived heap out of the cyclic garbage collector's walks.

Python frees an object when its last reference goes (reference counting); the cyclic
collector is only for groups of objects that refer to each other. To find those it walks
the objects it tracks: the young ones often, and every object of the process in a *full*
(generation-2) collection, which runs each time the heap has grown by a quarter. A daemon
with hundreds of desks holds every desk's conversation (500 desks of 1,000 messages: some
ten million objects), none of it garbage, and each full collection walked all of it while
every desk's event loop waited: 882 ms in ``bench/desks_scale.py --history 1000``.

:class:`HeapKeeper` moves what has lived through start-up into the collector's *permanent
generation* (``gc.freeze()``), which no collection walks:

- **after start-up** (every desk restored from the store): the unfrozen heap is collected,
  then what survives is frozen: the modules, the settings, the desks and their restored
  conversations;
- **after a desk is added or restored again** (a desk taken over in a fleet, a reload): the
  same, which costs a walk of what was not frozen yet (what arrived since the last freeze),
  not of the frozen heap;
- **after a compaction**: the same; and at most once per ``refresh_seconds`` (an hour by
  default) a *refresh*: ``gc.unfreeze()``, a full ``gc.collect()``, ``gc.freeze()``.

Why this is safe for a process that runs for months:

- Freezing changes nothing for reference counting: a frozen object whose last reference is
  dropped is freed at once, as any other. The messages a compaction drops from a
  conversation, a desk's old conversation after a restore, are freed that way (they form no
  cycles), frozen or not.
- What freezing does withhold is the collection of *cycles among frozen objects* that become
  garbage later. The refresh bounds that: it unfreezes everything, collects every cycle that
  became garbage since, and freezes again what is still alive. So such garbage lives at most
  ``refresh_seconds`` (and only when compactions happen: a desk that never compacts drops
  nothing). A refresh costs one full collection's pause, once an hour instead of each time the
  heap grew by a quarter.
- Nothing is ever frozen without a collection of the unfrozen heap first, so no cycle that is
  already garbage is frozen.
- Objects made after a freeze are collected as usual; the collector's thresholds are left as
  they are.

``bench/heap_longrun.py`` runs many turns and compactions with the keeper on and off and
samples the RSS: it does not grow because of it (see the README's figures).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import structlog

from trading_agent.agent.event_bus import Subscription
from trading_agent.agent.events import CompactionEnded

__all__ = ["REFRESH_SECONDS", "HeapKeeper", "is_compaction"]

_log = structlog.get_logger(__name__)

REFRESH_SECONDS = 3600.0
"""How often, at most, a compaction unfreezes the heap for a full collection."""


class HeapKeeper:
    """Freezes the long-lived heap after start-up, restores and compactions.

    Args:
        refresh_seconds: The least time between two refreshes (unfreeze, collect every
            generation, freeze), which reclaim cycles that became garbage while frozen.
        clock: Monotonic seconds.
    """

    def __init__(self, *, refresh_seconds: float = REFRESH_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.refresh_seconds = refresh_seconds
        self._clock = clock
        self._last_refresh: float | None = None
        self.freezes = 0
        """How many times the heap was frozen."""
        self.refreshes = 0
        """How many of those unfroze it for a full collection first."""

    @property
    def frozen(self) -> int:
        """How many objects the permanent generation holds."""
        return gc.get_freeze_count()

    def freeze(self) -> None:
        """Collects what is not frozen yet, then freezes what survived (start-up, a desk
        restored or added)."""
        gc.collect()
        gc.freeze()
        self.freezes += 1
        if self._last_refresh is None:
            self._last_refresh = self._clock()  # nothing frozen before: that was a full one

    def refresh(self) -> None:
        """Unfreezes the heap, collects all of it (cycles that became garbage while frozen
        included), and freezes what is still alive."""
        started = time.perf_counter()
        gc.unfreeze()
        self._last_refresh = self._clock()
        self.freeze()
        self.refreshes += 1
        _log.info("heap_refreshed", frozen=gc.get_freeze_count(),
                  seconds=round(time.perf_counter() - started, 3))

    def compacted(self) -> None:
        """After a compaction: a refresh when the last was ``refresh_seconds`` ago or more,
        else a freeze."""
        last = self._last_refresh
        if last is None or self._clock() - last >= self.refresh_seconds:
            self.refresh()
        else:
            self.freeze()

    async def watch(self, compactions: Subscription) -> None:
        """Calls :meth:`compacted` for each compaction that ends, until the subscription
        closes (subscribe with :func:`is_compaction`)."""
        with compactions:
            async for event in compactions:
                if isinstance(event, CompactionEnded):
                    self.compacted()


def is_compaction(event: object) -> bool:
    """The events :meth:`HeapKeeper.watch` reads."""
    return isinstance(event, CompactionEnded)
