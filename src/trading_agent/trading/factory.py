"""Building a desk's exchange, price feed and risk policy from the config.

Only ``mode = "live"`` builds an exchange that can send real orders. In paper mode (the
default) orders go to the :class:`~trading_agent.trading.paper.PaperExchange`, whose prices
come from replayed candles or, with ``feed = "ccxt"``, from a real exchange opened for market
data only (its credentials are not even read).

Example::

    async with open_exchange(config.exchange, database=state_dir / "trading.sqlite3",
                             account="alpha", risk_limits=config.risk) as venue:
        async with anyio.create_task_group() as group:
            if isinstance(venue.feed, ReplayFeed):
                await group.start(venue.feed.run)
            ...  # venue.exchange, venue.risk, venue.feed.subscribe()
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio

from trading_agent.trading.config import ExchangeConfig, RiskLimits
from trading_agent.trading.exchange import Exchange
from trading_agent.trading.feed import PriceFeed
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.replay import ReplayFeed
from trading_agent.trading.risk import RiskPolicy
from trading_agent.trading.risk_journal import RiskJournal
from trading_agent.trading.timing import Sleep

__all__ = ["TradingVenue", "open_exchange"]


@dataclass(frozen=True)
class TradingVenue:
    """What a desk trades with.

    Attributes:
        mode: ``paper`` or ``live``.
        exchange: Where orders go.
        feed: Prices, candles and the clock (a replay's clock is replayed time); subscribe
            to it for tick triggers.
        risk: The desk's risk policy on ``exchange``, when limits were given.
    """

    mode: Literal["paper", "live"]
    exchange: Exchange
    feed: PriceFeed
    risk: RiskPolicy | None


@asynccontextmanager
async def open_exchange(
    config: ExchangeConfig,
    *,
    database: Path | str,
    account: str = "default",
    symbols: Sequence[str] | None = None,
    risk_limits: RiskLimits | None = None,
    environ: Mapping[str, str] | None = None,
    sleep: Sleep = anyio.sleep,
) -> AsyncIterator[TradingVenue]:
    """Opens a desk's exchange and feed (and risk policy), and closes them on exit.

    Args:
        config: The exchange config.
        database: The SQLite file for the paper books, the order journal and the risk
            journal (desks may share it; each is one ``account``).
        account: The desk's name.
        symbols: The symbols a ccxt feed carries (the replay's own come from its files);
            the risk limits' allowed symbols by default.
        risk_limits: The desk's limits; when given, ``venue.risk`` enforces them.
        environ: Where live credentials are read from (the process environment).
        sleep: How retries and the replay wait (tests pass a fake).

    Raises:
        ConfigError: A file, an exchange id or a credential is wrong.
        ExchangeUnavailableError: The ccxt exchange's markets could not be loaded.
    """
    wanted = list(symbols or (risk_limits.allowed_symbols if risk_limits else ["BTC/USDT"]))
    async with AsyncExitStack() as stack:
        exchange: Exchange
        feed: PriceFeed
        if config.mode == "live" or config.feed == "ccxt":
            # Imported here: ccxt takes a second to import, and paper desks on a replay
            # never need it.
            from trading_agent.trading.ccxt_exchange import CcxtExchange
            from trading_agent.trading.ccxt_feed import CcxtPriceFeed
            from trading_agent.trading.order_journal import OrderJournal

            assert config.ccxt is not None  # ExchangeConfig validates this
            journal = None
            if config.mode == "live":
                journal = await OrderJournal.open(database)
                stack.push_async_callback(journal.close)
            venue_exchange = await CcxtExchange.open(
                config.ccxt, allow_orders=config.mode == "live", journal=journal,
                environ=environ, sleep=sleep)
            stack.push_async_callback(venue_exchange.close)
            feed = CcxtPriceFeed(venue_exchange, wanted, sleep=sleep)
            exchange = venue_exchange
        else:
            feed = ReplayFeed.from_config(config.replay, sleep=sleep)
        stack.push_async_callback(feed.close)
        if config.mode == "paper":
            paper = await PaperExchange.open(config.paper, feed, database, account=account)
            stack.push_async_callback(paper.close)
            exchange = paper
        risk = None
        if risk_limits is not None:
            risk_journal = await RiskJournal.open(database, account, exchange.now())
            stack.push_async_callback(risk_journal.close)
            risk = RiskPolicy(risk_limits, exchange, journal=risk_journal)
        yield TradingVenue(config.mode, exchange, feed, risk)
