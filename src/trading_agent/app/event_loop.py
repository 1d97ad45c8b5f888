"""The event loop the daemon runs on (``daemon.event_loop``).

Every desk's turn runs on one event loop: its requests, the model's streamed answers, the
store's writes and the events all pass through the loop's callbacks and sockets. uvloop (the
libuv loop, a drop-in for asyncio's) does that work in C. Measured by
``bench/desks_scale.py --history 1000 --loop auto|asyncio`` (500 desks of 1,000 messages
all woken at once, six runs of each in turn on one machine): the longest stall of the loop
16-21 ms against 20-35 ms on asyncio's own loop, the p99 trigger-to-request delay 330-412 ms
(median 371) against 334-509 ms (median 395).

- ``auto`` (the default): uvloop where it is installed (a dependency on Linux and macOS),
  asyncio's loop elsewhere;
- ``uvloop``: uvloop or the daemon refuses to start, saying so;
- ``asyncio``: the standard library's loop (to tell a uvloop fault from one of ours).

Nothing else changes with the loop: the daemon uses no API one has and the other lacks
(anyio stands between them); the test suite runs the daemon's process on uvloop and its
parts, in the tests' own process, on asyncio's loop.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

import anyio

from trading_agent.errors import ConfigError

__all__ = ["EventLoopChoice", "loop_name", "run", "uses_uvloop"]

EventLoopChoice = Literal["auto", "uvloop", "asyncio"]

T = TypeVar("T")


def uses_uvloop(choice: EventLoopChoice) -> bool:
    """Whether ``choice`` runs on uvloop here.

    Raises:
        ConfigError: ``uvloop`` was asked for and is not installed.
    """
    if choice == "asyncio":
        return False
    installed = importlib.util.find_spec("uvloop") is not None
    if choice == "uvloop" and not installed:
        raise ConfigError('daemon.event_loop = "uvloop", but uvloop is not installed on this '
                          'machine; allowed: "auto" (uvloop where installed), "uvloop", '
                          '"asyncio"')
    return installed


def run(func: Callable[[], Awaitable[T]], choice: EventLoopChoice = "auto") -> T:
    """Runs ``func`` to its end on the event loop ``choice`` names.

    Raises:
        ConfigError: ``uvloop`` was asked for and is not installed.
    """
    return anyio.run(func, backend="asyncio",
                     backend_options={"use_uvloop": uses_uvloop(choice)})


def loop_name() -> str:
    """The running event loop's kind, for the start-up line: ``uvloop`` or ``asyncio``."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
