"""An order whose answer is slow or lost is never abandoned half way nor placed twice.

``place_order`` through the tool executor against the fake Binance, as a desk runs it: the
request hangs after the exchange took the order, the lookups by client order id hang too.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path

import pytest

from trading_agent.agent.conversation import ToolUseBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import Tool, ToolRegistry
from trading_agent.store.order_journal import SqliteOrderJournal
from trading_agent.tools.orders import register_order_tools
from trading_agent.trading.ccxt_exchange import CcxtExchange
from trading_agent.trading.config import CcxtExchangeConfig, RiskLimits
from trading_agent.trading.order_journal import OrderJournal
from trading_agent.trading.risk import RiskPolicy

from .binance_server import FakeBinance
from .conftest import ENVIRON, RecordingSleep

ORDER = "/api/v3/order"
LIMITS = RiskLimits(allowed_symbols=["BTC/USDT"], max_order_notional=Decimal("1e9"),
                    max_position_notional=Decimal("1e9"), max_daily_loss=Decimal("1e9"))
ARGUMENTS = json.dumps({"symbol": "BTC/USDT", "side": "buy", "type": "limit",
                        "amount": "0.001", "price": "20000"})


class Desk:
    def __init__(self, exchange: CcxtExchange, journal: OrderJournal) -> None:
        self.exchange, self.journal = exchange, journal
        self.risk = RiskPolicy(LIMITS, exchange, check_seconds=5, order_seconds=5)
        self.registry = ToolRegistry()
        register_order_tools(self.registry, exchange=exchange, risk_policy=self.risk,
                             symbols=["BTC/USDT"])
        self.executor = ToolCallExecutor(self.registry)

    @property
    def place_order(self) -> Tool:
        tool = self.registry.get("place_order")
        assert tool is not None
        return tool

    async def call(self, call_id: str) -> str:
        [done] = await self.executor.execute(
            [ToolUseBlock(id=call_id, name="place_order", arguments=ARGUMENTS)], "alpha", "t1",
            EventBus(), {})
        return done.result.content[0].text  # type: ignore[union-attr]


@pytest.fixture
async def desk(ccxt_config: CcxtExchangeConfig, database: Path,
               sleep: RecordingSleep) -> AsyncIterator[Desk]:
    journal = await SqliteOrderJournal.open(database)
    exchange = await CcxtExchange.open(ccxt_config, allow_orders=True, journal=journal,
                                       environ=ENVIRON, sleep=sleep)
    yield Desk(exchange, journal)
    await exchange.close()
    await journal.close()


def test_place_order_outlasts_the_longest_order_the_policy_allows(desk: Desk) -> None:
    assert desk.place_order.timeout_seconds > desk.risk.max_place_seconds == 10


async def test_a_tool_timeout_mid_order_neither_abandons_it_nor_lets_a_retry_resend(
        desk: Desk, binance: FakeBinance) -> None:
    # A limit shorter than the order's own worst case (0.25 s request + 2 lookups of 0.25 s),
    # as the old 30 s limit was against ccxt's 43.5 s.
    timeout = desk.place_order.timeout_seconds
    object.__setattr__(desk.place_order, "timeout_seconds", 0.4)
    binance.fail("POST", ORDER, "hang_after_processing")
    binance.fail("GET", ORDER, "hang", "hang")
    first = await desk.call("call1")
    object.__setattr__(desk.place_order, "timeout_seconds", timeout)
    retry = await desk.call("call2")  # the model tries again; the lookup answers now

    assert "was NOT sent again" in first
    assert retry.startswith("Error: Refused: an earlier order whose answer was lost turned "
                            "out to be placed: order ")
    assert binance.count("POST", ORDER) == 1
    [placed] = binance.orders.values()
    intent = await desk.journal.get(placed["clientOrderId"])
    assert intent is not None and intent.state == "placed"
    assert len(desk.risk.journal.orders_in_hour_before(desk.exchange.now())) == 1


async def test_an_order_still_unknown_holds_up_the_next_on_its_symbol(
        desk: Desk, binance: FakeBinance) -> None:
    binance.fail("POST", ORDER, "hang_after_processing")
    binance.fail("GET", ORDER, *["hang"] * 5)  # 2 lookups, then 3 read attempts
    first = await desk.call("call1")
    retry = await desk.call("call2")

    assert "was NOT sent again" in first
    assert retry.startswith("Error: Refused: an earlier BTC/USDT order (client id ta")
    assert "Check it with list_open_orders or get_order" in retry
    assert binance.count("POST", ORDER) == 1


async def test_the_same_call_run_again_places_one_order(desk: Desk,
                                                        binance: FakeBinance) -> None:
    first = await desk.call("call1")
    again = await desk.call("call1")  # the same call of the same turn, replayed
    assert first == again and first.startswith("Order ")
    assert binance.count("POST", ORDER) == 1
