"""Waiting on state, the one way a test waits for something to happen.

A test that slept a fixed time and then looked was either slow (the time was generous) or
flaky (on a loaded machine it was not). :func:`wait_until` polls what the test is about to
check, in short steps, until it holds or a bounded deadline passes, and then fails naming what
it waited for.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

__all__ = ["wait_until"]

T = TypeVar("T")


async def wait_until(condition: Callable[[], T | Awaitable[T]], what: str,
                     within: float = 10.0, step: float = 0.01) -> T:
    """Polls ``condition`` (sync or async) until its value is truthy; returns that value.

    Args:
        condition: What the test is about to check; its truthy value is handed back, so a
            test can wait for a list to fill and unpack it in one line.
        what: Said in the failure, as in "timed out waiting for <what>".
        within: The deadline in seconds (generous: it is only reached when the test fails).
        step: How long to wait between two looks.

    Returns:
        The condition's first truthy value.

    Raises:
        AssertionError: It did not hold within ``within`` seconds.
    """
    try:
        with anyio.fail_after(within):
            while True:
                value: Any = condition()
                if inspect.isawaitable(value):
                    value = await value
                if value:
                    return value  # type: ignore[no-any-return]
                await anyio.sleep(step)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what} (within {within} s)") from None
