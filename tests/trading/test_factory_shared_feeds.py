"""SharedFeeds and open_exchange(feed=...): desks on one feed config trade on one feed."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

from trading_agent.store.trading_state import TradingStateFile
from trading_agent.trading import (
    CcxtExchangeConfig,
    ExchangeConfig,
    OrderRequest,
    PaperExchange,
    PaperExchangeConfig,
    ReplayConfig,
    ReplayFeed,
)
from trading_agent.trading.ccxt_feed import CcxtPriceFeed
from trading_agent.trading.factory import SharedFeeds, open_exchange

from .binance_server import FakeBinance
from .conftest import RecordingSleep

EXCHANGE_INFO = "/api/v3/exchangeInfo"


def market_buy(amount: str = "0.01") -> OrderRequest:
    return OrderRequest("BTC/USDT", "buy", "market", Decimal(amount))


async def test_desks_on_one_replay_config_share_its_feed_and_its_clock(database: Path) -> None:
    rich = ExchangeConfig(paper=PaperExchangeConfig(starting_balances={"USDT": Decimal(50000)}))
    later = ExchangeConfig(replay=ReplayConfig(start_offset=400))

    async with SharedFeeds() as feeds:
        feed = await feeds.get(ExchangeConfig())
        # The paper books differ, the replay does not: the same feed.
        assert await feeds.get(rich) is feed
        other = await feeds.get(later)
        assert isinstance(feed, ReplayFeed) and isinstance(other, ReplayFeed)
        assert other is not feed
        assert feeds.feeds == [feed, other]

        async with open_exchange(ExchangeConfig(), state=TradingStateFile(database),
                                 account="alpha",
                                 feed=feed) as alpha, \
                open_exchange(rich, state=TradingStateFile(database), account="beta",
                              feed=feed) as beta:
            assert alpha.feed is beta.feed is feed
            feed.advance(3)
            first = await alpha.exchange.create_order(market_buy())
            second = await beta.exchange.create_order(market_buy())
        # Closing a desk's venue leaves the shared feed to its owner.
        with feed.subscribe() as candles:
            assert not candles.closed
            assert await alpha.feed.ticker("BTC/USDT") == await feed.ticker("BTC/USDT")

    assert first.created_at == second.created_at == feed.now()
    assert first.average == second.average
    assert other.now() > feed.now()  # its own clock, 100 candles on
    assert candles.closed  # the pool closed the feeds it opened


async def test_a_live_desk_takes_no_shared_feed() -> None:
    async with SharedFeeds() as feeds:
        live = ExchangeConfig(mode="live", ccxt=CcxtExchangeConfig())
        assert await feeds.get(live) is None
        assert feeds.feeds == []


async def test_paper_desks_on_one_ccxt_feed_share_one_market_data_client(
        ccxt_config: CcxtExchangeConfig, binance: FakeBinance, database: Path,
        sleep: RecordingSleep) -> None:
    config = ExchangeConfig(feed="ccxt", ccxt=ccxt_config)

    async with SharedFeeds(sleep=sleep) as feeds:
        feed = await feeds.get(config, symbols=["BTC/USDT"])
        assert await feeds.get(config, symbols=["BTC/USDT"]) is feed
        assert isinstance(feed, CcxtPriceFeed)
        async with open_exchange(config, state=TradingStateFile(database), account="alpha",
                                 feed=feed) as alpha, \
                open_exchange(config, state=TradingStateFile(database), account="beta",
                              feed=feed) as beta:
            assert isinstance(alpha.exchange.inner, PaperExchange)
            assert isinstance(beta.exchange.inner, PaperExchange)
            await alpha.exchange.create_order(market_buy())
            await beta.exchange.create_order(market_buy())
        # Other symbols are another feed.
        assert await feeds.get(config, symbols=["ETH/USDT"]) is not feed

    # One client for the first two desks' feed, one for the ETH feed; no orders sent.
    assert binance.count("GET", EXCHANGE_INFO) == 2
    assert binance.count("POST", "/api/v3/order") == 0
