"""Fixtures of the trading tests: the packaged candles, a fake Binance, a sleep that records.

The network guard of ``tests/conftest.py`` applies: nothing here may leave loopback.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from trading_agent.store.order_journal import SqliteOrderJournal
from trading_agent.trading.ccxt_exchange import CcxtExchange
from trading_agent.trading.config import PACKAGED_CANDLES, CcxtExchangeConfig
from trading_agent.trading.exchange import Candle
from trading_agent.trading.order_journal import OrderJournal
from trading_agent.trading.replay import ReplayFeed, load_candles_csv

from .binance_server import FakeBinance

API_KEY = "test-api-key-9f8e7d6c5b4a"
SECRET = "test-secret-0a1b2c3d4e5f6a7b8c9d"
ENVIRON = {"FAKE_BINANCE_KEY": API_KEY, "FAKE_BINANCE_SECRET": SECRET}
class RecordingSleep:
    """A sleep that returns at once and remembers how long it was asked to wait."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


@pytest.fixture
def sleep() -> RecordingSleep:
    return RecordingSleep()


@cache
def packaged_candles() -> tuple[Candle, ...]:
    """The packaged BTC/USDT candles, parsed once per test session."""
    return tuple(load_candles_csv(PACKAGED_CANDLES, "BTC/USDT"))


def replay_feed(start_offset: int = 300, candles: tuple[Candle, ...] | None = None,
                **kwargs: Any) -> ReplayFeed:
    """A replay of the packaged candles (or ``candles``), driven by hand (speed 0)."""
    series = {"BTC/USDT": list(candles or packaged_candles())}
    return ReplayFeed(series, speed=0, start_offset=start_offset, **kwargs)


@pytest.fixture
def feed() -> ReplayFeed:
    return replay_feed()


@pytest.fixture
async def binance() -> AsyncIterator[FakeBinance]:
    server = FakeBinance(API_KEY, SECRET)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def ccxt_config(binance: FakeBinance) -> CcxtExchangeConfig:
    """Binance spot, pointed at the fake server, fast timeouts, no ccxt throttling."""
    return fake_binance_config(binance)


def fake_binance_config(binance: FakeBinance) -> CcxtExchangeConfig:
    """Binance spot, pointed at the fake server, fast timeouts, no ccxt throttling."""
    return CcxtExchangeConfig(
        exchange_id="binance",
        api_key_env="FAKE_BINANCE_KEY",
        secret_env="FAKE_BINANCE_SECRET",
        # Spot only, no margin or currency endpoints: the fake serves the spot API.
        options={"fetchMarkets": {"types": ["spot"]}, "fetchCurrencies": False,
                 "fetchMargins": False},
        api_urls=binance.api_urls(),
        # ccxt waits 250 ms on close for TLS connections to wind down; loopback has none.
        client_settings={"timeout_on_exit": 0},
        timeout_seconds=0.25,
        enable_rate_limit=False,
        read_attempts=3,
        backoff_seconds=0.5,
        max_backoff_seconds=4.0,
        lookup_attempts=2,
    )


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "trading.sqlite3"


@pytest.fixture
async def journal(database: Path) -> AsyncIterator[OrderJournal]:
    """The live exchange's order journal in the test's SQLite file."""
    opened = await SqliteOrderJournal.open(database)
    yield opened
    await opened.close()


@pytest.fixture
async def exchange(ccxt_config: CcxtExchangeConfig, journal: OrderJournal,
                   sleep: RecordingSleep) -> AsyncIterator[CcxtExchange]:
    """A live ccxt exchange on the fake Binance, orders allowed, journaled."""
    opened = await CcxtExchange.open(ccxt_config, allow_orders=True, journal=journal,
                                     environ=ENVIRON, sleep=sleep)
    yield opened
    await opened.close()
