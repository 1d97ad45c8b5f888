"""Cooperative time slices of the event loop, shared by every desk of a process.

Hundreds of desks share one event loop. When 500 of them wake at once (a schedule fires for
all, or 500 model answers arrive in one poll), asyncio runs every ready task in one pass of
the loop, so the pass lasts the sum of their work: some 250 ms at 500 desks of 1,000
messages, during which no timer fires and no socket is read (a watchdog, a kill switch, an
exchange's stream all wait). :func:`pace` bounds a pass: a desk calls it before each step of
its own (taking a trigger, building a request, reading an answer); while the current slice
has run less than :data:`SLICE_SECONDS` it returns at once, else the desk waits in line.

Once per pass of the loop a tick begins a new slice and lets the next few desks of the line
go, in order; how many is learnt from what the desks let go cost (as many as fit in a slice
at the dearest cost per desk seen lately, at most twice as many as last time). The line
costs nothing while it waits (a future each, no re-polling), and between two slices the loop
polls its sockets and runs its due timers. Nothing is dropped or reordered: a desk that
waits goes on, in its turn, exactly where it stopped. On an event loop that is not
asyncio's, :func:`pace` returns at once.
"""

from __future__ import annotations

import asyncio
import collections
import time
import weakref

__all__ = ["SLICE_SECONDS", "pace"]

SLICE_SECONDS = 0.005
"""How long one pass of the event loop runs desks' steps before the loop polls again."""
_MOST_AT_ONCE = 1024
"""The most waiting desks let go in one slice."""
_COST_MEMORY = 0.98
"""How much of the dearest step cost seen is kept at each tick (so it is forgotten in a few
hundred slices). Long enough to span a burst's cheap steps: 500 desks first each take their
trigger (cheap), then each build and send a request (dear); at 0.9 the dear cost was
forgotten by then, a tick let go some 60 requests at once, and that pass of the loop took
36 ms instead of about 5 (``bench/desks_scale.py --history 1000``: the longest stall 44 to
48 ms at 0.9, 23 to 25 ms at 0.98)."""


class _Pacer:
    """The slices and the line of one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._started: float | None = None
        """When the current slice began; None when no desk stepped since the last tick."""
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._tick_pending = False
        self._batch = 1
        """How many waiting desks the next tick lets go."""
        self._let_go = 0
        """How many the last tick let go."""
        self._step_cost = 0.0
        """The dearest a desk's step was lately (seconds), the slice's rest included."""

    async def pace(self) -> None:
        now = time.perf_counter()
        if self._started is None:
            self._started = now
            self._schedule_tick()
        if not self._waiting and now - self._started < SLICE_SECONDS:
            return
        future: asyncio.Future[None] = self._loop.create_future()
        self._waiting.append(future)
        self._schedule_tick()
        try:
            await future
        except asyncio.CancelledError:
            if not future.done():
                future.cancel()
            if future in self._waiting:
                self._waiting.remove(future)
            raise

    def _schedule_tick(self) -> None:
        if not self._tick_pending:
            self._tick_pending = True
            self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        """A new pass of the loop: a new slice, and the next desks of the line go."""
        self._tick_pending = False
        now = time.perf_counter()
        if self._started is not None and self._let_go:
            # What a desk's step costs: the dearest seen lately (steps differ: a request
            # built costs more than a trigger taken), so a batch of dear ones still fits.
            cost = (now - self._started) / self._let_go
            self._step_cost = max(cost, self._step_cost * _COST_MEMORY)
            # A clock that did not move between two ticks must not stop the line.
            fits = int(SLICE_SECONDS / self._step_cost) if self._step_cost > 0 else _MOST_AT_ONCE
            self._batch = max(1, min(fits, 2 * self._batch, _MOST_AT_ONCE))
        if not self._waiting:
            self._started, self._let_go = None, 0
            return
        self._started = now  # what the desks let go now do counts against this slice
        self._let_go = 0
        while self._waiting and self._let_go < self._batch:
            future = self._waiting.popleft()
            if not future.done():
                future.set_result(None)
                self._let_go += 1
        self._schedule_tick()


_PACERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pacer] = (
    weakref.WeakKeyDictionary())


async def pace() -> None:
    """Returns at once while the event loop's current slice has time left; else waits for
    this task's turn in a later pass, after the loop has polled its sockets and timers.

    Call it before a step whose cost adds up when hundreds of desks take it in the same
    pass (a turn's start, building a request, reading an answer).
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not on asyncio (another anyio backend): nothing to share
        return
    pacer = _PACERS.get(loop)
    if pacer is None:
        pacer = _PACERS[loop] = _Pacer(loop)
    await pacer.pace()
