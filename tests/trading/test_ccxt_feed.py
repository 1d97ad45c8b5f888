"""CcxtPriceFeed against the fake Binance: one poll per feed, fanned out to every subscription."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import pytest

from trading_agent.trading.ccxt_exchange import CcxtExchange
from trading_agent.trading.ccxt_feed import CcxtPriceFeed
from trading_agent.trading.config import CcxtExchangeConfig
from trading_agent.trading.exchange import Candle
from trading_agent.trading.feed import CandleSubscription

from .binance_server import FakeBinance

KLINES = "/api/v3/klines"


class NextCandleArrives:
    """A sleep after which the fake exchange has completed one more candle."""

    def __init__(self, binance: FakeBinance) -> None:
        self.binance = binance
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        opened = self.binance.klines[-1][0] + 300_000
        self.binance.klines.append([opened, "16709.9", "16720.0", "16700.1", "16715.5", "321.5",
                                    opened + 299_999, "0", 1, "0", "0", "0"])
        await anyio.lowlevel.checkpoint()


@pytest.fixture
async def exchange(ccxt_config: CcxtExchangeConfig) -> AsyncIterator[CcxtExchange]:
    opened = await CcxtExchange.open(ccxt_config)
    await opened.markets()
    yield opened
    await opened.close()


async def read(subscription: CandleSubscription, count: int, into: list[Candle]) -> None:
    with subscription:
        for _ in range(count):
            into.append(await subscription.__anext__())
            await anyio.lowlevel.checkpoint()  # a reader doing some work


async def test_subscriptions_share_one_poll_and_each_gets_every_candle(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    sleep = NextCandleArrives(binance)
    feed = CcxtPriceFeed(exchange, ["BTC/USDT"], poll_seconds=7.0, sleep=sleep)
    received: list[list[Candle]] = [[], [], []]
    before = binance.count("GET", KLINES)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            for into in received:
                group.start_soon(read, feed.subscribe(), 3, into)
    await feed.close()

    # One request to note where the candles stand, then one per poll, whoever asked.
    assert binance.count("GET", KLINES) - before == 1 + len(sleep.delays)
    assert sleep.delays == [7.0] * 3
    assert received[0] == received[1] == received[2]
    assert [c.opened_at.isoformat() for c in received[0]] == [
        "2023-01-02T17:05:00+00:00", "2023-01-02T17:10:00+00:00", "2023-01-02T17:15:00+00:00"]


async def test_a_slow_reader_misses_nothing_and_a_closed_one_stops_nobody(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    sleep = NextCandleArrives(binance)
    feed = CcxtPriceFeed(exchange, ["BTC/USDT"], poll_seconds=7.0, sleep=sleep)
    fast: list[Candle] = []
    quitter: list[Candle] = []

    with anyio.fail_after(10), feed.subscribe() as slow:
        async with anyio.create_task_group() as group:
            group.start_soon(read, feed.subscribe(), 4, fast)
            group.start_soon(read, feed.subscribe(), 1, quitter)
        late = [await slow.__anext__() for _ in range(4)]  # queued while it was not reading

    await feed.close()
    assert late == fast
    assert quitter == fast[:1]
    assert binance.count("GET", KLINES) == 1 + len(sleep.delays)


async def test_closing_the_feed_ends_its_subscriptions(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    feed = CcxtPriceFeed(exchange, ["BTC/USDT"], sleep=NextCandleArrives(binance))
    subscription = feed.subscribe()

    await feed.close()

    with pytest.raises(StopAsyncIteration):
        await subscription.__anext__()
    assert binance.count("GET", KLINES) == 0
