"""A backtest over the packaged candles with a model that enters with a stop and a target:
``trades.csv`` shows the round trip's entry, its exit at the protection and why; moving the
stop changes the exit as the fill rule says.

The scripted model buys 0.01 BTC at market on its first turn, with a stop 60 below and a
target 60 above the last price it read. In the second run it also moves the stop on its
second turn to 10 below the price it reads then. The expected exits are worked out from
the candles by the README's rule: the first candle (from the one the entry filled in) whose
low reaches the stop fills it at the stop, or at its open when it opened below; a high
reaching the target likewise; both in one candle: the stop.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, Step, ToolCall
from trading_agent.backtest.engine import BacktestSpec, parse_time, run_backtest
from trading_agent.backtest.mask import Mask, choose_mask
from trading_agent.backtest.report import write_report
from trading_agent.settings import load_settings
from trading_agent.trading.exchange import Candle
from trading_agent.trading.formatting import format_price

CONFIG = """
[daemon]
state_dir = "state"

[model]
provider = "openai"
base_url = "{url}"
model = "scripted-protected-trader"
context_window = 32000

[desks.guarded]
system_prompt = "You trade BTC/USDT, always with a stop."
symbols = ["BTC/USDT"]

[desks.guarded.risk]
allowed_symbols = ["BTC/USDT"]
require_stop_loss = true
max_loss_per_trade = "5"

[desks.guarded.triggers]
schedules = [{{ every = "1h", name = "check", message = "Check." }}]
"""

_NUMBER = r"([\d,]+\.?\d*)"


def _number(pattern: str, text: str) -> Decimal:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in {text!r}"
    return Decimal(found.group(1).replace(",", ""))


def _calls(messages: Sequence[dict[str, Any]], name: str) -> int:
    return sum(1 for m in messages for c in m.get("tool_calls") or ()
               if c["function"]["name"] == name)


def protected_trader(*, move: bool, symbol: str = "BTC/USDT", step: Decimal = Decimal(60)
                     ) -> Any:
    """Positions first; flat and never traded: the ticker, then a protected buy of 0.01
    with a stop and a target ``step`` away from the price; holding (with ``move``, once): the
    stop moved to a sixth of ``step`` below the mark."""

    def respond(request: RecordedRequest) -> Step:
        messages = request.messages
        if not request.tools:
            return Reply("Summary: one protected trade.")
        last = messages[-1]
        if last.get("role") != "tool":
            return Reply(tool_calls=[ToolCall("get_positions", {})])
        content = last.get("content")
        text = content if isinstance(content, str) else json.dumps(content)
        if text.startswith("No open positions") and _calls(messages, "place_order") == 0:
            return Reply(tool_calls=[ToolCall("get_ticker", {"symbol": symbol})])
        if text.startswith(f"{symbol} last"):
            price = _number(r"last " + _NUMBER, text).quantize(Decimal(1))
            return Reply(tool_calls=[ToolCall("place_order", {
                "symbol": symbol, "side": "buy", "type": "market", "amount": "0.01",
                "stop_loss": str(price - step), "take_profit": str(price + step)})])
        if text.startswith(f"{symbol} long") and "mark" in text and move \
                and _calls(messages, "set_protection") == 0:
            mark = _number(r"mark " + _NUMBER, text).quantize(Decimal(1))
            return Reply(tool_calls=[ToolCall("set_protection", {
                "symbol": symbol, "stop_loss": str(mark - step / 6)})])
        return Reply(f"Noted: {text[:80]}")

    return respond


def _arguments(server: ScriptedServer, tool: str) -> dict[str, Any]:
    """The arguments of the model's one call of ``tool``, as it sent them."""
    for request in server.requests:
        for message in request.messages:
            for call in message.get("tool_calls") or ():
                if call["function"]["name"] == tool:
                    arguments: dict[str, Any] = json.loads(call["function"]["arguments"])
                    return arguments
    raise AssertionError(f"the model never called {tool}")


def _run_spec(tmp_path: Path, url: str, mask: Mask | None = None) -> BacktestSpec:
    tmp_path.mkdir()
    config = tmp_path / "guarded.toml"
    config.write_text(CONFIG.format(url=url))
    return BacktestSpec(load_settings(config), "guarded", parse_time("2023-01-06"),
                        parse_time("2023-01-06T12:00"), cache_dir=tmp_path / "cache",
                        source=str(config), mask=mask)


def _expected_exit(candles: Sequence[Candle], since: datetime,
                   stops: Sequence[tuple[datetime, Decimal]], target: Decimal
                   ) -> tuple[datetime, Decimal, str]:
    """The rule, by hand: ``stops`` are (from when, stop price) as the model set them."""
    for candle in candles:
        if candle.opened_at < since:
            continue
        stop = [price for start, price in stops if start <= candle.opened_at][-1]
        if candle.low <= stop:
            return candle.closes_at, min(stop, candle.open), "stop_loss"
        if candle.high >= target:
            return candle.closes_at, max(target, candle.open), "take_profit"
    raise AssertionError("neither the stop nor the target was reached")


async def _backtest(tmp_path: Path, *, move: bool) -> tuple[Any, list[dict[str, str]], Any]:
    with ScriptedServer(responder=protected_trader(move=move)) as server:
        record = await run_backtest(_run_spec(tmp_path, server.base_url))
        out = tmp_path / "report"
        out.mkdir()
        write_report(record, out)
        with (out / "trades.csv").open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        return record, rows, server


async def test_the_stop_and_the_target_show_in_trades_csv_and_move_as_the_rule_says(
        tmp_path: Path) -> None:
    record, rows, server = await _backtest(tmp_path / "still", move=False)
    candles = record.candles["BTC/USDT"]
    [entry, exit_fill] = record.fills
    assert [row["exit_reason"] for row in rows] == ["stop_loss"]
    [row] = rows
    assert Decimal(row["entry_price"]) == entry.price
    assert Decimal(row["exit_price"]) == exit_fill.price
    placed = _arguments(server, "place_order")
    stop, target = Decimal(placed["stop_loss"]), Decimal(placed["take_profit"])
    closed_at, price, reason = _expected_exit(candles, entry.filled_at, [(entry.filled_at,
                                                                          stop)], target)
    assert (exit_fill.price, row["exit_reason"]) == (price, reason)
    assert row["closed_at"] == closed_at.isoformat()
    assert Decimal(row["profit"]) == (price - entry.price) * entry.amount - entry.fee - \
        exit_fill.fee
    # The desk is told at once, as a turn of its own.
    told = [d for d in record.decisions if d.trigger == "command: protection"]
    assert [d.at for d in told] == [closed_at]
    assert "the BTC/USDT stop-loss at" in told[0].transcript[0].text

    moved_record, moved_rows, moved_server = await _backtest(tmp_path / "moved", move=True)
    moved_entry, moved_exit = moved_record.fills
    assert moved_entry.price == entry.price  # the same entry, the same first decision
    moving = moved_record.decisions[1]
    assert any("set_protection" in entry.text for entry in moving.transcript)
    new_stop = Decimal(_arguments(moved_server, "set_protection")["stop_loss"])
    closed_at, price, reason = _expected_exit(
        candles, entry.filled_at, [(entry.filled_at, stop), (moving.at, new_stop)], target)
    [moved_row] = moved_rows
    assert (moved_exit.price, moved_row["exit_reason"]) == (price, reason)
    assert moved_row["closed_at"] == closed_at.isoformat()
    assert moved_exit.price != exit_fill.price  # the move changed the figures
    assert Decimal(moved_row["profit"]) != Decimal(row["profit"])


async def test_a_masked_desk_sets_its_stop_in_masked_prices_and_it_fires_in_real_terms(
        tmp_path: Path) -> None:
    """The model reads ASSET/USD at masked prices and sets its stop and target there; the
    real keeper fires them on the real candles by the same rule, and the turn that tells the
    desk says it in masked terms: no real symbol, price or date reaches the model."""
    mask = choose_mask(["BTC/USDT"], parse_time("2023-01-06"), 0)
    step = mask.price(Decimal(60))  # the plain run's distance, in the masked world's prices
    with ScriptedServer(responder=protected_trader(move=True, symbol="ASSET/USD", step=step)
                        ) as server:
        record = await run_backtest(_run_spec(tmp_path / "masked", server.base_url, mask))
    [entry, exit_fill] = record.fills
    assert entry.symbol == "BTC/USDT" and 15000 < entry.price < 20000  # real fills
    placed = _arguments(server, "place_order")
    stop = mask.real_price(Decimal(placed["stop_loss"]))
    target = mask.real_price(Decimal(placed["take_profit"]))
    moving = next(d for d in record.decisions
                  if any("set_protection" in e.text for e in d.transcript))
    new_stop = mask.real_price(Decimal(_arguments(server, "set_protection")["stop_loss"]))
    closed_at, price, reason = _expected_exit(
        record.candles["BTC/USDT"], entry.filled_at,
        [(entry.filled_at, stop), (moving.at, new_stop)], target)
    assert (exit_fill.price, exit_fill.filled_at) == (price, closed_at)
    [told] = [d for d in record.decisions if d.trigger == "command: protection"]
    said = told.transcript[0].text
    kind = "stop-loss" if reason == "stop_loss" else "take-profit"
    assert f"the ASSET/USD {kind} at" in said
    assert f"at {format_price(mask.price(price))} " in said
    candle = mask.time(closed_at - timedelta(minutes=5))
    assert f"fired on the candle of {candle:%Y-%m-%d %H:%M} UTC" in said
    bodies = [request.body.decode() for request in server.requests]
    assert not any("BTC" in body or "USDT" in body or "2023-01" in body for body in bodies)
    assert any(f"ASSET/USD {kind} at" in body for body in bodies)  # get_positions, the turn
