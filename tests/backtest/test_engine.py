"""The engine: several symbols, scripted operator messages, a desk that trades on both."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from tests.backtest.trader import trading_responder
from tests.scripted_server import ScriptedServer
from trading_agent.backtest.engine import (
    BacktestSpec,
    ScriptedMessage,
    load_scripted_messages,
    parse_time,
    run_backtest,
)
from trading_agent.backtest.metrics import compute_figures
from trading_agent.errors import ConfigError
from trading_agent.settings import load_settings
from trading_agent.trading.config import PACKAGED_CANDLES

CONFIG = """
[daemon]
state_dir = "state"

[model]
provider = "openai"
base_url = "{url}"
model = "scripted-trader"
context_window = 32000

[desks.pair]
system_prompt = "You trade BTC/USDT and ETH/USDT."
symbols = ["BTC/USDT", "ETH/USDT"]

[desks.pair.risk]
allowed_symbols = ["BTC/USDT", "ETH/USDT"]

[desks.pair.triggers]
schedules = [{{ every = "2h", name = "check", message = "Check." }}]

[desks.pair.exchange.replay.files]
"BTC/USDT" = "{btc}"
"ETH/USDT" = "{eth}"
"""


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with ScriptedServer(responder=trading_responder) as scripted:
        yield scripted


def _eth_file(path: Path) -> Path:
    """ETH made from the packaged BTC candles: every price × 0.07, so it moves alike."""
    lines = PACKAGED_CANDLES.read_text().splitlines()
    scaled = [lines[0]]
    for line in lines[1:]:
        stamp, *prices, volume = line.split(",")
        scaled.append(",".join([stamp, *(str(Decimal(p) * Decimal("0.07")) for p in prices),
                                volume]))
    path.write_text("\n".join(scaled) + "\n")
    return path


def _spec(tmp_path: Path, server: ScriptedServer, **kwargs: object) -> BacktestSpec:
    config = tmp_path / "pair.toml"
    config.write_text(CONFIG.format(url=server.base_url, btc=PACKAGED_CANDLES,
                                    eth=_eth_file(tmp_path / "eth.csv")))
    return BacktestSpec(load_settings(config), "pair", parse_time("2023-01-06"),
                        parse_time("2023-01-06T08:00"), cache_dir=tmp_path / "cache",
                        source=str(config), **kwargs)  # type: ignore[arg-type]


async def test_a_desk_on_two_symbols_is_valued_and_compared_on_both(
        tmp_path: Path, server: ScriptedServer) -> None:
    record = await run_backtest(_spec(tmp_path, server))

    assert set(record.candles) == {"BTC/USDT", "ETH/USDT"}
    assert all(len(candles) == 96 for candles in record.candles.values())
    assert len(record.equity) == 96 and len(record.decisions) == 4  # 02:00 ... 08:00
    assert [(d.at.hour, d.trigger) for d in record.decisions] == [
        (2, "schedule: check"), (4, "schedule: check"), (6, "schedule: check"),
        (8, "schedule: check")]
    figures = compute_figures(record)
    btc, eth = record.candles["BTC/USDT"], record.candles["ETH/USDT"]
    each = [float(c[-1].close / c[0].open - 1) for c in (btc, eth)]
    assert figures.buy_and_hold_return == pytest.approx(sum(each) / 2)


async def test_scripted_operator_messages_reach_the_desk_at_their_time(
        tmp_path: Path, server: ScriptedServer) -> None:
    messages = [ScriptedMessage(parse_time("2023-01-06T03:12"), "Stop buying until 06:00.")]
    record = await run_backtest(_spec(tmp_path, server, messages=messages))

    spoken = [d for d in record.decisions if d.trigger.startswith("operator")]
    assert len(spoken) == 1
    # Delivered at the first close at or after 03:12: the 03:15 step.
    assert spoken[0].at == parse_time("2023-01-06T03:15")
    assert spoken[0].transcript[0].kind == "operator"
    assert "Stop buying until 06:00." in spoken[0].transcript[0].text
    asked = [request for request in server.requests
             if any("Stop buying" in str(m.get("content")) for m in request.messages)]
    assert asked, "the model was never told"


async def test_a_buy_then_a_sell_is_one_round_trip_of_the_books(
        tmp_path: Path, server: ScriptedServer) -> None:
    """The scripted trader buys 0.01 BTC at 02:00, sells it at 04:00, buys again at 06:00 and
    sells at 08:00, the end (that order never fills). Each market order fills at the open of
    the candle opening at its decision, slipped and charged the taker fee."""
    spec = _spec(tmp_path, server)
    record = await run_backtest(spec)
    paper = spec.settings.desks["pair"].exchange.paper
    btc = {candle.opened_at: candle for candle in record.candles["BTC/USDT"]}
    amount = Decimal("0.01")

    def filled(hour: int, side: str) -> tuple[Decimal, Decimal]:
        """Price and fee of a market order decided at ``hour``:00, worked out by hand."""
        slip = paper.slippage_bps / Decimal(10_000)
        price = btc[parse_time(f"2023-01-06T{hour:02d}:00")].open * (
            1 + slip if side == "buy" else 1 - slip)
        return price, amount * price * paper.taker_fee

    entry, entry_fee = filled(2, "buy")
    exit_price, exit_fee = filled(4, "sell")
    again, again_fee = filled(6, "buy")
    assert [(f.side, f.filled_at.hour, f.price, f.fee, f.turn) for f in record.fills] == [
        ("buy", 2, entry, entry_fee, "t000001"), ("sell", 4, exit_price, exit_fee, "t000002"),
        ("buy", 6, again, again_fee, "t000003")]
    assert [d.turn for d in record.decisions] == ["t000001", "t000002", "t000003", "t000004"]

    closed, still = record.trades
    assert (closed.symbol, closed.side, closed.amount) == ("BTC/USDT", "long", amount)
    assert (closed.opened_at, closed.closed_at) == (parse_time("2023-01-06T02:00"),
                                                    parse_time("2023-01-06T04:00"))
    assert (closed.entry_price, closed.exit_price) == (entry, exit_price)
    assert closed.fees == entry_fee + exit_fee
    assert closed.profit == (exit_price - entry) * amount - entry_fee - exit_fee
    assert (closed.exit_reason, closed.opened_turn, closed.closed_turn) == (
        "decision", "t000001", "t000002")
    # The second is open at the end: it has realized nothing but its entry fee.
    assert still.is_open and (still.opened_at, still.entry_price) == (
        parse_time("2023-01-06T06:00"), again)
    assert (still.profit, still.fees, still.opened_turn) == (-again_fee, again_fee, "t000003")

    figures = compute_figures(record)
    assert (figures.trades, figures.open_trades, figures.fills) == (1, 1, 3)
    assert figures.win_rate == (1.0 if closed.profit > 0 else 0.0)
    assert figures.realized_profit == float(closed.profit - again_fee)
    assert figures.fees == float(entry_fee + exit_fee + again_fee)


def test_a_messages_file_is_read_in_time_order_with_its_line_breaks(tmp_path: Path) -> None:
    path = tmp_path / "messages.txt"
    path.write_text("# the operator's day\n2023-01-06T03:00 Hold.\n\n"
                    "2023-01-06T05:00Z Sell half.\\nThen wait.\n")

    assert load_scripted_messages(path) == [
        ScriptedMessage(parse_time("2023-01-06T03:00"), "Hold."),
        ScriptedMessage(parse_time("2023-01-06T05:00"), "Sell half.\nThen wait.")]

    path.write_text("2023-01-06T05:00 Later.\n2023-01-06T03:00 Earlier.\n")
    with pytest.raises(ConfigError, match=r"messages.txt:2: the messages must be in time"):
        load_scripted_messages(path)


def test_transcripts_wait_for_the_report_in_a_file_not_in_memory() -> None:
    from trading_agent.backtest.record import TranscriptEntry, TranscriptSpool

    spool = TranscriptSpool()
    entries = [TranscriptEntry("trigger", "Hourly check."),
               TranscriptEntry("tool_result", "BTC/USDT last 16,819.90 · 24h +0.99% ✓", True),
               TranscriptEntry("text", "half an emoji \ud83d")]
    spooled = spool.add(entries)
    other = spool.add([TranscriptEntry("text", "another decision")])

    assert not isinstance(spooled, tuple) and len(spooled) == 3
    assert "16,819.90" not in repr(vars(spooled))  # held: a place in the file, no text
    assert list(spooled) == entries and spooled[1].is_error
    assert [e.text for e in other] == ["another decision"]
    spool.close()


async def test_pinned_instructions_of_the_config_are_in_every_request_of_the_run(
        tmp_path: Path, server: ScriptedServer) -> None:
    config = tmp_path / "pinned.toml"
    config.write_text(CONFIG.format(url=server.base_url, btc=PACKAGED_CANDLES,
                                    eth=_eth_file(tmp_path / "eth.csv")).replace(
        'symbols = ["BTC/USDT", "ETH/USDT"]\n',
        'symbols = ["BTC/USDT", "ETH/USDT"]\n'
        'pinned = ["Never hold more than 0.1 BTC.", "  Quote the time of every price.  "]\n', 1))
    spec = BacktestSpec(load_settings(config), "pair", parse_time("2023-01-06"),
                        parse_time("2023-01-06T04:00"), cache_dir=tmp_path / "cache",
                        source=str(config))
    await run_backtest(spec)

    systems = [str(r.messages[0]["content"]) for r in server.requests]
    assert len(systems) >= 2
    assert all(system.startswith("You trade BTC/USDT and ETH/USDT.\n\n") for system in systems)
    assert all("[1] Never hold more than 0.1 BTC.\n[2] Quote the time of every price.\n"
               in system for system in systems)


def test_an_empty_pinned_instruction_is_refused_naming_the_file_and_key(
        tmp_path: Path) -> None:
    config = tmp_path / "pinned.toml"
    config.write_text(CONFIG.format(url="http://127.0.0.1:9/v1", btc=PACKAGED_CANDLES,
                                    eth=PACKAGED_CANDLES).replace(
        'symbols = ["BTC/USDT", "ETH/USDT"]\n',
        'symbols = ["BTC/USDT", "ETH/USDT"]\npinned = ["Hold.", " "]\n', 1))
    with pytest.raises(ConfigError) as refused:
        load_settings(config)
    message = str(refused.value)
    assert "pinned.toml" in message and "desks.pair.pinned" in message, message
    assert "[1] is empty" in message, message
