"""Each desk's equity samples in the store: kept across a reopen, bounded by thinning the
older half, and added by migration 4 to a store written before they existed."""

from __future__ import annotations

import itertools
import math

import pytest

from tests.store.conftest import FakeClock
from trading_agent.store import Store, StoreTarget
from trading_agent.store.database import Database
from trading_agent.store.schema import COMPONENT, MIGRATIONS


async def test_samples_are_kept_per_desk_in_time_order_across_a_reopen(
        store: Store, target: StoreTarget, clock: FakeClock) -> None:
    await store.equity.record_equity_sample("alpha", 10_000.0)  # now, from the store's clock
    await store.equity.record_equity_sample("beta", 5_000.0, at=clock.now + 1)
    await store.equity.record_equity_sample("alpha", 9_999.17, at=clock.now + 60)
    await store.equity.record_equity_sample("alpha", 9_998.5, at=clock.now + 30)  # late but earlier

    expected = [(clock.now, 10_000.0), (clock.now + 30, 9_998.5), (clock.now + 60, 9_999.17)]
    assert await store.equity.equity_samples("alpha") == expected
    assert await store.equity.equity_samples("beta") == [(clock.now + 1, 5_000.0)]
    assert await store.equity.equity_samples("gamma") == []

    await store.close()
    async with await Store.open(target) as again:
        assert await again.equity.equity_samples("alpha") == expected


async def test_a_long_history_stays_bounded_whole_recently_and_even_before(
        store: Store) -> None:
    keep, life = 40, 60.0 * 999
    for minute in range(1000):
        await store.equity.record_equity_sample("alpha", 10_000.0 + minute, at=60.0 * minute,
                                         keep=keep)
        if minute % 97 == 0:
            assert len(await store.equity.equity_samples("alpha")) <= keep
    await store.equity.record_equity_sample("beta", 1.0, at=0.0, keep=keep)

    samples = await store.equity.equity_samples("alpha")
    assert len(samples) <= keep
    times = [at for at, _ in samples]
    # The desk's first sample and its newest stay: the chart spans its whole life.
    assert samples[0] == (0.0, 10_000.0) and samples[-1] == (life, 10_999.0)
    # The newest half is whole, a minute apart; before it, samples spread over the whole
    # life with no hole wider than two of its keep // 4 stretches.
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert gaps[-keep // 2:] == [60.0] * (keep // 2)
    assert max(gaps) <= 2 * life / (keep // 4)
    assert await store.equity.equity_samples("beta") == [(0.0, 1.0)]  # another desk is untouched


@pytest.mark.parametrize("equity", [math.nan, math.inf, -math.inf])
async def test_a_sample_that_is_no_number_is_refused_with_the_desk_named(
        store: Store, equity: float) -> None:
    with pytest.raises(ValueError, match="desk alpha: an equity sample must be a finite "):
        await store.equity.record_equity_sample("alpha", equity)
    assert await store.equity.equity_samples("alpha") == []


async def test_a_store_from_before_equity_samples_is_migrated(target: StoreTarget) -> None:
    # The store as the previous release left it: schema version 3, a desk on hold.
    old = await Database.open(target, MIGRATIONS[:3], COMPONENT)
    await old.write(lambda connection: connection.execute(
        "INSERT INTO desk_holds (desk, held_by, reason, held_at, until) "
        "VALUES ('alpha', 'erin', 'FOMC', 1.0, NULL)"))
    await old.close()

    async with await Store.open(target) as store:
        hold = await store.holds.desk_hold("alpha")
        assert hold is not None and hold.reason == "FOMC"
        await store.equity.record_equity_sample("alpha", 10_000.0, at=5.0)
        assert await store.equity.equity_samples("alpha") == [(5.0, 10_000.0)]
