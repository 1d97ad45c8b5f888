"""Cached prompt tokens in the store's daily usage, and the migration that added them to a
store written before they existed."""

from __future__ import annotations

from datetime import UTC, date, datetime

from tests.store.conftest import FakeClock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import UsageReported
from trading_agent.store import Store, StoreTarget
from trading_agent.store.database import Database
from trading_agent.store.schema import COMPONENT, MIGRATIONS

DAY = datetime(2025, 6, 1, 12, 0, tzinfo=UTC).timestamp()


def _usage(desk: str, prompt: int, cached: int) -> UsageReported:
    return UsageReported(desk=desk, input_tokens=prompt, output_tokens=50, estimated=False,
                         cost=0.01, context_tokens=prompt + 50, context_window=128_000, at=DAY,
                         cached_input_tokens=cached)


async def test_cached_tokens_add_up_per_desk_and_give_the_share(store: Store,
                                                                clock: FakeClock) -> None:
    bus = EventBus(first_id=1)
    await store.events.append_events([bus.publish(event) for event in (
        _usage("alpha", 4000, 0),       # the first request of the day: nothing cached yet
        _usage("alpha", 4200, 3968),
        _usage("alpha", 4400, 4096),
        _usage("beta", 1000, 0),
    )])

    alpha = await store.usage.usage_on("alpha", date(2025, 6, 1))
    assert (alpha.requests, alpha.input_tokens, alpha.cached_input_tokens) == (3, 12_600, 8064)
    assert alpha.cache_share == 8064 / 12_600
    beta = await store.usage.usage_on("beta", date(2025, 6, 1))
    assert (beta.cached_input_tokens, beta.cache_share) == (0, 0.0)
    assert (await store.usage.usage_on("nobody")).cache_share is None  # no prompt, no share

    clock.now = DAY
    await store.usage.add_usage("beta", input_tokens=2000, output_tokens=10, cost=None,
                          cached_input_tokens=1024)
    beta = await store.usage.usage_on("beta", date(2025, 6, 1))
    assert (beta.input_tokens, beta.cached_input_tokens) == (3000, 1024)


async def test_a_store_from_before_cached_tokens_is_migrated_and_keeps_its_days(
        target: StoreTarget) -> None:
    # The store as the previous release left it: schema version 1 and a day of usage.
    old = await Database.open(target, MIGRATIONS[:1], COMPONENT)
    await old.write(lambda connection: connection.execute(
        "INSERT INTO daily_usage (desk, day, requests, input_tokens, output_tokens, cost) "
        "VALUES ('alpha', '2025-06-01', 7, 9000, 700, 0.5)"))
    await old.close()

    store = await Store.open(target)
    try:
        before = await store.usage.usage_on("alpha", date(2025, 6, 1))
        assert (before.requests, before.input_tokens, before.output_tokens, before.cost,
                before.cached_input_tokens) == (7, 9000, 700, 0.5, 0)
        await store.events.append_events(
            [EventBus(first_id=1).publish(_usage("alpha", 3000, 2048))])
        after = await store.usage.usage_on("alpha", date(2025, 6, 1))
        assert (after.requests, after.input_tokens, after.cached_input_tokens) == (
            8, 12_000, 2048)
    finally:
        await store.close()

    assert await _versions(target) == [("store", version) for version in range(1, 7)]
    # Opened again, nothing is applied twice.
    again = await Store.open(target)
    await again.close()
    assert await _versions(target) == [("store", version) for version in range(1, 7)]


async def _versions(target: StoreTarget) -> list[tuple[str, int]]:
    database = await Database.open(target)
    try:
        return await database.read(lambda connection: [tuple(row) for row in connection.execute(
            "SELECT component, version FROM schema_migrations WHERE component = 'store' "
            "ORDER BY version")])
    finally:
        await database.close()
