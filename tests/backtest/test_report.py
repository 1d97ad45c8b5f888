"""The report of a backtest as a user opens it: report.json, trades.csv, equity.png and
report.html, written from a realistic record; a comparison of two runs; the terminal table."""

from __future__ import annotations

import csv
import io
import json
import random
import re
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
    ModelUsage,
    TradeRecord,
    TranscriptEntry,
)
from trading_agent.backtest.report import (
    CHART_SIZE,
    TRADE_COLUMNS,
    equity_chart_png,
    summary_table,
    write_comparison,
    write_report,
)
from trading_agent.tools.charts import DARK
from trading_agent.trading.exchange import Candle

START = datetime(2023, 1, 5, tzinfo=UTC)
HOUR = timedelta(hours=1)
FEE_RATE = Decimal("0.001")
TRICKY_REASON = 'BTC broke 17,000, "cleanly",\nso I bought; stop at 16,650.'
SCRIPT = '<script>alert("owned")</script>'

Color = tuple[int, int, int]


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
    trades: list[TradeRecord] = []
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
            trades.append(TradeRecord(decision.at, candle.opened_at, symbol,
                                      "buy" if side == "buy" else "sell", amount, price, fee,
                                      decision.orders[0], decision.final_text))
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
                            orders, model_calls=2 if order is None else 3)
        decisions.append(decision)
        if order is not None:
            pending.append((decision, *order))
    calls = sum(d.model_calls for d in decisions)
    return BacktestRecord(
        desk=desk, model="gemma-3-270m", start=START, end=START + hours * HOUR,
        timeframe="1h", quote_currency="USDT", candles=candles,
        starting_equity=Decimal(10_000), equity=equity, trades=trades, decisions=decisions,
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
    assert len(record.trades) == 7
    assert {t.side for t in record.trades} == {"buy", "sell"}


def test_report_json_holds_the_figures(record: BacktestRecord, written: Path) -> None:
    text = (written / "report.json").read_text()
    content = json.loads(text)
    figures = compute_figures(record)
    assert content == json.loads(json.dumps(figures.to_json()))
    assert list(content)[:4] == ["desk", "model", "from", "to"]
    assert content["desk"] == "btc-swing"
    assert content["from"] == "2023-01-05T00:00:00+00:00"
    assert content["to"] == "2023-01-17T12:00:00+00:00"
    assert content["candles"] == 300 and content["decisions"] == 25 and content["trades"] == 7
    final = record.equity[-1].equity
    assert content["total_return"] == pytest.approx(float(final / 10_000 - 1))
    assert content["fees"] == pytest.approx(float(sum(t.fee for t in record.trades)))
    assert 0 < content["max_drawdown"] < 0.5
    assert 0 < content["exposure"] < 1
    assert content["win_rate"] is not None and 0 <= content["win_rate"] <= 1
    assert text.startswith('{\n  "desk": "btc-swing",')  # indented, for people too


def test_trades_csv_reads_back_exactly(record: BacktestRecord, written: Path) -> None:
    raw = (written / "trades.csv").read_bytes().decode()
    assert raw.splitlines()[0] == ",".join(TRADE_COLUMNS)
    with (written / "trades.csv").open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(record.trades)
    for row, trade in zip(rows, record.trades, strict=True):
        assert row["decided_at"] == trade.decided_at.isoformat()
        assert row["filled_at"] == trade.filled_at.isoformat()
        assert (row["symbol"], row["side"]) == (trade.symbol, trade.side)
        assert Decimal(row["amount"]) == trade.amount and row["amount"] == str(trade.amount)
        assert Decimal(row["price"]) == trade.price
        assert row["fee"] == str(trade.fee)
        assert row["client_order_id"] == trade.client_order_id
        assert row["reason"] == trade.reason
    assert rows[0]["reason"] == TRICKY_REASON  # comma, quotes and a newline survive
    assert rows[0]["decided_at"] == "2023-01-06T00:00:00+00:00"
    assert rows[0]["filled_at"] == "2023-01-06T00:00:00+00:00"


def test_tiny_amounts_are_written_in_full(tmp_path: Path) -> None:
    record = make_record(hours=48)
    first = record.trades[0]
    record.trades[0] = TradeRecord(first.decided_at, first.filled_at, first.symbol,
                                   first.side, Decimal("1E-8"), first.price, Decimal("0E-10"),
                                   first.client_order_id, first.reason)
    write_report(record, tmp_path)
    with (tmp_path / "trades.csv").open(newline="") as handle:
        row = next(csv.DictReader(handle))
    assert row["amount"] == "0.00000001"
    assert row["fee"] == "0.0000000000"


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
    # Each trade links to the decision that placed it.
    links = re.findall(r'<a href="#decision-(\d+)">', page)
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
    assert names == ["equity.png", "report.html", "report.json", "trades.csv"]
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
        "equity.png", "report.html", "report.json", "trades-scalper-v2.csv",
        "trades-swing-prompt.csv"]
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
    with (tmp_path / "trades-scalper-v2.csv").open(newline="") as handle:
        assert len(list(csv.DictReader(handle))) == len(eager.trades)

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
    assert by_name["Final equity"][:2] == [f"{figures.final_equity:,.2f}", "USDT"]
    assert by_name["Decisions"] == ["25", "2"]
    assert by_name["Sharpe"][0] == f"{figures.sharpe:.2f}"
    assert by_name["Max drawdown"][0] == f"{figures.max_drawdown * 100:.2f}%"
    print(table)


def test_half_an_emoji_from_a_broken_stream_does_not_break_the_report(tmp_path: Path) -> None:
    record = make_record(hours=48)
    first = record.trades[0]
    record.trades[0] = TradeRecord(first.decided_at, first.filled_at, first.symbol,
                                   first.side, first.amount, first.price, first.fee,
                                   first.client_order_id, "rocket \ud83d then cut")
    decision = record.decisions[0]
    record.decisions[0] = Decision(decision.index, decision.at, decision.trigger,
                                   "half \ud83d", (TranscriptEntry("text", "half \ud83d"),))
    write_report(record, tmp_path)
    with (tmp_path / "trades.csv").open(newline="", encoding="utf-8") as handle:
        assert next(csv.DictReader(handle))["reason"] == "rocket \ufffd then cut"
    assert "half \ufffd" in (tmp_path / "report.html").read_text(encoding="utf-8")
