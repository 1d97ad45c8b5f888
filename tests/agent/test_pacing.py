"""Many desks stepping at once share the event loop in slices: timers run between them, every
desk goes on in its turn, and one cancelled while it waits holds no one up."""

from __future__ import annotations

import time

import anyio
import anyio.lowlevel
import pytest

from trading_agent.agent import pacing
from trading_agent.agent.pacing import SLICE_SECONDS, pace

_STEPS = 200
_STEP_SECONDS = 0.001


def _work(seconds: float) -> None:
    """Busy CPU work on the loop's thread, as a desk's step is."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


async def test_a_timer_fires_between_slices_while_hundreds_of_desks_step_at_once() -> None:
    done: list[int] = []
    seen_by_timer: list[int] = []

    async def desk(number: int) -> None:
        await pace()
        _work(_STEP_SECONDS)
        done.append(number)

    async def timer() -> None:
        await anyio.sleep(SLICE_SECONDS / 10)
        seen_by_timer.append(len(done))

    async with anyio.create_task_group() as group:
        group.start_soon(timer)
        for number in range(_STEPS):
            group.start_soon(desk, number)
    assert seen_by_timer and seen_by_timer[0] < _STEPS, (
        f"the timer ran only after {seen_by_timer} of {_STEPS} steps: the loop never polled "
        "between slices")
    assert sorted(done) == list(range(_STEPS)), "a desk never went on"
    assert done == list(range(_STEPS)), "desks went on out of the order they waited in"


async def test_a_desk_cancelled_while_it_waits_holds_no_one_up() -> None:
    done: list[int] = []

    async def desk(number: int) -> None:
        await pace()
        _work(_STEP_SECONDS)
        done.append(number)

    async with anyio.create_task_group() as group:
        for number in range(50):
            group.start_soon(desk, number)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await pace()  # cancelled wherever it stands: waiting or not
        async with anyio.create_task_group() as doomed:
            doomed.start_soon(desk, -1)
            await anyio.lowlevel.checkpoint()
            doomed.cancel_scope.cancel()
    assert sorted(done) == list(range(50))
    with anyio.fail_after(5):
        await pace()  # the line is empty again: no stale waiter left in it


async def test_a_clock_that_stands_still_between_ticks_never_stops_the_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Every desk found the slice used up (the clock is far past its start), and the next tick
    # reads the same instant as the slice's start: a step's cost of zero must not stop them.
    instants = iter([0.0, 1.0])
    monkeypatch.setattr(pacing.time, "perf_counter", lambda: next(instants, 1.0))
    done: list[int] = []

    async def desk(number: int) -> None:
        await pace()
        done.append(number)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            for number in range(20):
                group.start_soon(desk, number)
    assert done == list(range(20))


async def test_dear_steps_after_many_cheap_ones_are_not_let_go_all_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst as hundreds of desks wake: each takes its trigger (cheap), then builds and
    sends its request (dear). The dear steps' cost, seen in the burst before, is remembered
    through the cheap ones, so one pass of the loop does not let go many more dear steps than
    fit in a slice. (On a clock the steps move, so that the machine's load plays no part.)"""
    now = [0.0]
    monkeypatch.setattr(pacing.time, "perf_counter", lambda: now[0])
    desks, cheap, dear = 400, 0.00005, 0.001
    passes = 0
    dear_in_pass: dict[int, int] = {}
    stopped = False

    async def probe() -> None:  # runs once in each pass of the loop
        nonlocal passes
        while not stopped:
            passes += 1
            await anyio.lowlevel.checkpoint()

    async def desk() -> None:
        await pace()
        now[0] += cheap
        await anyio.lowlevel.checkpoint()  # a store write: another pass
        await pace()
        now[0] += dear
        dear_in_pass[passes] = dear_in_pass.get(passes, 0) + 1

    async with anyio.create_task_group() as outer:
        outer.start_soon(probe)
        for _ in range(2):  # the first burst teaches the dear cost; the second is measured
            dear_in_pass.clear()
            async with anyio.create_task_group() as group:
                for _ in range(desks):
                    group.start_soon(desk)
        stopped = True
    fit = round(SLICE_SECONDS / dear)
    assert max(dear_in_pass.values()) <= 2 * fit, (
        f"one pass let go {max(dear_in_pass.values())} dear steps; {fit} fit in a slice")
