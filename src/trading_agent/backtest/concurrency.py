"""``--concurrency N``: at most N model calls in flight across every worker of a backtest,
and a rate limit (HTTP 429) waited out rather than fought.

A remote model bills and throttles per account: ``--jobs 8`` against it would send eight
requests at once and meet 429s. :class:`ModelSlots` is a semaphore shared by processes: N
lock files, a call holding one (``flock``) while it runs. :class:`BoundedModel` takes a slot
for each call to the model (cache hits need none: the response cache wraps it) and, on a
429, gives the slot back, waits what the server asked (``Retry-After``) or a doubling
backoff, and asks again, up to :data:`ATTEMPTS` times.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, Any

import anyio

from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec
from trading_agent.backtest.files import PRIVATE_FILE, private_folder
from trading_agent.errors import TransientBackendError

__all__ = ["ATTEMPTS", "BoundedModel", "ModelSlots"]

ATTEMPTS = 8
"""Times a rate-limited call is asked in all before the 429 goes to the loop."""
_POLL_SECONDS = 0.02
_LONGEST_BACKOFF = 60.0


class ModelSlots:
    """N slots shared by every process naming the same folder.

    Args:
        folder: Where the slots' lock files are (created 0700).
        count: How many calls may be in flight at once.
    """

    def __init__(self, folder: Path, count: int) -> None:
        if count < 1:
            raise ValueError("--concurrency must be 1 or more")
        self.folder = folder
        self.count = count
        self.in_flight = 0
        self.most_in_flight = 0

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Waits for a free slot, holds it for the block."""
        file = await self._take()
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            yield
        finally:
            self.in_flight -= 1
            fcntl.flock(file.fileno(), fcntl.LOCK_UN)
            file.close()

    async def _take(self) -> IO[bytes]:
        private_folder(self.folder)
        while True:
            for slot in range(self.count):
                descriptor = os.open(self.folder / f"slot-{slot}.lock",
                                     os.O_WRONLY | os.O_CREAT, PRIVATE_FILE)
                file = os.fdopen(descriptor, "wb")
                try:
                    fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    file.close()
                    continue
                return file
            await anyio.sleep(_POLL_SECONDS)


class BoundedModel:
    """A model asked through :class:`ModelSlots`, waiting out 429s.

    Args:
        inner: The model.
        slots: The shared slots.
        sleep: How a 429 is waited out (tests pass a fake).
    """

    def __init__(self, inner: ModelBackend, slots: ModelSlots,
                 sleep: Callable[[float], Awaitable[None]] = anyio.sleep) -> None:
        self.inner = inner
        self.slots = slots
        self.model = inner.model
        self.context_window = inner.context_window
        self.rate_limited = 0
        self._sleep = sleep

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # count_tokens, config...

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        """Asks the model holding a slot; a 429 is waited out and asked again."""
        for attempt in range(ATTEMPTS):
            async with self.slots.hold():
                try:
                    return await self.inner.complete(request, on_text, on_thinking)
                except TransientBackendError as exc:
                    if exc.status_code != 429 or attempt == ATTEMPTS - 1:
                        raise
                    wait = (exc.retry_after if exc.retry_after is not None
                            else min(_LONGEST_BACKOFF, 2.0 ** attempt))
                    self.rate_limited += 1
            await self._sleep(wait)  # the slot is free meanwhile
        raise AssertionError("unreachable: the last attempt returns or raises")
