"""The mask as values: what the desk reads is consistent, what it sends back is real again,
exactly; and ``--mask`` on the command line (the property that nothing real reaches the
model is in ``tests/backtest/test_no_lookahead.py``)."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest

from tests.backtest.test_backtest_cli import backtest, write_config
from tests.backtest.trader import trading_responder
from tests.scripted_server import ScriptedServer
from trading_agent.backtest.mask import FACTORS, choose_mask
from trading_agent.errors import OrderRejectedError
from trading_agent.settings import DeskSettings
from trading_agent.trading.exchange import Candle, OrderRequest

START = datetime(2023, 1, 5, 14, 35, tzinfo=UTC)


def test_times_keep_their_weekday_and_time_of_day_and_come_back() -> None:
    for seed in range(20):
        mask = choose_mask(["BTC/USDT"], START, seed)
        moved = mask.time(START)
        assert moved.weekday() == START.weekday() and moved.time() == START.time()
        assert moved.year >= START.year + 17
        assert mask.real_time(moved) == START


def test_prices_and_amounts_scale_by_one_factor_and_quote_values_stay() -> None:
    mask = choose_mask(["BTC/USDT"], START, 1, factor=Decimal("6.4"))
    candle = Candle("BTC/USDT", "5m", START, Decimal("16850.5"), Decimal("16900"),
                    Decimal("16800.25"), Decimal("16870"), Decimal("123.45"))
    seen = mask.candle(candle)
    assert (seen.symbol, seen.close, seen.volume) == ("ASSET/USD", Decimal("107968.000"),
                                                      Decimal("19.2890625"))
    amount = Decimal("0.0123")
    assert mask.price(candle.close) * mask.amount(amount) == candle.close * amount


@pytest.mark.parametrize("factor", FACTORS)
def test_an_order_read_masked_is_sent_real_exactly(factor: Decimal) -> None:
    mask = choose_mask(["BTC/USDT"], START, factor=factor)
    request = OrderRequest("ASSET/USD", "buy", "limit", Decimal("0.0157"), Decimal("104321.77"))
    real = mask.real_request(request)
    assert real.symbol == "BTC/USDT"
    assert mask.amount(real.amount) == request.amount
    assert real.price is not None and mask.price(real.price) == request.price


def test_names_are_replaced_in_text_and_a_real_symbol_is_unknown() -> None:
    mask = choose_mask(["BTC/USDT", "ETH/USDT"], START)
    assert mask.symbols == {"BTC/USDT": "ASSET1/USD", "ETH/USDT": "ASSET2/USD"}
    text = "Trade BTC/USDT and ETH/USDT; hold BTC, count USDT. BTCX stays."
    assert mask.text(text) == ("Trade ASSET1/USD and ASSET2/USD; hold ASSET1, count USD. "
                               "BTCX stays.")
    with pytest.raises(OrderRejectedError, match="no such market; the markets are ASSET1/USD"):
        mask.real_symbol("BTC/USDT")
    assert mask.real_symbol("ASSET2/USD") == "ETH/USDT"


def test_pinned_instructions_are_masked_like_the_prompt() -> None:
    mask = choose_mask(["BTC/USDT"], START)
    config = DeskSettings.model_validate({
        "system_prompt": "You trade BTC/USDT.", "symbols": ["BTC/USDT"],
        "model": {"provider": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m",
                  "context_window": 32000},
        "pinned": ["Never hold more than 0.1 BTC."]})
    masked = mask.desk_settings(config)
    assert masked.pinned == ["Never hold more than 0.1 ASSET."]
    assert masked.system_prompt == "You trade ASSET/USD."


def test_an_offset_that_is_not_whole_weeks_is_refused() -> None:
    mask = choose_mask(["BTC/USDT"], START)
    with pytest.raises(ValueError, match="whole number of weeks"):
        type(mask)(mask.offset + (START - START.replace(hour=0)), mask.factor, mask.symbols,
                   mask.currencies)


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with ScriptedServer(responder=trading_responder) as scripted:
        yield scripted


def test_mask_on_the_command_line_trades_in_real_terms(
        tmp_path: Path, server: ScriptedServer) -> None:
    """The scripted trader buys what it reads; the model read ASSET/USD, the report is real."""
    config = write_config(tmp_path / "desk.toml", server, prompt="You trade BTC/USDT.")
    assert backtest(config, tmp_path / "out", tmp_path / "cache", "--mask") == 0
    bodies = [request.body.decode() for request in server.requests]
    assert bodies and not any("BTC" in body or "USDT" in body for body in bodies)
    assert any("ASSET/USD" in body for body in bodies)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["masked"] is True and report["symbols"] == ["BTC/USDT"]
    with (tmp_path / "out" / "fills.csv").open(newline="") as file:
        fills = list(csv.DictReader(file))
    mask = choose_mask(["BTC/USDT"], START, 0)
    # The desk's words (the reason) are what it read; the fills are real: 0.01 ASSET bought
    # is 0.01 × the factor BTC, at a real price.
    assert fills and {fill["symbol"] for fill in fills} == {"BTC/USDT"}
    assert {Decimal(fill["amount"]) for fill in fills} == {mask.real_amount(Decimal("0.01"))}
    assert all(15000 < Decimal(fill["price"]) < 20000 for fill in fills)
    assert "· masked" in (tmp_path / "out" / "report.html").read_text()
