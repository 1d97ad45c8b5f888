"""Where blocking work (SQLite, file I/O) runs: a worker thread, or inline in a batch job.

The daemon serves many desks on one event loop, so a blocking call goes to a worker thread
(``anyio.to_thread``) and never holds the others up. A backtest runs one desk on a loop of
its own, step by step, with its throwaway store in memory: there, handing each write to a
thread and back costs more than the write. :func:`blocking_inline` lets such a batch job run
the same calls inline, for the code it runs inside (a context variable, so nothing else in
the process is affected).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TypeVar

import anyio.to_thread

__all__ = ["blocking_inline", "run_blocking"]

T = TypeVar("T")
A = TypeVar("A")

_INLINE: ContextVar[bool] = ContextVar("trading_agent_blocking_inline", default=False)


@contextlib.contextmanager
def blocking_inline() -> Iterator[None]:
    """Blocking calls made inside this block (and the tasks it starts) run inline."""
    token = _INLINE.set(True)
    try:
        yield
    finally:
        _INLINE.reset(token)


async def run_blocking(call: Callable[[A], T], argument: A) -> T:
    """``call(argument)`` in a worker thread, or inline inside :func:`blocking_inline`."""
    if _INLINE.get():
        await anyio.lowlevel.checkpoint()
        return call(argument)
    return await anyio.to_thread.run_sync(call, argument)
