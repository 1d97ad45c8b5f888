"""Risk before approval: ``place_order`` on a real paper exchange behind the approval book.

An order the desk's limits refuse is refused at once, and no operator is asked. One within
them waits for an operator, and is checked again with the prices of the moment it is
approved: a move while it waited that breaks a limit refuses it, and it never reaches the
exchange.

The replay is flat at 20,000 USDT per BTC, then jumps to 30,000 at the next step; the paper
exchange has no slippage, so a market buy is valued at exactly the last price. The limit is
5,000 USDT an order: 0.2 BTC passes at 20,000 (4,000) and not at 30,000 (6,000).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.scripted_server import Reply, ScriptedServer, ToolCall
from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.conversation import Conversation, ToolUseBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import Event
from trading_agent.agent.tool_call_executor import ExecutedCall, ToolCallExecutor
from trading_agent.agent.tool_registry import ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.operator.approvals import ApprovalBook, PendingApproval
from trading_agent.operator.events import ApprovalRequested, ApprovalResolved
from trading_agent.store.paper_books import SqlitePaperBooks
from trading_agent.tools.config import SubagentConfig
from trading_agent.tools.delegate import register_delegate_tool
from trading_agent.tools.orders import register_order_tools
from trading_agent.trading.config import PaperExchangeConfig, RiskLimits
from trading_agent.trading.exchange import Candle
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.replay import ReplayFeed
from trading_agent.trading.risk import RiskPolicy

D = Decimal
PAPER = PaperExchangeConfig(starting_balances={"USDT": D("100000")}, taker_fee=D("0"),
                            maker_fee=D("0"), slippage_bps=D("0"))
LIMITS = RiskLimits(allowed_symbols=["BTC/USDT"], max_order_notional=D("5000"),
                    max_position_notional=D("50000"), max_open_orders=5,
                    max_orders_per_hour=20, max_daily_loss=D("1000"))
RISK_REFUSAL = ("Error: Refused: order notional 6,000.00 USDT exceeds max_order_notional "
                "5,000.00 USDT.")
WITHIN = {"symbol": "BTC/USDT", "side": "buy", "type": "market", "amount": "0.2"}
OVER = {**WITHIN, "amount": "0.3"}


def _candles() -> list[Candle]:
    """300 flat candles at 20,000, then 10 at 30,000."""
    start = datetime(2023, 1, 3, tzinfo=UTC)
    prices = [D("20000")] * 300 + [D("30000")] * 10
    return [Candle("BTC/USDT", "5m", start + i * timedelta(minutes=5), p, p, p, p, D("10"))
            for i, p in enumerate(prices)]


@dataclass
class Desk:
    """A desk's order tools on the paper exchange, its executor and the daemon's book."""

    feed: ReplayFeed
    paper: PaperExchange
    policy: RiskPolicy
    book: ApprovalBook
    registry: ToolRegistry
    executor: ToolCallExecutor
    bus: EventBus

    async def place(self, arguments: dict[str, Any], call_id: str = "c1",
                    finished: dict[str, ExecutedCall] | None = None) -> ExecutedCall:
        """Runs one ``place_order`` call as the desk's loop would."""
        call = ToolUseBlock(id=call_id, name="place_order", arguments=json.dumps(arguments))
        [executed] = await self.executor.execute([call], "alpha", "t1", self.bus,
                                                 {} if finished is None else finished)
        return executed

    async def held(self) -> PendingApproval:
        """The approval the running call waits on, once it is held."""
        with anyio.fail_after(5):
            while not self.book.pending():  # noqa: ASYNC110
                await anyio.sleep(0.005)
        [approval] = self.book.pending()
        return approval

    async def untouched(self) -> None:
        """Nothing reached the exchange: no fill, no order, no order counted by risk."""
        assert await self.paper.fills() == []
        assert await self.paper.fetch_open_orders() == []
        assert (await self.paper.fetch_balances())["USDT"].free == D("100000")
        assert self.policy.journal.orders_in_hour_before(self.paper.now()) == []


@pytest.fixture
def live() -> bool:
    return True


@pytest.fixture
async def desk(tmp_path: Path, live: bool) -> AsyncIterator[Desk]:
    feed = ReplayFeed({"BTC/USDT": _candles()}, speed=0, start_offset=300)
    paper = await PaperExchange.open(PAPER, feed,
                                     await SqlitePaperBooks.open(tmp_path / "desk.sqlite3",
                                                                 "alpha"))
    policy = RiskPolicy(LIMITS, paper)

    async def last_price(desk: str, symbol: str) -> float | None:
        return float((await feed.ticker(symbol)).last)

    # Live: every order waits. Paper: orders above 1,000 USDT wait (all of these).
    book = ApprovalBook(timeout_seconds=30, is_live=lambda desk: live,
                        notional_threshold=None if live else 1_000, price_lookup=last_price)
    registry = ToolRegistry()
    register_order_tools(registry, exchange=paper, risk_policy=policy, symbols=["BTC/USDT"])
    yield Desk(feed, paper, policy, book, registry,
               ToolCallExecutor(registry, approval_gate=book), EventBus())
    await paper.close()


def _drain(subscription: Any) -> list[Event]:
    events = []
    while (event := subscription.get_nowait()) is not None:
        events.append(event)
    return events


@pytest.mark.parametrize("live", [True, False], ids=["live", "paper-above-threshold"])
async def test_an_order_risk_refuses_is_refused_at_once_and_no_operator_is_asked(
        desk: Desk) -> None:
    with desk.bus.subscribe("operator") as seen:
        with anyio.fail_after(5):  # held, it would wait 30 s for an operator
            executed = await desk.place(OVER)
        events = _drain(seen)
    assert executed.result.is_error
    assert executed.result.text == RISK_REFUSAL
    assert not any(isinstance(e, ApprovalRequested) for e in events)
    assert desk.book.pending() == [] and desk.book.pending_count("alpha") == 0
    await desk.untouched()


@pytest.mark.parametrize("live", [True, False], ids=["live", "paper-above-threshold"])
async def test_an_order_within_the_limits_waits_is_approved_and_placed(desk: Desk) -> None:
    finished: dict[str, ExecutedCall] = {}
    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(desk.place, WITHIN, "c1", finished)
            approval = await desk.held()
            assert approval.tool == "place_order" and approval.notional == pytest.approx(4_000)
            assert await desk.paper.fills() == []  # nothing placed while it waits
            desk.book.approve(approval.id, "alice")
    result = finished["c1"].result
    assert not result.is_error, result.text
    assert result.text.startswith("Order ") and "filled: bought 0.2 BTC on BTC/USDT at " \
        "20,000" in result.text
    [fill] = await desk.paper.fills()
    assert fill.amount == D("0.2") and fill.price == D("20000")


async def test_an_order_approved_after_the_price_broke_a_limit_is_refused_unsent(
        desk: Desk) -> None:
    finished: dict[str, ExecutedCall] = {}
    with desk.bus.subscribe("operator") as seen, anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(desk.place, WITHIN, "c1", finished)
            approval = await desk.held()
            assert approval.notional == pytest.approx(4_000)  # within 5,000 when asked
            desk.feed.advance()  # BTC jumps to 30,000 while the operator decides
            assert (await desk.paper.fetch_ticker("BTC/USDT")).last == D("30000")
            desk.book.approve(approval.id, "alice")
        events = _drain(seen)
    result = finished["c1"].result
    assert result.is_error
    assert result.text == RISK_REFUSAL  # checked again at the prices of the approval
    resolved = [e for e in events if isinstance(e, ApprovalResolved)]
    assert [(e.outcome, e.operator) for e in resolved] == [("approved", "alice")]
    await desk.untouched()


# --------------------------------------------------------------------------- subagents


@pytest.fixture
async def backend(scripted_server: ScriptedServer) -> AsyncIterator[OpenAICompatibleBackend]:
    config = OpenAIBackendConfig(base_url=scripted_server.base_url, model="scripted-model",
                                 context_window=32_000)
    async with OpenAICompatibleBackend(config) as opened:
        yield opened


@pytest.fixture
def server(scripted_server: ScriptedServer) -> Iterator[ScriptedServer]:
    yield scripted_server
    assert not scripted_server.unexpected, "a request got no answer"


async def test_a_subagents_order_is_checked_by_risk_before_any_approval(
        desk: Desk, server: ScriptedServer, backend: OpenAICompatibleBackend) -> None:
    server.add(
        Reply(tool_calls=[ToolCall("delegate", {"task": "Buy 0.3 BTC at market.",
                                                "tools": ["place_order"]})]),
        Reply(tool_calls=[ToolCall("place_order", OVER)]),  # the subagent
        Reply("The risk limits refused the order."),  # the subagent's report
        Reply("Not bought."),  # the desk
    )
    delegator = register_delegate_tool(
        desk.registry, SubagentConfig(allow_place_order=True, system_prompt="SUBAGENT."),
        backend=backend, approval_gate=desk.book)
    assert delegator is not None
    loop = AgentLoop("alpha", backend, desk.executor, desk.bus, maximum_rounds=4)
    with desk.bus.subscribe("operator") as seen:
        with anyio.fail_after(10):  # held, the order would wait 30 s for an operator
            result = await loop.run_turn(Conversation("You are alpha."),
                                         Trigger(kind="operator", text="Buy.", source="ana"))
        events = _drain(seen)
    assert result.text == "Not bought."
    subagent_saw = server.requests[2].messages[-1]
    assert subagent_saw["role"] == "tool" and subagent_saw["content"] == RISK_REFUSAL
    desk_saw = server.requests[3].messages[-1]
    assert desk_saw["content"] == "The risk limits refused the order."
    assert not any(isinstance(e, ApprovalRequested) for e in events)
    await desk.untouched()
    server.assert_complete()
