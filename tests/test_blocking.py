"""Blocking calls (and heavy imports) go to a worker thread, except inside a batch job's
``blocking_inline``."""

from __future__ import annotations

import subprocess
import sys
import threading

import anyio

from trading_agent.blocking import blocking_inline, run_blocking


def _thread(_: object) -> int:
    return threading.get_ident()


async def test_blocking_calls_leave_the_loop_unless_a_batch_job_runs_them_inline() -> None:
    here = threading.get_ident()
    assert await run_blocking(_thread, None) != here
    with blocking_inline():
        assert await run_blocking(_thread, None) == here
        # Tasks started inside inherit it (a backtest's desk and services).
        seen: list[int] = []

        async def task() -> None:
            seen.append(await run_blocking(_thread, None))

        async with anyio.create_task_group() as group:
            group.start_soon(task)
        assert seen == [here]
    assert await run_blocking(_thread, None) != here  # and nothing else is affected


_IMPORT_WHILE_TICKING = """
import sys, time, anyio
from trading_agent.blocking import import_module

async def main():
    assert "openai" not in sys.modules
    gaps, done = [], anyio.Event()

    async def tick():
        last = time.perf_counter()
        while not done.is_set():
            await anyio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with anyio.create_task_group() as group:
        group.start_soon(tick)
        await anyio.sleep(0.05)
        began = time.perf_counter()
        modules = []

        async def load():
            modules.append(await import_module("trading_agent.backends.openai_compatible"))

        async with anyio.create_task_group() as loading:  # two desks starting at once
            loading.start_soon(load)
            loading.start_soon(load)
        took = time.perf_counter() - began
        done.set()
    module = sys.modules["trading_agent.backends.openai_compatible"]
    assert modules == [module, module] and hasattr(module, "OpenAICompatibleBackend")
    assert await import_module("trading_agent.backends.openai_compatible") is module
    print(took, max(gaps))

anyio.run(main)
"""


def test_a_heavy_import_on_first_use_leaves_the_loop_running() -> None:
    """A desk's first start imports the openai SDK (a second of CPU, several on a loaded
    machine): in a worker thread, the loop keeps ticking meanwhile. Inline, its longest
    pause was the whole import (1.9 s of 1.9 s on a loaded machine): long enough for a fleet
    daemon's 3 s lease to run out unrenewed."""
    done = subprocess.run([sys.executable, "-c", _IMPORT_WHILE_TICKING], capture_output=True,
                          text=True, timeout=50, check=False)
    assert done.returncode == 0, done.stderr
    took, longest_pause = map(float, done.stdout.split())
    assert longest_pause < took / 3, (took, longest_pause)
