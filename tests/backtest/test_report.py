"""The report of a backtest as a user opens it: report.json, trades.csv, fills.csv,
equity.png and report.html, written from a realistic record; a comparison of two runs; the
terminal table."""

from __future__ import annotations

import csv
import io
import json
import random
import re
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from PIL import Image

from trading_agent.backtest.metrics import compute_figures
from trading_agent.backtest.record import (
    BacktestRecord,
    Decision,
    EquityPoint,
    FillRecord,
    ModelUsage,
    TranscriptEntry,
)
from trading_agent.backtest.report import (
    CHART_SIZE,
    FILL_COLUMNS,
    TRADE_COLUMNS,
    equity_chart_png,
    summary_table,
    write_comparison,
    write_report,
)
from trading_agent.tools.charts import DARK
from trading_agent.trading.books import BookFill, BookPosition, RoundTrip, apply_fill
from trading_agent.trading.exchange import Candle

START = datetime(2023, 1, 5, tzinfo=UTC)
HOUR = timedelta(hours=1)
FEE_RATE = Decimal("0.001")
TRICKY_REASON = 'BTC broke 17,000, "cleanly",\nso I bought; stop at 16,650.'
SCRIPT = '<script>alert("owned")</script>'

Color = tuple[int, int, int]


def round_trips(fills: Sequence[FillRecord]) -> list[RoundTrip]:
    """The round trips a desk's books make of these fills, by the books' own accounting (as
    a backtest's books count the paper fills)."""
    positions: dict[str, BookPosition] = {}
    holding: dict[str, RoundTrip] = {}
    trips: list[RoundTrip] = []
    for number, fill in enumerate(fills, start=1):
        book = BookFill(f"P{number}@{fill.amount}", f"P{number}", fill.client_order_id,
                        fill.symbol, fill.side, fill.amount, fill.price, fill.fee, "USDT",
                        fill.filled_at, fill.turn)
        effect = apply_fill(positions.get(fill.symbol) or BookPosition(fill.symbol),
                            holding.get(fill.symbol), book)
        positions[fill.symbol] = effect.position
        if effect.closed is not None:
            trips[effect.closed.id - 1] = effect.closed
            del holding[fill.symbol]
        if effect.opened is not None:
            trips.append(replace(effect.opened, id=len(trips) + 1))
            holding[fill.symbol] = trips[-1]
        elif effect.updated is not None:
            trips[effect.updated.id - 1] = holding[fill.symbol] = effect.updated
    return trips


def make_record(*, seed: int = 11, hours: int = 300, desk: str = "btc-swing",
                wake_every: int = 12) -> BacktestRecord:
    """A run of a desk over two symbols, hourly, waking every ``wake_every`` candles.

    Prices walk at random (seeded); the desk buys and sells on a fixed plan, each market
    order filling at the next candle's open with a 0.1% fee, as the engine fills them. The
    equity is marked at every close.
    """
    walk = random.Random(seed)
    prices = {"BTC/USDT": Decimal("16800"), "ETH/USDT": Decimal("1250")}
    candles: dict[str, list[Candle]] = {symbol: [] for symbol in prices}
    for index in range(hours):
        for symbol, last in prices.items():
            close = (last * Decimal(str(round(1 + walk.gauss(0.0004, 0.006), 6)))).quantize(
                Decimal("0.01"))
            high = max(last, close) * Decimal("1.002")
            low = min(last, close) * Decimal("0.998")
            candles[symbol].append(Candle(symbol, "1h", START + index * HOUR, last,
                                          high.quantize(Decimal("0.01")),
                                          low.quantize(Decimal("0.01")), close,
                                          Decimal(walk.randint(50, 500))))
            prices[symbol] = close
    # The plan: decision number → (symbol, side, share of cash or of the holding).
    plan = {2: ("BTC/USDT", "buy", Decimal("0.6")), 5: ("BTC/USDT", "sell", Decimal(1)),
            7: ("ETH/USDT", "buy", Decimal("0.5")), 12: ("ETH/USDT", "sell", Decimal("0.5")),
            16: ("BTC/USDT", "buy", Decimal("0.4")), 18: ("ETH/USDT", "sell", Decimal(1)),
            22: ("BTC/USDT", "sell", Decimal(1))}
    cash = Decimal(10_000)
    held = {symbol: Decimal(0) for symbol in prices}
    pending: list[tuple[Decision, str, str, Decimal]] = []
    decisions: list[Decision] = []
    fills: list[FillRecord] = []
    equity: list[EquityPoint] = []
    for index in range(hours):
        for decision, symbol, side, share in pending:
            candle = candles[symbol][index]
            price = candle.open
            if side == "buy":
                amount = (cash * share / price / (1 + FEE_RATE)).quantize(Decimal("0.00001"))
            else:
                amount = (held[symbol] * share).quantize(Decimal("0.00001"))
            fee = (amount * price * FEE_RATE).quantize(Decimal("0.0001"))
            if side == "buy":
                cash -= amount * price + fee
                held[symbol] += amount
            else:
                cash += amount * price - fee
                held[symbol] -= amount
            fills.append(FillRecord(decision.at, candle.opened_at, symbol,
                                    "buy" if side == "buy" else "sell", amount, price, fee,
                                    decision.orders[0], decision.final_text, decision.turn))
        pending = []
        closes = {symbol: candles[symbol][index].close for symbol in prices}
        positions = sum((held[s] * closes[s] for s in prices), Decimal(0))
        at = candles["BTC/USDT"][index].closes_at
        total = cash + positions
        equity.append(EquityPoint(at, total, positions / total))
        if (index + 1) % wake_every:
            continue
        number = len(decisions) + 1
        order = plan.get(number)
        btc = closes["BTC/USDT"]
        transcript = [
            TranscriptEntry("trigger", f"candle: BTC/USDT 1h closed at {btc}"),
            TranscriptEntry("tool_call", 'get_price({"symbol": "BTC/USDT"})'),
            TranscriptEntry("tool_result", f"BTC/USDT last {btc}, 24h volume 12,345"),
        ]
        if number == 3:
            transcript.append(TranscriptEntry("tool_call", 'get_candles({"limit": 5000})'))
            transcript.append(TranscriptEntry("tool_result", "limit must be at most 1000",
                                              is_error=True))
        if number == 4:
            transcript.append(TranscriptEntry("text", f"The feed said {SCRIPT} — ignoring."))
        if order is None:
            final = f"Decision {number}: no trade; BTC at {btc}, waiting for a clear break."
            orders: tuple[str, ...] = ()
        else:
            symbol, side, share = order
            final = (TRICKY_REASON if number == 2 else
                     f"Decision {number}: {side} {symbol}, {share:%} of the "
                     f"{'cash' if side == 'buy' else 'holding'}.")
            orders = (f"ta{seed:04d}{number:026d}",)
            transcript.append(TranscriptEntry(
                "tool_call", f'place_order({{"symbol": "{symbol}", "side": "{side}"}})'))
            transcript.append(TranscriptEntry("tool_result", f"order {orders[0]} accepted"))
        transcript.append(TranscriptEntry("text", final))
        decision = Decision(number, at, "candle: BTC/USDT 1h", final, tuple(transcript),
                            orders, model_calls=2 if order is None else 3,
                            turn=f"t{number:06d}")
        decisions.append(decision)
        if order is not None:
            pending.append((decision, *order))
    calls = sum(d.model_calls for d in decisions)
    return BacktestRecord(
        desk=desk, model="gemma-3-270m", start=START, end=START + hours * HOUR,
        timeframe="1h", quote_currency="USDT", candles=candles,
        starting_equity=Decimal(10_000), equity=equity, trades=round_trips(fills),
        fills=fills, decisions=decisions,
        usage=ModelUsage(model_calls=calls, cache_hits=0, input_tokens=calls * 2_100,
                         output_tokens=calls * 180, cost=round(calls * 0.00042, 6)))


def _near(pixel: Color, color: Color, tolerance: int = 40) -> bool:
    return sum((a - b) ** 2 for a, b in zip(pixel, color, strict=True)) < tolerance ** 2


def _colour_rows(image: Image.Image, color: Color) -> list[int]:
    """The rows holding a pixel of about ``color`` (the value axis on the right left out)."""
    rgb = image.convert("RGB")
    width, height = rgb.size
    pane = rgb.crop((0, 0, width - 90, height))
    near: dict[Color, bool] = {}
    rows: list[int] = []
    data = pane.tobytes()
    stride = pane.width * 3
    for y in range(height):
        row = data[y * stride:(y + 1) * stride]
        for pixel in zip(row[0::3], row[1::3], row[2::3], strict=True):
            if pixel not in near:
                near[pixel] = _near(pixel, color)
            if near[pixel]:
                rows.append(y)
                break
    return rows


@pytest.fixture(scope="module")
def record() -> BacktestRecord:
    return make_record()


@pytest.fixture
def written(record: BacktestRecord, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    write_report(record, out)
    return out


def test_the_record_is_realistic(record: BacktestRecord) -> None:
    assert len(record.equity) == 300
    assert len(record.decisions) == 25
    assert len(record.fills) == 7
    assert {f.side for f in record.fills} == {"buy", "sell"}
    # BTC bought and sold whole, ETH bought and sold in two halves, BTC again: three round
    # trips, all closed by the end.
    assert [(t.symbol, t.opened_turn, t.closed_turn) for t in record.trades] == [
        ("BTC/USDT", "t000002", "t000005"), ("ETH/USDT", "t000007", "t000018"),
        ("BTC/USDT", "t000016", "t000022")]
    assert not any(t.is_open for t in record.trades)


def test_report_json_holds_the_figures(record: BacktestRecord, written: Path) -> None:
    text = (written / "report.json").read_text()
    content = json.loads(text)
    figures = compute_figures(record)
    assert content == json.loads(json.dumps(figures.to_json()))
    assert list(content)[:4] == ["desk", "model", "from", "to"]
    assert content["desk"] == "btc-swing"
    assert content["from"] == "2023-01-05T00:00:00+00:00"
    assert content["to"] == "2023-01-17T12:00:00+00:00"
    assert content["candles"] == 300 and content["decisions"] == 25
    # Trades are the round trips of the books; the fills are counted apart.
    assert (content["trades"], content["open_trades"], content["fills"]) == (3, 0, 7)
    final = record.equity[-1].equity
    assert content["total_return"] == pytest.approx(float(final / 10_000 - 1))
    assert content["fees"] == pytest.approx(float(sum(f.fee for f in record.fills)))
    # Every trade closed, so what they realized is the whole change of the equity.
    assert content["realized_profit"] == pytest.approx(float(final - 10_000))
    wins = sum(1 for t in record.trades if t.profit > 0)
    assert 0 < wins < 3 and content["win_rate"] == pytest.approx(wins / 3)
    assert 0 < content["max_drawdown"] < 0.5
    assert 0 < content["exposure"] < 1
    assert text.startswith('{\n  "desk": "btc-swing",')  # indented, for people too


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_trades_csv_has_one_row_per_round_trip(record: BacktestRecord, written: Path) -> None:
    raw = (written / "trades.csv").read_bytes().decode()
    assert raw.splitlines()[0] == ",".join(TRADE_COLUMNS) == (
        "opened_at,closed_at,symbol,side,amount,entry_price,exit_price,profit,"
        "profit_percent,fees,exit_reason,opened_turn,closed_turn")
    rows = _rows(written / "trades.csv")
    assert len(rows) == len(record.trades) == 3
    # The first, by hand: decision 2 bought BTC at the next open, decision 5 sold it all.
    buy, sell = record.fills[0], record.fills[1]
    first = rows[0]
    assert (first["opened_at"], first["closed_at"]) == (buy.filled_at.isoformat(),
                                                        sell.filled_at.isoformat())
    assert first["opened_at"] == "2023-01-06T00:00:00+00:00"
    assert (first["symbol"], first["side"], first["exit_reason"]) == ("BTC/USDT", "long",
                                                                      "decision")
    assert Decimal(first["amount"]) == buy.amount == sell.amount
    assert Decimal(first["entry_price"]) == buy.price
    assert Decimal(first["exit_price"]) == sell.price
    assert Decimal(first["fees"]) == buy.fee + sell.fee
    assert Decimal(first["profit"]) == (sell.price - buy.price) * buy.amount - buy.fee - sell.fee
    assert Decimal(first["profit_percent"]) == (
        Decimal(first["profit"]) / (buy.price * buy.amount) * 100).quantize(Decimal("0.0001"))
    assert (first["opened_turn"], first["closed_turn"]) == ("t000002", "t000005")
    for row, trade in zip(rows, record.trades, strict=True):
        assert Decimal(row["profit"]) == trade.profit and row["profit"] == str(trade.profit)
        assert row["closed_at"] == (trade.closed_at.isoformat() if trade.closed_at else "")


def test_an_open_round_trip_is_listed_as_open(tmp_path: Path) -> None:
    record = make_record(hours=48)  # decision 2 bought BTC; nothing sold it
    write_report(record, tmp_path)
    [row] = _rows(tmp_path / "trades.csv")
    [buy] = record.fills
    assert (row["closed_at"], row["exit_price"], row["exit_reason"]) == ("", "", "open")
    assert (row["opened_turn"], row["closed_turn"]) == ("t000002", "")
    # What it realized so far: nothing but its entry fee.
    assert Decimal(row["profit"]) == -buy.fee and Decimal(row["fees"]) == buy.fee
    content = json.loads((tmp_path / "report.json").read_text())
    assert (content["trades"], content["open_trades"], content["fills"]) == (0, 1, 1)
    assert content["win_rate"] is None
    assert content["realized_profit"] == pytest.approx(float(-buy.fee))
    page = (tmp_path / "report.html").read_text()
    assert "<td>open</td>" in page and "what it realized so far" in page


def test_fills_csv_reads_back_exactly(record: BacktestRecord, written: Path) -> None:
    raw = (written / "fills.csv").read_bytes().decode()
    assert raw.splitlines()[0] == ",".join(FILL_COLUMNS) == (
        "decided_at,filled_at,symbol,side,amount,price,fee,client_order_id,reason")
    rows = _rows(written / "fills.csv")
    assert len(rows) == len(record.fills)
    for row, fill in zip(rows, record.fills, strict=True):
        assert row["decided_at"] == fill.decided_at.isoformat()
        assert row["filled_at"] == fill.filled_at.isoformat()
        assert (row["symbol"], row["side"]) == (fill.symbol, fill.side)
        assert Decimal(row["amount"]) == fill.amount and row["amount"] == str(fill.amount)
        assert Decimal(row["price"]) == fill.price
        assert row["fee"] == str(fill.fee)
        assert row["client_order_id"] == fill.client_order_id
        assert row["reason"] == fill.reason
    assert rows[0]["reason"] == TRICKY_REASON  # comma, quotes and a newline survive
    assert rows[0]["decided_at"] == "2023-01-06T00:00:00+00:00"
    assert rows[0]["filled_at"] == "2023-01-06T00:00:00+00:00"


def test_tiny_amounts_are_written_in_full(tmp_path: Path) -> None:
    record = make_record(hours=48)
    record.fills[0] = replace(record.fills[0], amount=Decimal("1E-8"), fee=Decimal("0E-10"))
    record.trades = round_trips(record.fills)
    write_report(record, tmp_path)
    row = _rows(tmp_path / "fills.csv")[0]
    assert row["amount"] == "0.00000001"
    assert row["fee"] == "0.0000000000"
    trade = _rows(tmp_path / "trades.csv")[0]
    assert trade["amount"] == "0.00000001"
    assert trade["fees"] == "0.0000000000"


def test_the_chart_shows_equity_buy_and_hold_and_drawdown(written: Path) -> None:
    with Image.open(written / "equity.png") as image:
        assert image.format == "PNG"
        assert image.size == CHART_SIZE
        equity_rows = _colour_rows(image, DARK.slow_average)
        benchmark_rows = _colour_rows(image, DARK.fast_average)
        drawdown_rows = _colour_rows(image, DARK.down)
    height = CHART_SIZE[1]
    pane_split = 66 + (height - 26 - 66 - 14) * 0.7
    # The desk's line and buy-and-hold are in the top pane (the legend above it too)...
    assert [y for y in equity_rows if 66 < y < pane_split]
    assert [y for y in benchmark_rows if 66 < y < pane_split]
    # ...and the drawdown below it.
    assert [y for y in drawdown_rows if pane_split < y < height - 26]
    assert not [y for y in drawdown_rows if 66 < y < pane_split - 5]


def test_a_long_run_keeps_a_one_candle_spike(tmp_path: Path) -> None:
    """100,000 points reduced to the pixel width still show a spike of a single candle."""
    record = make_record(hours=48)
    base = record.equity[0]
    points = [EquityPoint(base.at + i * timedelta(minutes=5), Decimal(10_000), Decimal(0))
              for i in range(100_000)]
    points[61_234] = EquityPoint(points[61_234].at, Decimal(12_000), Decimal(1))
    record.equity = points
    record.end = points[-1].at
    record.timeframe = "5m"
    with Image.open(io.BytesIO(equity_chart_png([record]))) as image:
        rows = _colour_rows(image, DARK.slow_average)
    # The spike reaches the top of the equity pane (12,000 is the highest value drawn).
    assert [y for y in rows if 66 < y < 110], rows[:20]


def test_the_page_is_self_contained(written: Path) -> None:
    page = (written / "report.html").read_text()
    references = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", page)
    assert references, "the page links its chart and its decisions"
    for reference in references:
        assert reference.startswith(("#", "data:image/png;base64,")), reference
    assert "http://" not in page and "https://" not in page
    assert "@import" not in page and "url(" not in page
    assert "<script" not in page  # no script of ours, and none from a transcript
    assert "<link" not in page


def test_the_page_shows_figures_trades_and_every_decision(record: BacktestRecord,
                                                          written: Path) -> None:
    page = (written / "report.html").read_text()
    figures = compute_figures(record)
    assert "<title>Backtest of btc-swing · gemma-3-270m</title>" in page
    assert "2023-01-05 00:00 to 2023-01-17 12:00 UTC" in page
    row = re.search(r'<tr data-figure="total_return"><th scope="row">Total return</th>'
                    r"<td>([^<]*)</td></tr>", page)
    assert row is not None and row.group(1) == f"{figures.total_return * 100:+.2f}%"
    ids = re.findall(r'<details class="decision" id="decision-(\d+)">', page)
    assert ids == [str(n) for n in range(1, 26)]
    # Each trade links to the decisions that opened and closed it, with its profit...
    trades = re.search(r'<table class="trades">(.*?)</table>', page, re.DOTALL)
    assert trades is not None
    links = re.findall(r'<a href="#decision-(\d+)">', trades.group(1))
    assert links == ["2", "5", "7", "18", "16", "22"]
    for trade in record.trades:
        row = re.search(rf'<tr data-trade="{trade.id}">(.*?)</tr>', trades.group(1))
        assert row is not None and f">{trade.profit}</td>" in row.group(1)
    # ...and each fill to the decision that placed it.
    fills = re.search(r'<table class="fills">(.*?)</table>', page, re.DOTALL)
    assert fills is not None
    links = re.findall(r'<a href="#decision-(\d+)">', fills.group(1))
    assert links == ["2", "5", "7", "12", "16", "18", "22"]
    # Model output is shown as text, never run.
    assert html_escaped(SCRIPT) in page
    # A failed tool call is marked as such.
    assert '<li class="entry tool_result error"><span class="kind">tool result · error</span>' \
           "<pre>limit must be at most 1000</pre>" in page
    assert page.count("data:image/png;base64,") == 1


def html_escaped(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace(
        '"', "&quot;")


def test_two_writes_of_one_record_are_identical(record: BacktestRecord, written: Path,
                                                tmp_path: Path) -> None:
    again = tmp_path / "again"
    again.mkdir()
    write_report(record, again)
    names = sorted(p.name for p in written.iterdir())
    assert names == ["equity.png", "fills.csv", "report.html", "report.json", "trades.csv"]
    assert sorted(p.name for p in again.iterdir()) == names
    for name in names:
        assert (again / name).read_bytes() == (written / name).read_bytes(), name


def test_an_empty_record_is_refused_and_nothing_is_written(record: BacktestRecord,
                                                          tmp_path: Path) -> None:
    empty = make_record(hours=24)
    empty.equity = []
    with pytest.raises(ValueError, match="no equity point"):
        write_report(empty, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_comparison_puts_runs_side_by_side(tmp_path: Path) -> None:
    calm = make_record(seed=11, desk="btc-swing")
    eager = make_record(seed=11, desk="btc-scalper", wake_every=6)
    figures = write_comparison([calm, eager], ["swing prompt", "Scalper v2"], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "equity.png", "fills-scalper-v2.csv", "fills-swing-prompt.csv", "report.html",
        "report.json", "trades-scalper-v2.csv", "trades-swing-prompt.csv"]
    content = json.loads((tmp_path / "report.json").read_text())
    assert content["from"] == "2023-01-05T00:00:00+00:00"
    assert content["to"] == "2023-01-17T12:00:00+00:00"
    assert [run["label"] for run in content["runs"]] == ["swing prompt", "Scalper v2"]
    assert [run["desk"] for run in content["runs"]] == ["btc-swing", "btc-scalper"]
    assert [run["decisions"] for run in content["runs"]] == [25, 50]
    assert content["runs"][1]["total_return"] == pytest.approx(figures[1].total_return)
    # Same span, same candles: the same buy-and-hold for both.
    assert content["runs"][0]["buy_and_hold_return"] == content["runs"][1][
        "buy_and_hold_return"]
    assert len(_rows(tmp_path / "trades-scalper-v2.csv")) == len(eager.trades)
    assert len(_rows(tmp_path / "fills-scalper-v2.csv")) == len(eager.fills)
    assert len(_rows(tmp_path / "fills-swing-prompt.csv")) == len(calm.fills) == 7
    assert [run["trades"] for run in content["runs"]] == [
        sum(1 for t in run.trades if not t.is_open) for run in (calm, eager)]

    page = (tmp_path / "report.html").read_text()
    header = re.search(r"<table class=\"figures\">\n<thead><tr><th></th>(.*?)</tr></thead>",
                       page)
    assert header is not None
    assert header.group(1) == ('<th scope="col">swing prompt</th>'
                               '<th scope="col">Scalper v2</th>')
    row = re.search(r'<tr data-figure="decisions"><th scope="row">Decisions</th>(.*?)</tr>',
                    page)
    assert row is not None and row.group(1) == "<td>25</td><td>50</td>"
    assert page.count('<details class="decision" id="decision-swing-prompt-') == 25
    assert page.count('<details class="decision" id="decision-scalper-v2-') == 50
    assert '<a href="#decision-scalper-v2-' in page
    with Image.open(tmp_path / "equity.png") as image:
        assert image.size == CHART_SIZE
        assert _colour_rows(image, DARK.up)  # the second run's colour


def test_a_comparison_refuses_other_spans_and_repeated_labels(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="same span"):
        write_comparison([make_record(hours=48), make_record(hours=72)], ["a", "b"], tmp_path)
    with pytest.raises(ValueError, match="must differ"):
        write_comparison([make_record(hours=48), make_record(hours=48)], ["a", "a"], tmp_path)
    with pytest.raises(ValueError, match="one label per run"):
        write_comparison([make_record(hours=48)], ["a", "b"], tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_summary_table_shows_the_figures(record: BacktestRecord) -> None:
    figures = compute_figures(record)
    flat = compute_figures(make_record(hours=24))  # no sell yet: no win rate
    table = summary_table([("swing", figures), ("flat", flat)])
    lines = table.splitlines()
    assert lines[0].split() == ["swing", "flat"]
    by_name = {line[:16].strip(): line[16:].split() for line in lines[2:]}
    assert by_name["Total return"][0] == f"{figures.total_return * 100:+.2f}%"
    assert by_name["Total return"][1] == "+0.00%"
    assert by_name["Win rate"][1] == "n/a"
    assert by_name["Fees"][:2] == [f"{figures.fees:,.2f}", "USDT"]
    assert by_name["Realized profit"][:2] == [f"{figures.realized_profit:,.2f}", "USDT"]
    assert by_name["Trades"] == ["3", "0"] and by_name["Fills"] == ["7", "0"]
    assert by_name["Open trades"] == ["0", "0"]
    assert by_name["Final equity"][:2] == [f"{figures.final_equity:,.2f}", "USDT"]
    assert by_name["Decisions"] == ["25", "2"]
    assert by_name["Sharpe"][0] == f"{figures.sharpe:.2f}"
    assert by_name["Max drawdown"][0] == f"{figures.max_drawdown * 100:.2f}%"
    print(table)


def test_half_an_emoji_from_a_broken_stream_does_not_break_the_report(tmp_path: Path) -> None:
    record = make_record(hours=48)
    record.fills[0] = replace(record.fills[0], reason="rocket \ud83d then cut")
    decision = record.decisions[0]
    record.decisions[0] = Decision(decision.index, decision.at, decision.trigger,
                                   "half \ud83d", (TranscriptEntry("text", "half \ud83d"),))
    write_report(record, tmp_path)
    assert _rows(tmp_path / "fills.csv")[0]["reason"] == "rocket \ufffd then cut"
    assert "half \ufffd" in (tmp_path / "report.html").read_text(encoding="utf-8")
