"""Blocking calls go to a worker thread, except inside a batch job's ``blocking_inline``."""

from __future__ import annotations

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
