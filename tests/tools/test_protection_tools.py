"""``place_order`` with a stop and a target, and ``set_protection``, as a model calls them on
a paper desk opened as the daemon opens it; each refusal is text the model reads.

The replay stands at 17:45 UTC on 2023-01-03; BTC/USDT last closed at 16,612.0 and the paper
exchange fills market orders 5 bps away (ask 16,620.306).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.errors import ToolError
from trading_agent.store.trading_state import TradingStateFile
from trading_agent.tools import register_trading_tools
from trading_agent.trading.config import ExchangeConfig, RiskLimits
from trading_agent.trading.factory import TradingVenue, open_exchange
from trading_agent.trading.replay import ReplayFeed

from .conftest import packaged_candles

D = Decimal
LIMITS = RiskLimits(allowed_symbols=["BTC/USDT"], max_order_notional=D("5000"),
                    max_position_notional=D("8000"), require_stop_loss=True,
                    max_loss_per_trade=D("20"))


@dataclass
class Desk:
    registry: ToolRegistry
    venue: TradingVenue
    feed: ReplayFeed
    calls: int = 0

    async def text(self, name: str, **arguments: Any) -> str:
        tool = self.registry.get(name)
        assert tool is not None
        self.calls += 1
        context = ToolContext(desk="alpha", turn="t1", call_id=f"c{self.calls}",
                              events=EventBus())
        result = await tool.handler(tool.arguments.model_validate(arguments), context)
        assert isinstance(result, str)
        return result


@pytest.fixture
async def desk(tmp_path: Path) -> AsyncIterator[Desk]:
    feed = ReplayFeed({"BTC/USDT": list(packaged_candles())}, speed=0, start_offset=300)
    async with open_exchange(ExchangeConfig(), state=TradingStateFile(tmp_path / "s.sqlite3"),
                             account="alpha", risk_limits=LIMITS, feed=feed) as venue:
        assert venue.risk is not None
        registry = register_trading_tools(ToolRegistry(), exchange=venue.exchange,
                                          risk_policy=venue.risk, symbols=["BTC/USDT"],
                                          protection=venue.protection)
        yield Desk(registry, venue, feed)


async def test_an_entry_without_a_stop_is_refused_saying_so(desk: Desk) -> None:
    with pytest.raises(ToolError) as caught:
        await desk.text("place_order", symbol="BTC/USDT", side="buy", type="market",
                        amount="0.1")
    assert str(caught.value) == (
        "Refused (require_stop_loss): this desk must give every entry a stop_loss; place it "
        "again with stop_loss set to the price at which the trade is wrong.")
    assert await desk.venue.exchange.fetch_positions() == []


async def test_a_stop_on_the_wrong_side_and_a_stop_too_far_are_refused_with_the_numbers(
        desk: Desk) -> None:
    with pytest.raises(ToolError) as wrong:
        await desk.text("place_order", symbol="BTC/USDT", side="buy", type="market",
                        amount="0.1", stop_loss="16700")
    assert str(wrong.value) == (
        "Refused: stop_loss 16,700.00 is on the wrong side of the ask 16,620.31; a long "
        "position's stop must be below it.")
    with pytest.raises(ToolError) as far:
        await desk.text("place_order", symbol="BTC/USDT", side="buy", type="limit",
                        amount="0.1", price="16600", stop_loss="16300")
    assert str(far.value) == (
        "Refused (max_loss_per_trade): from the limit price 16,600.00 to the stop 16,300.00 "
        "is 300.00 USDT x 0.1 BTC = 30.00 USDT at risk, more than max_loss_per_trade 20.00 "
        "USDT; bring the stop closer or trade less.")
    assert await desk.venue.protection.live() == []  # type: ignore[union-attr]


async def test_an_entry_with_a_stop_and_a_target_is_protected_and_the_stop_moves(
        desk: Desk) -> None:
    placed = await desk.text("place_order", symbol="BTC/USDT", side="buy", type="market",
                             amount="0.1", stop_loss="16450", take_profit="16900")
    assert placed.endswith(
        "Protection: BTC/USDT stop-loss at 16,450.00 (sell exit), simulated from the candles; "
        "BTC/USDT take-profit at 16,900.00 (sell exit), simulated from the candles.")
    moved = await desk.text("set_protection", symbol="BTC/USDT", stop_loss="16550")
    assert moved == (
        "BTC/USDT long 0.1: Protection: BTC/USDT take-profit at 16,900.00 (sell exit), "
        "simulated from the candles; BTC/USDT stop-loss at 16,550.00 (sell exit), simulated "
        "from the candles.")
    with pytest.raises(ToolError, match="keep a stop; move it instead of removing it"):
        await desk.text("set_protection", symbol="BTC/USDT", remove_stop_loss=True)
    with pytest.raises(ToolError, match=r"stop_loss 16,650.00 is on the wrong side of the "
                                        r"price now 16,612.00"):
        await desk.text("set_protection", symbol="BTC/USDT", stop_loss="16650")
    # The protective orders are not the desk's resting orders; the positions show them.
    assert await desk.text("list_open_orders") == "No open orders."
    positions = (await desk.text("get_positions")).splitlines()
    assert positions[0].startswith("BTC/USDT long 0.1 BTC, mark 16,612.00")
    assert positions[1:] == [
        "  protection: BTC/USDT take-profit at 16,900.00 (sell exit), simulated from the "
        "candles",
        "  protection: BTC/USDT stop-loss at 16,550.00 (sell exit), simulated from the candles"]


async def test_a_closing_order_takes_no_protection_and_an_empty_position_none(
        desk: Desk) -> None:
    with pytest.raises(ToolError, match="This desk holds no BTC/USDT position"):
        await desk.text("set_protection", symbol="BTC/USDT", stop_loss="16000")
    await desk.text("place_order", symbol="BTC/USDT", side="buy", type="market",
                    amount="0.1", stop_loss="16450")
    with pytest.raises(ToolError) as caught:
        await desk.text("place_order", symbol="BTC/USDT", side="sell", type="market",
                        amount="0.1", stop_loss="16000")
    assert str(caught.value) == (
        "Refused: stop_loss and take_profit go with an order that opens or adds to a position; "
        "this one reduces it. Use set_protection to move the protection of what you hold.")
    sold = await desk.text("place_order", symbol="BTC/USDT", side="sell", type="market",
                           amount="0.1")
    assert sold.startswith("Order P2 filled: sold 0.1 BTC")
    await desk.venue.match_resting_orders()
    assert await desk.venue.protection.live() == []  # type: ignore[union-attr]
    [stop] = await desk.venue.protection.records.history()  # type: ignore[union-attr]
    assert (stop.status, stop.note) == ("canceled", "the position was closed otherwise")
