"""Text with a lone UTF-16 surrogate (half an emoji from a broken model stream) is stored,
and nothing unexpected in an event batch stops the store's persister."""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable

import anyio

from tests.store.test_records import wait_until
from trading_agent.agent.conversation import Message, TextBlock, ToolResultBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import ErrorEvent, Event, TurnStarted
from trading_agent.store import Store, StoreTarget
from trading_agent.store.event_log import DEFAULT_SKIPPED_EVENTS, SqliteEventLog

HALF_EMOJI = "\ud83d"


async def test_a_message_with_a_lone_surrogate_is_stored_and_restored(store: Store) -> None:
    message = Message(role="assistant", content=(TextBlock(f"up {HALF_EMOJI} today"),))
    result = Message(role="user", kind="tool_results", content=(
        ToolResultBlock(tool_use_id="c1", content=(TextBlock(f"x{HALF_EMOJI}"),)),))
    await store.transcripts.append_message("alpha", message)
    await store.transcripts.append_message("alpha", result)
    page = await store.transcripts.transcript("alpha")
    assert [row["text"] for row in page] == [f"up {HALF_EMOJI} today", ""]
    restored = await store.transcripts.restore_conversation("alpha", "p")
    texts = [block.text for m in restored.messages for block in m.content
             if isinstance(block, TextBlock)]
    assert f"up {HALF_EMOJI} today" in texts


async def test_an_event_with_a_lone_surrogate_is_stored_and_the_persister_goes_on(
        store: Store) -> None:
    bus = EventBus()
    subscription = bus.subscribe("store")
    async with anyio.create_task_group() as group:
        group.start_soon(store.events.persist_events, subscription)
        bus.publish(TurnStarted(desk="alpha", turn="t1", trigger_kind="operator",
                                trigger_text=f"hi {HALF_EMOJI}"))
        with anyio.fail_after(5):
            while len(await store.events.events_since(0)) < 1:  # noqa: ASYNC110
                await anyio.sleep(0.005)
        bus.publish(ErrorEvent(desk="alpha", message="after", error_type="E"))
        subscription.close()
    events = await store.events.events_since(0)
    assert [e["type"] for e in events] == ["turn_start", "error"]
    assert events[0]["trigger_text"] == f"hi {HALF_EMOJI}"
    assert store.events.events_not_stored == 0


class _BrokenEventLog(SqliteEventLog):
    """An event log whose first write fails with an error nobody expected."""

    broken = True

    async def append_events(self, events: Iterable[Event], *,
                            skip: Collection[str] = DEFAULT_SKIPPED_EVENTS) -> int:
        if self.broken:
            self.broken = False
            raise RuntimeError("a bug in the store")
        return await super().append_events(events, skip=skip)


async def test_an_unexpected_error_in_a_batch_is_counted_and_the_persister_goes_on(
        target: StoreTarget) -> None:
    store = await Store.open(target)
    events = _BrokenEventLog(store.database)

    async def sleep(seconds: float) -> None:
        pass

    bus = EventBus()
    subscription = bus.subscribe("store")
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(functools.partial(events.persist_events, subscription,
                                               sleep=sleep))
            bus.publish(ErrorEvent(desk="alpha", message="0", error_type="E"))
            await wait_until(lambda: not events.broken)
            await anyio.sleep(0.05)  # the first batch is retried and written
            bus.publish(ErrorEvent(desk="alpha", message="1", error_type="E"))
            subscription.close()
        assert [e["message"] for e in await events.events_since(0)] == ["0", "1"]
        assert events.events_not_stored == 0
    finally:
        await store.close()
