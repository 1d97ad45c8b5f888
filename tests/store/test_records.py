"""Events, operator messages, schedule state and daily usage in the store."""

from __future__ import annotations

import dataclasses
import functools
import sqlite3
from collections.abc import Callable, Collection, Iterable
from datetime import UTC, date, datetime
from pathlib import Path

import anyio
import pytest

from tests.store.conftest import FakeClock
from trading_agent.agent.conversation import Conversation, ImageBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import (
    ErrorEvent,
    Event,
    TextDelta,
    ToolHeartbeat,
    TurnStarted,
    UsageReported,
)
from trading_agent.agent.steering_inbox import SteeringMessage
from trading_agent.agent.trigger import Trigger
from trading_agent.errors import StoreError
from trading_agent.store import Store, StoreTarget
from trading_agent.store.event_log import DEFAULT_SKIPPED_EVENTS, SqliteEventLog

DAY_ONE = datetime(2025, 6, 1, 12, 0, tzinfo=UTC).timestamp()
DAY_TWO = datetime(2025, 6, 2, 0, 30, tzinfo=UTC).timestamp()


def _usage(desk: str, at: float, cost: float | None = 0.5, subagent: str | None = None
           ) -> UsageReported:
    return UsageReported(desk=desk, input_tokens=100, output_tokens=20, estimated=False,
                         cost=cost, context_tokens=120, context_window=8192, at=at,
                         subagent=subagent)


async def test_persist_events_drains_a_bus_subscription_and_skips_deltas(store: Store) -> None:
    bus = EventBus(first_id=await store.events.last_event_id() + 1)
    subscription = bus.subscribe("store")
    async with anyio.create_task_group() as group:
        group.start_soon(store.events.persist_events, subscription)
        bus.publish(TurnStarted(desk="alpha", turn="t1", trigger_kind="tick", trigger_text="x"))
        for piece in ("Hel", "lo"):
            bus.publish(TextDelta(desk="alpha", turn="t1", text=piece))
        bus.publish(ToolHeartbeat(desk="alpha", turn="t1", call_id="c", name="n", elapsed=5))
        bus.publish(ErrorEvent(desk="beta", turn="t2", message="boom", error_type="X"))
        subscription.close()  # what is buffered is written, then persist_events returns

    stored = await store.events.events_since(0)
    assert [(e["id"], e["type"], e["desk"]) for e in stored] == [
        (1, "turn_start", "alpha"), (5, "error", "beta")]
    assert stored[0]["turn"] == "t1" and stored[0]["trigger_kind"] == "tick"
    assert await store.events.events_since(1) == stored[1:]
    assert [e["type"] for e in await store.events.events_since(0, desk="alpha")] == ["turn_start"]
    assert len(await store.events.events_since(0, limit=1)) == 1
    # The skipped deltas' ids count: a restarted bus never reuses an id a stream has seen.
    bus2 = EventBus(first_id=await store.events.last_event_id() + 1)
    assert bus2.publish(TurnStarted(desk="alpha", trigger_kind="t", trigger_text="")).id == 6


async def test_storing_an_event_twice_keeps_one(store: Store) -> None:
    event = ErrorEvent(desk="alpha", message="m", error_type="E", id=7)
    assert await store.events.append_events([event]) == 1
    assert await store.events.append_events([event]) == 0
    assert len(await store.events.events_since(0)) == 1


async def test_a_subscriptions_drop_report_is_not_stored_as_an_event(store: Store) -> None:
    bus = EventBus()
    subscription = bus.subscribe("store", max_buffer=2)
    for i in range(5):
        bus.publish(ErrorEvent(desk="alpha", message=str(i), error_type="E"))
    subscription.close()
    await store.events.persist_events(subscription)
    assert [e["message"] for e in await store.events.events_since(0)] == ["0", "1"]


async def test_usage_events_add_up_per_desk_and_utc_day(store: Store, clock: FakeClock) -> None:
    await store.events.append_events([dataclasses.replace(_usage("alpha", DAY_ONE), id=1)])
    events = [
        _usage("alpha", DAY_ONE),
        _usage("alpha", DAY_ONE, subagent="sub1"),  # a subagent's request counts for its desk
        _usage("alpha", DAY_TWO, cost=None),
        _usage("beta", DAY_ONE, cost=None),
    ]
    bus = EventBus(first_id=10)
    await store.events.append_events([bus.publish(event) for event in events])

    one = await store.usage.usage_on("alpha", date(2025, 6, 1))
    assert (one.requests, one.input_tokens, one.output_tokens) == (3, 300, 60)
    assert one.cost == 1.5 and one.total_tokens == 360
    two = await store.usage.usage_on("alpha", date(2025, 6, 2))
    assert (two.requests, two.cost) == (1, None)
    beta = await store.usage.usage_on("beta", date(2025, 6, 1))
    assert (beta.requests, beta.cost) == (1, None)

    clock.now = DAY_TWO
    await store.usage.add_usage("alpha", input_tokens=5, output_tokens=5, cost=0.25)
    today = await store.usage.usage_on("alpha")
    assert today.day == date(2025, 6, 2)
    assert (today.requests, today.total_tokens, today.cost) == (2, 130, 0.25)
    assert (await store.usage.usage_on("nobody")).requests == 0


async def test_an_operator_message_is_kept_until_its_message_is_appended(
        store: Store, clock: FakeClock) -> None:
    picture = ImageBlock(b"\x89PNG-screenshot", description="screenshot")
    first = SteeringMessage(text="Close the BTC position", source="ann", images=(picture,),
                            queued_at=DAY_ONE)
    second = SteeringMessage(text="And report", source="bob", queued_at=DAY_ONE + 1)
    await store.inbox.add_operator_message("alpha", first)
    await store.inbox.add_operator_message("alpha", second)
    await store.inbox.add_operator_message("alpha", first)  # a retried request adds nothing
    await store.inbox.add_operator_message("beta", SteeringMessage(text="other desk"))

    # The daemon stops before delivering them; on restart both come back, in order, whole.
    await store.close()
    store = await Store.open(store.target, clock=clock)
    try:
        waiting = await store.inbox.undelivered_operator_messages("alpha")
        assert [(m.id, m.text, m.source, m.queued_at) for m in waiting] == [
            (first.id, first.text, "ann", DAY_ONE), (second.id, second.text, "bob", DAY_ONE + 1)]
        assert waiting[0].images == (picture,)

        # Re-queued: one starts a turn (a trigger with its id), one steers (same id).
        conversation = Conversation("p", observer=store.transcripts.observer("alpha"))
        message = waiting[0]
        await conversation.append(Trigger(kind="operator", text=message.text,
                                          source=message.source, images=message.images,
                                          id=message.id, at=message.queued_at).to_message())
        assert [m.id for m in await store.inbox.undelivered_operator_messages("alpha")] == [
            second.id]
        await conversation.append(waiting[1].to_message())
        assert await store.inbox.undelivered_operator_messages("alpha") == []
        assert len(await store.inbox.undelivered_operator_messages("beta")) == 1
    finally:
        await store.close()


async def test_a_subagent_message_with_the_same_id_does_not_deliver(store: Store) -> None:
    message = SteeringMessage(text="hi")
    await store.inbox.add_operator_message("alpha", message)
    await store.transcripts.append_message("alpha", message.to_message(), subagent_id="sub1")
    assert len(await store.inbox.undelivered_operator_messages("alpha")) == 1


async def test_schedule_state_keeps_the_last_slot_per_schedule(store: Store) -> None:
    slot = datetime(2025, 6, 1, 9, 0, tzinfo=UTC)
    later = datetime(2025, 6, 1, 9, 30, tzinfo=UTC)
    await store.schedules.record_schedule_fired("alpha", "every 30m", slot)
    await store.schedules.record_schedule_fired("alpha", "morning", slot)
    await store.schedules.record_schedule_fired("alpha", "every 30m", later)
    await store.schedules.record_schedule_fired("beta", "every 30m", slot)
    assert await store.schedules.schedule_last_fired("alpha") == {
        "every 30m": later, "morning": slot}
    assert (await store.schedules.schedule_last_fired("alpha"))["morning"].tzinfo is not None
    assert await store.schedules.schedule_last_fired("nobody") == {}


async def test_a_schedules_trigger_is_stored_with_its_slot(store: Store) -> None:
    slot = datetime(2025, 6, 1, 9, 0, tzinfo=UTC)
    trigger = Trigger(kind="schedule", text="Morning review.", source="morning",
                      at=slot.timestamp()).to_message()
    await store.transcripts.append_message("alpha", trigger, fired_schedule=("morning", slot))
    assert await store.schedules.schedule_last_fired("alpha") == {"morning": slot}
    assert [row["text"] for row in await store.transcripts.transcript("alpha")] == [
        trigger.text]


async def test_a_slot_that_cannot_be_stored_leaves_its_trigger_unstored_too(
        db_path: Path) -> None:
    """One transaction: a crash (here, a refused write) leaves both or neither, so the slot
    fires again after a restart and no stored trigger is answered twice."""
    store = await Store.open(db_path)
    try:
        with sqlite3.connect(db_path) as connection:
            connection.execute("CREATE TRIGGER refuse BEFORE INSERT ON schedule_state "
                               "BEGIN SELECT RAISE(ABORT, 'refused'); END")
        slot = datetime(2025, 6, 1, 9, 0, tzinfo=UTC)
        trigger = Trigger(kind="schedule", text="Morning review.", source="morning",
                          at=slot.timestamp()).to_message()
        with pytest.raises(StoreError, match="refused"):
            await store.transcripts.append_message("alpha", trigger,
                                                   fired_schedule=("morning", slot))
        assert await store.transcripts.transcript("alpha") == []
        assert await store.schedules.schedule_last_fired("alpha") == {}
    finally:
        await store.close()


class _FailingEventLog(SqliteEventLog):
    """An event log whose first ``failures`` writes fail as SQLite would."""

    failures = 0

    async def append_events(self, events: Iterable[Event], *,
                            skip: Collection[str] = DEFAULT_SKIPPED_EVENTS) -> int:
        if self.failures:
            self.failures -= 1
            raise StoreError("database or disk is full")
        return await super().append_events(events, skip=skip)


@pytest.mark.parametrize(("failures", "stored", "dropped"), [(1, ["0", "1"], 0),
                                                             (2, ["1"], 1)])
async def test_a_batch_the_store_refuses_is_retried_once_then_dropped_and_counted(
        target: StoreTarget, failures: int, stored: list[str], dropped: int) -> None:
    store = await Store.open(target)
    events = _FailingEventLog(store.database)
    events.failures = failures
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    bus = EventBus()
    subscription = bus.subscribe("store")
    bus.publish(ErrorEvent(desk="alpha", message="0", error_type="E"))
    async with anyio.create_task_group() as group:
        group.start_soon(functools.partial(events.persist_events, subscription,
                                           retry_after=0.25, sleep=sleep))
        await wait_until(lambda: events.failures == 0)
        await anyio.sleep(0.05)  # the first batch is written or dropped
        bus.publish(ErrorEvent(desk="alpha", message="1", error_type="E"))
        subscription.close()
    try:
        assert [e["message"] for e in await events.events_since(0)] == stored
        assert events.events_not_stored == dropped
        assert waits == [0.25]  # one wait before the one retry
    finally:
        await store.close()


async def wait_until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.001)
