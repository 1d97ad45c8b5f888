"""The event bus never stalls a desk, numbers events in order, and reports what it dropped."""

from __future__ import annotations

import anyio
import anyio.lowlevel

from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import EventsDropped, TextDelta


async def test_events_reach_every_subscriber_in_order() -> None:
    bus = EventBus()
    with bus.subscribe("a") as first, bus.subscribe("b") as second:
        for piece in ("one", "two", "three"):
            bus.publish(TextDelta(desk="d", text=piece))
        for subscription in (first, second):
            got = [await subscription.get() for _ in range(3)]
            assert [e.text for e in got if isinstance(e, TextDelta)] == ["one", "two", "three"]
            assert [e.id for e in got] == [1, 2, 3]


async def test_a_slow_subscriber_loses_only_its_own_events_and_is_told_how_many() -> None:
    bus = EventBus()
    slow = bus.subscribe("slow", max_buffer=2)
    fast = bus.subscribe("fast")
    for index in range(5):
        bus.publish(TextDelta(desk="d", text=str(index)))  # never blocks
    report = await slow.get()
    assert isinstance(report, EventsDropped)
    assert (report.subscriber, report.count) == ("slow", 3)
    assert [e.text for e in [await slow.get(), await slow.get()]
            if isinstance(e, TextDelta)] == ["0", "1"]
    assert slow.get_nowait() is None
    assert len([fast.get_nowait() for _ in range(5)]) == 5
    assert fast.dropped_total == 0
    slow.close()
    fast.close()


async def test_a_child_bus_tags_events_for_subagents() -> None:
    bus = EventBus()
    with bus.subscribe("watcher") as watcher:
        bus.child(subagent="sub-1", parent_call="call-9").publish(TextDelta(desk="d", text="x"))
        event = await watcher.get()
        assert (event.subagent, event.parent_call, event.desk) == ("sub-1", "call-9", "d")


async def test_closing_ends_a_waiting_reader() -> None:
    bus = EventBus()
    subscription = bus.subscribe("reader")
    received: list[object] = []

    async def read() -> None:
        async for event in subscription:
            received.append(event)

    async with anyio.create_task_group() as group:
        group.start_soon(read)
        await anyio.lowlevel.checkpoint()
        bus.publish(TextDelta(desk="d", text="hello"))
        await anyio.lowlevel.checkpoint()
        subscription.close()
    assert len(received) == 1
