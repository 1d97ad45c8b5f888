"""A desk's tools wired to a paper exchange on the replayed candles, and a way to call them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.tool_registry import ToolContext, ToolOutput, ToolRegistry
from trading_agent.store.memory_notes import SqliteMemory
from trading_agent.store.paper_books import SqlitePaperBooks
from trading_agent.tools import register_trading_tools
from trading_agent.trading.config import PACKAGED_CANDLES, PaperExchangeConfig, RiskLimits
from trading_agent.trading.exchange import Candle
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.replay import ReplayFeed, load_candles_csv
from trading_agent.trading.risk import RiskPolicy

PAPER = PaperExchangeConfig(starting_balances={"USDT": Decimal("10000")},
                            taker_fee=Decimal("0.001"), maker_fee=Decimal("0.0008"),
                            slippage_bps=Decimal("10"))
LIMITS = RiskLimits(allowed_symbols=["BTC/USDT"], max_order_notional=Decimal("5000"),
                    max_position_notional=Decimal("8000"), max_open_orders=2,
                    max_orders_per_hour=20, max_daily_loss=Decimal("500"))


@cache
def packaged_candles() -> tuple[Candle, ...]:
    return tuple(load_candles_csv(PACKAGED_CANDLES, "BTC/USDT"))


@dataclass
class Desk:
    """A desk's tools and what they act on."""

    registry: ToolRegistry
    feed: ReplayFeed
    paper: PaperExchange
    memory: SqliteMemory

    async def call(self, name: str, **arguments: Any) -> ToolOutput | str:
        """Validates ``arguments`` with the tool's model and runs it, as the executor does."""
        tool = self.registry.get(name)
        assert tool is not None, f"no tool {name}"
        parsed = tool.arguments.model_validate(arguments)
        context = ToolContext(desk="alpha", turn="t1", call_id="c1", events=EventBus())
        return await tool.handler(parsed, context)

    async def text(self, name: str, **arguments: Any) -> str:
        result = await self.call(name, **arguments)
        assert isinstance(result, str)
        return result


@pytest.fixture
async def desk(tmp_path: Path) -> AsyncIterator[Desk]:
    feed = ReplayFeed({"BTC/USDT": list(packaged_candles())}, speed=0, start_offset=300)
    database = tmp_path / "desk.sqlite3"
    paper = await PaperExchange.open(PAPER, feed, await SqlitePaperBooks.open(database, "alpha"))
    memory = await SqliteMemory.open(database, "alpha", clock=feed.now)
    registry = ToolRegistry()
    register_trading_tools(registry, exchange=paper, risk_policy=RiskPolicy(LIMITS, paper),
                           symbols=["BTC/USDT"], memory=memory)
    yield Desk(registry, feed, paper, memory)
    await memory.close()
    await paper.close()
