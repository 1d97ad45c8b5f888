"""The trading tools as a model calls them: compact text answers, readable refusals.

The replay stands at 17:45 UTC on 2023-01-03; BTC/USDT last closed at 16,612.0 and the paper
exchange fills market orders 10 bps away (ask 16,628.612, bid 16,595.388).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trading_agent.agent.tool_registry import ToolRegistry
from trading_agent.errors import RiskLimitError, ToolError
from trading_agent.tools import TRADING_TOOL_NAMES, register_trading_tools
from trading_agent.trading.risk import RiskPolicy

from .conftest import LIMITS, Desk


def test_every_tool_is_registered_and_only_place_order_is_dangerous(desk: Desk) -> None:
    # get_trade_record comes with the books, set_protection with the protection keeper,
    # which a desk built by the daemon has.
    assert desk.registry.names == [name for name in TRADING_TOOL_NAMES if name not in (
        "get_trade_record", "set_protection")] + ["remember", "recall"]
    dangerous = [name for name in desk.registry.names if desk.registry.get(name).dangerous]  # type: ignore[union-attr]
    assert dangerous == ["place_order"]
    for definition in desk.registry.definitions():
        assert definition["function"]["description"]
        assert definition["function"]["parameters"]["type"] == "object"


def test_the_risk_policy_must_guard_the_same_exchange(desk: Desk) -> None:
    other = RiskPolicy(LIMITS, desk.paper)
    other.exchange = object()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="the desk's own exchange"):
        register_trading_tools(ToolRegistry(), exchange=desk.paper, risk_policy=other,
                               symbols=["BTC/USDT"])


async def test_get_ticker_reads_as_one_line(desk: Desk) -> None:
    text = await desk.text("get_ticker")

    assert text.startswith("BTC/USDT last 16,612.00 · bid 16,595.39 / ask 16,628.61 · 24h ")
    assert text.endswith("· at 2023-01-03 17:45 UTC")
    assert "{" not in text  # no raw JSON


async def test_get_order_book_says_it_is_simulated(desk: Desk) -> None:
    text = await desk.text("get_order_book", depth=3)

    lines = text.splitlines()
    assert lines[0] == ("BTC/USDT order book at 2023-01-03 17:45 UTC (simulated from candles: "
                        "paper fills ignore depth)")
    assert lines[1] == "asks, best last:" and lines[5] == "bids, best first:"
    assert lines[4].startswith("  16,628.61  ")
    assert lines[-1] == "spread 33.224 (20.0 bps), mid 16,612.00"


async def test_get_candles_is_a_csv_table_with_a_summary(desk: Desk) -> None:
    text = await desk.text("get_candles", limit=3)

    assert text.splitlines() == [
        "BTC/USDT 5m: 3 candles from 2023-01-03 17:30 UTC to 2023-01-03 17:40 UTC (open times, "
        "UTC). Close 16,612.00, change -0.03%, high 16,632.80, low 16,611.90.",
        "time,open,high,low,close,volume",
        "01-03 17:30,16617.7,16632.8,16616.5,16631.8,491.499",
        "01-03 17:35,16631.7,16631.8,16624,16624.1,363.446",
        "01-03 17:40,16624,16624.1,16611.9,16612,429.065",
    ]


async def test_get_candles_builds_hours(desk: Desk) -> None:
    text = await desk.text("get_candles", timeframe="1h", limit=2)

    assert "BTC/USDT 1h: 2 candles from 2023-01-03 16:00 UTC to 2023-01-03 17:00 UTC" in text


async def test_place_order_fills_and_get_balance_and_positions_show_it(desk: Desk) -> None:
    placed = await desk.text("place_order", symbol="BTC/USDT", side="buy", type="market",
                             amount="0.1")
    balance = await desk.text("get_balance")
    positions = await desk.text("get_positions")

    assert placed == ("Order P1 filled: bought 0.1 BTC on BTC/USDT at 16,628.61 (market), fee "
                      "1.66 USDT.")
    assert balance.splitlines() == [
        "Balances on paper at 2023-01-03 17:45 UTC:",
        "BTC: free 0.1, in orders 0.00, total 0.1 = 1,661.20 USDT",
        "USDT: free 8,335.48, in orders 0.00, total 8,335.48",
        "Total value 9,996.68 USDT.",
    ]
    assert positions == ("BTC/USDT long 0.1 BTC, mark 16,612.00, value 1,661.20 USDT, entry "
                         "16,628.61, unrealized -1.66 USDT (-0.10%)")


async def test_a_limit_order_rests_is_listed_and_canceled(desk: Desk) -> None:
    placed = await desk.text("place_order", symbol="btc/usdt", side="buy", type="limit",
                             amount=0.05, price=16000)
    listed = await desk.text("list_open_orders")
    status = await desk.text("get_order", order_id="P1", symbol="BTC/USDT")
    canceled = await desk.text("cancel_order", order_id="P1", symbol="BTC/USDT")
    after = await desk.text("list_open_orders")

    assert placed.startswith("Order P1 placed and resting: buy limit 0.05 BTC on BTC/USDT @ "
                             "16,000.00, filled 0 so far.")
    assert listed.splitlines()[0] == "1 open order:"
    assert listed.splitlines()[1].startswith("P1: buy limit 0.05 BTC on BTC/USDT @ 16,000.00, "
                                             "open (placed 01-03 17:45 UTC, client id ta")
    assert status.startswith("P1: buy limit 0.05 BTC on BTC/USDT @ 16,000.00, open")
    assert canceled.startswith("Canceled. P1: buy limit 0.05 BTC on BTC/USDT @ 16,000.00, "
                               "canceled")
    assert after == "No open orders."


async def test_a_risk_refusal_reaches_the_model_as_a_tool_error(desk: Desk) -> None:
    with pytest.raises(RiskLimitError) as caught:
        await desk.call("place_order", symbol="BTC/USDT", side="buy", type="limit",
                        amount="0.5", price="16000")

    assert isinstance(caught.value, ToolError)
    assert str(caught.value) == ("Refused: order notional 8,000.00 USDT exceeds "
                                 "max_order_notional 5,000.00 USDT.")
    assert await desk.paper.fetch_open_orders() == []


async def test_an_exchange_refusal_becomes_a_readable_tool_error(desk: Desk) -> None:
    with pytest.raises(ToolError) as caught:
        await desk.call("cancel_order", order_id="P99", symbol="BTC/USDT")
    assert str(caught.value) == "Could not cancel order P99: paper has no order P99"

    with pytest.raises(ToolError, match="Could not read the ticker of ETH/USDT: paper has no "
                                        "market ETH/USDT; it trades BTC/USDT"):
        await desk.call("get_ticker", symbol="ETH/USDT")


def test_order_arguments_are_checked_before_the_tool_runs(desk: Desk) -> None:
    model = desk.registry.get("place_order").arguments  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match="a limit order needs a price"):
        model.model_validate({"symbol": "BTC/USDT", "side": "buy", "type": "limit",
                              "amount": 1})
    with pytest.raises(ValidationError, match="a market order takes no price"):
        model.model_validate({"symbol": "BTC/USDT", "side": "buy", "type": "market",
                              "amount": 1, "price": 10})
    with pytest.raises(ValidationError):
        model.model_validate({"symbol": "BTC/USDT", "side": "buy", "type": "market",
                              "amount": -1})


async def test_an_empty_account_and_no_positions(desk: Desk) -> None:
    assert await desk.text("get_positions") == "No open positions."
    assert await desk.text("list_open_orders", symbol="BTC/USDT") == "No open orders on BTC/USDT."
