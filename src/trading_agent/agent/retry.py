"""Retrying transient model failures: exponential backoff with jitter, honouring Retry-After.

The sleep is injectable (tests run backoff in microseconds) and cancellable (it is an anyio
sleep, so a shutdown interrupts it at once).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from trading_agent.errors import TransientBackendError

__all__ = ["RETRY_AFTER_CAP_SECONDS", "RetryPolicy"]

RETRY_AFTER_CAP_SECONDS = 60.0
"""The longest a server's Retry-After is honoured."""


@dataclass
class RetryPolicy:
    """How often and how long to wait before asking the model again.

    Attributes:
        max_retries: Retries after the first attempt.
        base_delay: The first backoff, in seconds; doubled each retry.
        max_delay: The longest backoff.
        sleep: The sleep to use (``anyio.sleep``; a test passes a fast one).
        jitter_source: Returns a number in [0, 1) for the jitter.
    """

    max_retries: int = 3
    base_delay: float = 1.0
    max_delay: float = 30.0
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep
    jitter_source: Callable[[], float] = field(default=random.random)

    def delay(self, attempt: int, error: TransientBackendError) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based).

        A server's Retry-After wins (capped at a minute); else exponential backoff with
        jitter between half and the whole of the step.
        """
        if error.retry_after is not None and error.retry_after >= 0:
            return min(error.retry_after, RETRY_AFTER_CAP_SECONDS)
        step = min(self.base_delay * 2.0 ** (attempt - 1), self.max_delay)
        return step * (0.5 + 0.5 * self.jitter_source())
