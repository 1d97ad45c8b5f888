"""open_exchange: paper by default, live only with mode = "live", everything closed on exit."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import anyio
import pytest
from pydantic import ValidationError

from trading_agent.errors import ConfigError, RiskLimitError
from trading_agent.store.trading_state import TradingStateFile
from trading_agent.trading import (
    CcxtExchangeConfig,
    ExchangeConfig,
    OrderRequest,
    PaperExchange,
    ReplayFeed,
    RiskLimits,
    open_exchange,
)
from trading_agent.trading.ccxt_exchange import CcxtExchange
from trading_agent.trading.ccxt_feed import CcxtPriceFeed

from .binance_server import FakeBinance
from .conftest import ENVIRON, RecordingSleep

ORDER = "/api/v3/order"


def market_buy() -> OrderRequest:
    return OrderRequest("BTC/USDT", "buy", "market", Decimal("0.01"))


async def test_the_default_is_paper_trading_on_the_packaged_replay(database: Path) -> None:
    async with open_exchange(ExchangeConfig(), state=TradingStateFile(database), account="alpha",
                             risk_limits=RiskLimits()) as venue:
        assert venue.mode == "paper"
        assert isinstance(venue.exchange.inner, PaperExchange)
        assert isinstance(venue.feed, ReplayFeed)
        assert venue.risk is not None
        order = await venue.risk.place_order(market_buy())
        now = venue.feed.now()

    assert order.status == "closed"
    assert now.isoformat() == "2023-01-03T16:45:00+00:00"  # a day of history by default
    assert await anyio.Path(database).exists()


def test_live_mode_and_the_ccxt_feed_need_a_ccxt_section() -> None:
    with pytest.raises(ValidationError, match=r"live mode needs an \[exchange.ccxt\] section"):
        ExchangeConfig(mode="live")
    with pytest.raises(ValidationError, match='feed = "ccxt" needs'):
        ExchangeConfig(feed="ccxt")
    with pytest.raises(ValidationError, match="extra"):
        ExchangeConfig.model_validate({"mode": "paper", "sandbox": True})


def test_credentials_cannot_be_written_into_the_config() -> None:
    with pytest.raises(ValidationError, match="come only from environment variables"):
        CcxtExchangeConfig(client_settings={"apiKey": "abc"})


async def test_paper_mode_on_a_ccxt_feed_never_sends_an_order(
        ccxt_config: CcxtExchangeConfig, binance: FakeBinance, database: Path,
        sleep: RecordingSleep) -> None:
    config = ExchangeConfig(mode="paper", feed="ccxt", ccxt=ccxt_config)

    async with open_exchange(config, state=TradingStateFile(database), symbols=["BTC/USDT"],
                             environ={}, sleep=sleep) as venue:
        assert isinstance(venue.exchange.inner, PaperExchange)
        assert isinstance(venue.feed, CcxtPriceFeed)
        order = await venue.exchange.create_order(market_buy())
        data_source = venue.feed.exchange
        with pytest.raises(ConfigError, match='needs mode = "live"'):
            await data_source.create_order(market_buy())

    # Filled on paper at the real last price plus the default 5 bps of slippage.
    assert order.average == Decimal("16709.9") * Decimal("1.0005")
    assert binance.count("POST", ORDER) == 0
    assert all(r.api_key is None for r in binance.requests)  # no credentials were even read


async def test_live_mode_sends_orders_to_the_exchange(
        ccxt_config: CcxtExchangeConfig, binance: FakeBinance, database: Path,
        sleep: RecordingSleep) -> None:
    config = ExchangeConfig(mode="live", ccxt=ccxt_config)
    limits = RiskLimits(max_order_notional=Decimal("1000"))

    async with open_exchange(config, state=TradingStateFile(database), environ=ENVIRON, sleep=sleep,
                             risk_limits=limits) as venue:
        assert isinstance(venue.exchange.inner, CcxtExchange)
        assert venue.risk is not None
        order = await venue.risk.place_order(market_buy())

    assert order.status == "closed"
    assert binance.count("POST", ORDER) == 1


async def test_a_ccxt_feed_yields_new_completed_candles_by_polling(
        ccxt_config: CcxtExchangeConfig, binance: FakeBinance) -> None:
    exchange = await CcxtExchange.open(ccxt_config)
    polls: list[float] = []

    async def next_candle_arrives(seconds: float) -> None:
        polls.append(seconds)
        last = binance.klines[-1]
        opened = last[0] + 300_000
        binance.klines.append([opened, "16709.9", "16720.0", "16700.1", "16715.5", "321.5",
                               opened + 299_999, "0", 1, "0", "0", "0"])

    feed = CcxtPriceFeed(exchange, ["BTC/USDT"], poll_seconds=7.0, sleep=next_candle_arrives)
    try:
        with feed.subscribe() as candles:
            candle = await candles.__anext__()
    finally:
        await feed.close()
        await exchange.close()

    assert polls == [7.0]
    assert (candle.symbol, candle.close) == ("BTC/USDT", Decimal("16715.5"))
    assert candle.opened_at.isoformat() == "2023-01-02T17:05:00+00:00"


async def test_desks_on_one_live_account_share_its_cap_and_each_counts_only_its_own(
        ccxt_config: CcxtExchangeConfig, binance: FakeBinance, database: Path,
        sleep: RecordingSleep) -> None:
    # Both desks trade one key; together they may hold 5,000 USDT (BTC at 16,709.9).
    config = ExchangeConfig(mode="live", ccxt=ccxt_config, max_account_notional=Decimal("5000"))
    assert config.account_key("alpha") == config.account_key("beta")
    limits = RiskLimits(max_order_notional=Decimal("4000"),
                        max_position_notional=Decimal("4000"))

    def buy(amount: str) -> OrderRequest:
        return OrderRequest("BTC/USDT", "buy", "market", Decimal(amount))

    async with open_exchange(config, state=TradingStateFile(database, desk="alpha"),
                             account="alpha", environ=ENVIRON, sleep=sleep, risk_limits=limits,
                             account_peers=["beta"]) as alpha, \
            open_exchange(config, state=TradingStateFile(database, desk="beta"),
                          account="beta", environ=ENVIRON, sleep=sleep, risk_limits=limits,
                          account_peers=["alpha"]) as beta:
        assert alpha.risk is not None and beta.risk is not None
        await alpha.risk.place_order(buy("0.2"))  # 3,342 USDT
        with pytest.raises(RiskLimitError) as refused:
            await beta.risk.place_order(buy("0.1"))  # 1,671 more: 5,013 together
        assert refused.value.limit == "max_account_notional"
        assert str(refused.value) == (
            "Refused (max_account_notional): the desks on this account (beta, alpha) could hold "
            "5,012.97 USDT together (this desk 1,670.99 USDT with this order, the others "
            "3,341.98 USDT), exceeding max_account_notional 5,000.00 USDT.")
        await beta.risk.place_order(buy("0.09"))  # 4,845.87 together: within the cap
        assert [p.amount for p in await alpha.exchange.fetch_positions()] == [Decimal("0.2")]
        assert [p.amount for p in await beta.exchange.fetch_positions()] == [Decimal("0.09")]
