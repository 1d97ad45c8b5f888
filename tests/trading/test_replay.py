"""The replay feed: its clock, its candles, its subscriptions and its pace."""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from trading_agent.errors import ConfigError, ExchangeUnavailableError, OrderRejectedError
from trading_agent.trading.config import PACKAGED_CANDLES, ReplayConfig
from trading_agent.trading.exchange import Candle
from trading_agent.trading.feed import PriceFeed
from trading_agent.trading.replay import ReplayFeed, load_candles_csv

from .conftest import RecordingSleep, packaged_candles, replay_feed

FIVE_MINUTES = timedelta(minutes=5)


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def test_the_packaged_candles_are_the_documented_ones() -> None:
    candles = packaged_candles()

    assert len(candles) == 10_999
    assert candles[0].opened_at == at("2023-01-02T16:45")
    assert candles[-1].opened_at == at("2023-02-09T21:15")
    assert all(b.opened_at - a.opened_at == FIVE_MINUTES
               for a, b in itertools.pairwise(candles))
    assert (PACKAGED_CANDLES.parent / "README.md").read_text().count("BTC_USDT-5m.csv") >= 1


@pytest.mark.parametrize(("content", "message"), [
    # The one reader of candle files (trading/candle_csv.py), shared with backtests.
    ("when,open,high,low,close,volume\n", "the header lacks a time column"),
    ("timestamp_ms,open,high,low,close,volume\n1672677900000,1,2,0.5\n",
     ":2: 4 fields; expected 6"),
    ("timestamp_ms,open,high,low,close,volume\n1672677900000,1,2,x,1,1\n", ":2: .*not a number"),
    ("timestamp_ms,open,high,low,close,volume\n1672677900000,1,2,1.5,1,1\n",
     ":2: inconsistent candle"),
    ("timestamp_ms,open,high,low,close,volume\n1672678200000,1,2,1,1,1\n"
     "1672677900000,1,2,1,1,1\n", ":3: unordered timestamp"),
    ("timestamp_ms,open,high,low,close,volume\n1672677900000,1,2,1,1,1\n"
     "1672678500000,1,2,1,1,1\n", ":3: a gap: 1 candle of 5m missing"),
    ("timestamp_ms,open,high,low,close,volume\n", "no candles"),
])
def test_a_malformed_file_is_a_config_error_naming_the_line(
        tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)

    with pytest.raises(ConfigError, match=message):
        load_candles_csv(path, "BTC/USDT")


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the candles of BTC/USDT"):
        ReplayFeed.from_config(ReplayConfig(files={"BTC/USDT": tmp_path / "none.csv"}))


def test_the_default_config_replays_the_packaged_file_with_a_day_of_history() -> None:
    feed = ReplayFeed.from_config(ReplayConfig())

    assert feed.symbols == ["BTC/USDT"]
    assert feed.speed == 60
    assert feed.now() == at("2023-01-03T16:45")  # 288 five-minute candles after the first


async def test_the_clock_is_the_close_of_the_latest_candle_and_nothing_later_is_visible(
) -> None:
    feed = replay_feed(start_offset=10)
    candles = packaged_candles()

    assert feed.now() == candles[9].closes_at
    visible = await feed.candles("BTC/USDT")
    assert visible[-1] == candles[9] and len(visible) == 10
    assert (await feed.ticker("BTC/USDT")).last == candles[9].close

    published = feed.advance(3)

    assert published == list(candles[10:13])
    assert feed.now() == candles[12].closes_at == at("2023-01-02T17:50")
    assert (await feed.candles("BTC/USDT", limit=2)) == list(candles[11:13])
    assert (await feed.candles("BTC/USDT", since=candles[11].opened_at)) == list(candles[11:13])


async def test_before_the_first_step_there_is_no_price() -> None:
    feed = replay_feed(start_offset=0)

    assert feed.now() == packaged_candles()[0].opened_at
    with pytest.raises(ExchangeUnavailableError, match="no price for BTC/USDT yet"):
        await feed.ticker("BTC/USDT")
    with pytest.raises(OrderRejectedError, match="ETH/USDT is not replayed"):
        await feed.ticker("ETH/USDT")


def test_start_picks_the_first_candle_at_or_after_a_time() -> None:
    feed = replay_feed(start=datetime(2023, 1, 10, 12, 2, tzinfo=UTC))

    assert feed.now() == at("2023-01-10T12:05")  # the 12:00 candle is the last in the past
    assert feed.advance()[0].opened_at == at("2023-01-10T12:05")


async def test_longer_timeframes_are_built_from_the_replayed_candles() -> None:
    feed = replay_feed(start_offset=200)  # up to the 09:20 candle of 2023-01-03
    five = await feed.candles("BTC/USDT")

    hours = await feed.candles("BTC/USDT", "1h", limit=3)

    assert [h.opened_at for h in hours] == [at("2023-01-03T07:00"), at("2023-01-03T08:00"),
                                            at("2023-01-03T09:00")]
    full_hour = [c for c in five if at("2023-01-03T08:00") <= c.opened_at < at("2023-01-03T09:00")]
    assert len(full_hour) == 12
    assert hours[1].open == full_hour[0].open and hours[1].close == full_hour[-1].close
    assert hours[1].high == max(c.high for c in full_hour)
    assert hours[1].low == min(c.low for c in full_hour)
    assert hours[1].volume == sum((c.volume for c in full_hour), Decimal(0))
    assert hours[-1].close == five[-1].close  # the forming hour ends at the present
    with pytest.raises(OrderRejectedError, match="cannot build 7m candles"):
        await feed.candles("BTC/USDT", "7m")


async def test_the_ticker_reports_the_change_over_a_day() -> None:
    feed = replay_feed(start_offset=600)
    candles = packaged_candles()

    ticker = await feed.ticker("BTC/USDT")

    assert ticker.change_24h == candles[599].close / candles[599 - 288].close - 1
    assert ticker.volume_24h == sum((c.volume for c in candles[600 - 288:600]), Decimal(0))


async def test_a_subscription_yields_every_new_candle_in_order_even_when_it_lags() -> None:
    feed = replay_feed(start_offset=50)
    candles = packaged_candles()
    received: list[Candle] = []

    with feed.subscribe() as subscription:
        feed.advance(3)  # published while nobody was reading
        for _ in range(3):
            received.append(await subscription.__anext__())
        feed.advance()
        received.append(await subscription.__anext__())

    assert received == list(candles[50:54])


async def test_run_paces_steps_by_speed_with_the_injected_sleep() -> None:
    sleep = RecordingSleep()
    feed = replay_feed(start_offset=0, candles=packaged_candles()[:4], sleep=sleep)
    feed.speed = 60.0
    received: list[Candle] = []

    async with anyio.create_task_group() as group:
        with feed.subscribe() as subscription:
            await group.start(feed.run)
            async for candle in subscription:
                received.append(candle)

    assert sleep.delays == [5.0] * 4  # a 5-minute candle every 5 seconds at 60x
    assert received == list(packaged_candles()[:4])
    assert feed.finished


async def test_as_fast_as_possible_waits_for_the_slowest_reader() -> None:
    feed = replay_feed(start_offset=0, candles=packaged_candles()[:30])
    lags: list[int] = []

    async with anyio.create_task_group() as group:
        with feed.subscribe() as subscription:
            await group.start(feed.run)
            async for candle in subscription:
                index = packaged_candles().index(candle)
                lags.append(feed.cursor - index)
                for _ in range(5):  # a reader doing some work, yielding meanwhile
                    await anyio.lowlevel.checkpoint()

    assert len(lags) == 30
    assert max(lags) <= 1  # the replay never ran ahead of its reader


async def test_a_closed_subscription_no_longer_holds_the_replay_back() -> None:
    feed = replay_feed(start_offset=0, candles=packaged_candles()[:20])

    with feed.subscribe() as subscription:
        first = await anext_after_step(feed, subscription)
    with anyio.fail_after(5):
        await feed.run()

    assert first == packaged_candles()[0]
    assert feed.finished


async def anext_after_step(feed: ReplayFeed, subscription: object) -> Candle:
    feed.advance()
    assert hasattr(subscription, "__anext__")
    candle: Candle = await subscription.__anext__()
    return candle


async def test_symbols_come_from_their_own_files(tmp_path: Path) -> None:
    eth = tmp_path / "ETH_USDT-5m.csv"
    eth.write_text("timestamp_ms,open,high,low,close,volume\n"
                   "1672678200000,1210.5,1212.0,1209.9,1211.1,150.2\n"
                   "1672678500000,1211.1,1213.3,1210.0,1213.0,98.7\n")
    config = ReplayConfig(files={"BTC/USDT": PACKAGED_CANDLES, "ETH/USDT": eth}, start_offset=1)
    feed = ReplayFeed.from_config(config)

    with feed.subscribe() as subscription:
        feed.advance(2)
        got = [await subscription.__anext__() for _ in range(4)]

    assert [(c.symbol, c.opened_at.strftime("%H:%M")) for c in got] == [
        ("BTC/USDT", "16:50"), ("ETH/USDT", "16:50"), ("BTC/USDT", "16:55"),
        ("ETH/USDT", "16:55")]
    assert (await feed.ticker("ETH/USDT")).last == Decimal("1213.0")
    assert isinstance(feed, PriceFeed)


async def test_as_fast_as_possible_a_reader_sees_its_candle_s_own_time_while_working() -> None:
    btc = packaged_candles()[:12]
    eth = [replace(c, symbol="ETH/USDT") for c in btc]  # two candles per step
    feed = ReplayFeed({"BTC/USDT": list(btc), "ETH/USDT": eth}, speed=0)
    seen: list[tuple[datetime, datetime]] = []
    other: list[Candle] = []

    async def other_reader() -> None:
        with feed.subscribe() as subscription:
            async for candle in subscription:
                other.append(candle)

    async with anyio.create_task_group() as group:
        with feed.subscribe() as subscription:
            group.start_soon(other_reader)
            await anyio.lowlevel.checkpoint()
            await group.start(feed.run)
            async for candle in subscription:
                for _ in range(5):  # per-candle work (a paper sync, a risk check) that yields
                    await anyio.lowlevel.checkpoint()
                    seen.append((candle.closes_at, feed.now()))

    assert len(seen) == 5 * 24
    assert all(now == closes for closes, now in seen)
    assert len(other) == 24 and feed.finished
