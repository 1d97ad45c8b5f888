"""Exchanges, price feeds and risk: everything a desk trades through.

The modules, one idea each:

- ``exchange``: the :class:`Exchange` protocol and the values it trades in (orders, candles...).
- ``feed``: the :class:`PriceFeed` protocol (prices, candles, a clock, candle subscriptions).
- ``replay``: :class:`ReplayFeed`, recorded candles played back on a replayed clock.
- ``paper``: :class:`PaperExchange`, simulated fills with exact books (``ledger``, SQLite).
- ``ccxt_exchange``: ``CcxtExchange``, a real exchange through ccxt (``ccxt_errors``
  translates its exceptions; ``order_journal`` keeps client order ids; ``ccxt_feed`` makes
  it a price feed). Not imported here: ccxt takes a second to import.
- ``risk``: :class:`RiskPolicy`, the limits checked on every order (``risk_journal``
  remembers them across restarts; ``valuation`` values an account).
- ``factory``: :func:`open_exchange`, which builds all of it from the config (on a feed
  of its own, or on one shared through :class:`SharedFeeds`; :func:`open_feed` opens one).
- ``config``: the pydantic models the settings embed.

The trading layer imports nothing of the project but its errors.
"""

from __future__ import annotations

from trading_agent.trading.config import (
    CcxtExchangeConfig,
    ExchangeConfig,
    PaperExchangeConfig,
    ReplayConfig,
    RiskLimits,
)
from trading_agent.trading.exchange import (
    Balance,
    Candle,
    Exchange,
    Fill,
    Market,
    Order,
    OrderBook,
    OrderRequest,
    Position,
    Ticker,
)
from trading_agent.trading.factory import SharedFeeds, TradingVenue, open_exchange, open_feed
from trading_agent.trading.feed import PriceFeed
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.replay import ReplayFeed
from trading_agent.trading.risk import RiskPolicy
from trading_agent.trading.risk_journal import RiskJournal

__all__ = [
    "Balance",
    "Candle",
    "CcxtExchangeConfig",
    "Exchange",
    "ExchangeConfig",
    "Fill",
    "Market",
    "Order",
    "OrderBook",
    "OrderRequest",
    "PaperExchange",
    "PaperExchangeConfig",
    "Position",
    "PriceFeed",
    "ReplayConfig",
    "ReplayFeed",
    "RiskJournal",
    "RiskLimits",
    "RiskPolicy",
    "SharedFeeds",
    "Ticker",
    "TradingVenue",
    "open_exchange",
    "open_feed",
]
