"""Where blocking work (SQLite, file I/O, a heavy import) runs: a worker thread, or inline in
a batch job.

The daemon serves many desks on one event loop, so a blocking call goes to a worker thread
(``anyio.to_thread``) and never holds the others up. A backtest runs one desk on a loop of
its own, step by step, with its throwaway store in memory: there, handing each write to a
thread and back costs more than the write. :func:`blocking_inline` lets such a batch job run
the same calls inline, for the code it runs inside (a context variable, so nothing else in
the process is affected).

The packages a desk imports only when it starts (the openai and anthropic SDKs, ccxt) take
a second or more of CPU each on a loaded machine: :func:`import_module` loads them in a worker
thread, so a desk's first start does not stall the loop (the other desks' turns, and a fleet
daemon's lease renewals, which a stall of a few seconds lets run out).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from types import ModuleType
from typing import TypeVar

import anyio.to_thread

__all__ = ["blocking_inline", "import_module", "run_blocking"]

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


async def import_module(name: str) -> ModuleType:
    """The module ``name``, imported in a worker thread the first time (Python's import
    locks make a concurrent import of it anywhere else wait for this one, then share it: a
    module another task is still importing is waited for in a worker thread too)."""
    module = sys.modules.get(name)
    if module is not None and not getattr(module.__spec__, "_initializing", False):
        return module
    return await run_blocking(importlib.import_module, name)
