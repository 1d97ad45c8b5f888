"""Market triggers from a replayed feed: moves since the desk last looked, candle closes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import anyio

from trading_agent.agent.trigger import Trigger
from trading_agent.daemon.trigger_queue import TriggerQueue
from trading_agent.daemon.triggers import MarketWatcher
from trading_agent.trading.exchange import Candle
from trading_agent.trading.replay import ReplayFeed

START = datetime(2024, 1, 1, 10, 0, tzinfo=UTC)


def _candles(symbol: str, closes: list[str]) -> list[Candle]:
    candles = []
    for index, close in enumerate(closes):
        price = Decimal(close)
        candles.append(Candle(symbol, "5m", START + timedelta(minutes=5 * index), price,
                              price, price, price, Decimal(1)))
    return candles


async def _watch(watcher: MarketWatcher, feed: ReplayFeed, steps: int) -> None:
    """Publishes ``steps`` steps one at a time and lets the watcher read each."""
    async with anyio.create_task_group() as group:
        await group.start(watcher.run)
        for _ in range(steps):
            feed.advance()
            for _ in range(20):
                await anyio.lowlevel.checkpoint()
        group.cancel_scope.cancel()


async def test_a_tick_fires_on_a_move_since_the_desk_last_looked() -> None:
    feed = ReplayFeed({"BTC/USDT": _candles("BTC/USDT", ["100", "100.5", "101", "101.5", "99"]),
                       "ETH/USDT": _candles("ETH/USDT", ["10", "20", "30", "40", "50"])},
                      speed=0, start_offset=1)
    queue = TriggerQueue()
    watcher = MarketWatcher(feed, ["BTC/USDT"], queue.put, move_percent=1.0)

    await _watch(watcher, feed, 4)

    ticks = []
    while (trigger := queue.take()) is not None:
        ticks.append(trigger)
    # 101 and 101.5 are 1% or more above 100 (the desk never looked), so they merged; 99 is
    # 1% below. ETH is not the desk's.
    assert [(t.source, t.merged) for t in ticks] == [("BTC/USDT", 3)]
    assert "moved -1.00% since you last looked: 100 -> 99" in ticks[0].text


async def test_the_mark_moves_when_the_desk_takes_the_tick() -> None:
    feed = ReplayFeed({"BTC/USDT": _candles("BTC/USDT", ["100", "101", "101.5", "102.1"])},
                      speed=0, start_offset=1)
    fired: list[Trigger] = []

    def take(trigger: Trigger) -> None:
        fired.append(trigger)
        watcher.desk_looked(trigger)  # an idle desk takes each tick at once

    watcher = MarketWatcher(feed, ["BTC/USDT"], take, move_percent=1.0)

    await _watch(watcher, feed, 3)

    assert [t.text.split(": ")[1].split(" (")[0] for t in fired] == [
        "100 -> 101", "101 -> 102.1"]
    assert watcher.marks["BTC/USDT"] == Decimal("102.1")


async def test_candle_closes_fire_for_the_configured_timeframes() -> None:
    feed = ReplayFeed({"BTC/USDT": _candles("BTC/USDT", [str(100 + i) for i in range(7)])},
                      speed=0, start_offset=1)
    closes: list[Trigger] = []
    watcher = MarketWatcher(feed, ["BTC/USDT"], closes.append, candle_timeframes=["15m"])

    await _watch(watcher, feed, 6)

    # 15m buckets 10:00-10:15 and 10:15-10:30 close with the 10:10 and 10:25 candles.
    assert [t.kind for t in closes] == ["candle", "candle"]
    assert "closed at 2024-01-01 10:15 UTC" in closes[0].text
    assert "open 100, high 102, low 100, close 102" in closes[0].text
    assert "open 103, high 105, low 103, close 105" in closes[1].text
