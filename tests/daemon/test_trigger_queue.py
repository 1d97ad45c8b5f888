"""The desk's trigger queue: ticks coalesce, people go first, nothing else is dropped."""

from __future__ import annotations

import anyio

from trading_agent.agent.trigger import Trigger
from trading_agent.daemon.trigger_queue import TriggerQueue


def _drain(queue: TriggerQueue) -> list[Trigger]:
    taken = []
    while (trigger := queue.take()) is not None:
        taken.append(trigger)
    return taken


def test_ticks_of_one_symbol_coalesce_to_the_newest_with_a_count() -> None:
    queue = TriggerQueue()
    for price in ("100", "101", "102"):
        queue.put(Trigger(kind="tick", text=f"BTC at {price}", source="BTC/USDT"))
    queue.put(Trigger(kind="tick", text="ETH at 5", source="ETH/USDT"))
    queue.put(Trigger(kind="tick", text="BTC at 103", source="BTC/USDT"))

    taken = _drain(queue)

    assert [(t.source, t.text, t.merged) for t in taken] == [
        ("BTC/USDT", "BTC at 103", 4), ("ETH/USDT", "ETH at 5", 1)]
    assert "tick, 4 merged" in taken[0].to_message().text


def test_schedules_are_never_merged_and_operator_messages_go_first() -> None:
    queue = TriggerQueue()
    queue.put(Trigger(kind="schedule", text="hourly", source="every 1h"))
    queue.put(Trigger(kind="tick", text="move", source="BTC/USDT"))
    queue.put(Trigger(kind="schedule", text="hourly again", source="every 1h"))
    queue.put(Trigger(kind="operator", text="first", source="ann"))
    queue.put(Trigger(kind="operator", text="second", source="bob"))
    queue.put_first(Trigger(kind="resume", text="carry on"))

    assert [t.text for t in _drain(queue)] == [
        "carry on", "first", "second", "hourly", "move", "hourly again"]


def test_a_trigger_already_queued_is_not_queued_twice() -> None:
    queue = TriggerQueue()
    message = Trigger(kind="operator", text="hello", id="m1")
    queue.put(message)
    queue.put(Trigger(kind="operator", text="hello", id="m1"))
    queue.put_first(message)

    assert len(queue) == 1
    assert "m1" in queue
    assert queue.take() is message
    assert "m1" not in queue


async def test_wait_returns_when_a_trigger_arrives_or_on_wake() -> None:
    queue = TriggerQueue()
    async with anyio.create_task_group() as group:
        group.start_soon(queue.wait)
        await anyio.sleep(0.01)
        queue.put(Trigger(kind="schedule", text="x"))
    with anyio.fail_after(1):
        await queue.wait()  # one waits: returns at once
    queue.take()
    async with anyio.create_task_group() as group:
        group.start_soon(queue.wait)
        await anyio.sleep(0.01)
        queue.wake()
