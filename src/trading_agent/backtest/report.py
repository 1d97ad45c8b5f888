"""The report of a backtest: ``report.json``, ``trades.csv``, ``fills.csv``, ``equity.png``,
``report.html``.

``trades.csv`` has one row per round trip of the desk's books (a position opened and
brought back to zero: its entry, exit, profit and fees), ``fills.csv`` one row per fill with
the decision that led to it; the figures' trade count, win rate and profit come from the
same round trips.

Everything is a pure function of the :class:`~.record.BacktestRecord` (through
:func:`~.metrics.compute_figures`): no clock, no randomness, no absolute path, so the same
record always gives byte-identical files and a re-run from the response cache reproduces
the report exactly.

The chart is drawn with pillow in the project's chart look
(:data:`~trading_agent.tools.charts.DARK`): the desk's equity against buy-and-hold on top,
the drawdown as a filled area below zero under it, times in UTC. Long runs are reduced to
the pixel width first (each pixel column keeps its first, lowest, highest and last value),
so 100,000 candles draw in a fraction of a second without losing a spike.

``report.html`` opens offline: inline CSS, the chart as a ``data:`` URI, no script, no
external URL; every piece of text is escaped (transcripts hold model output). Each decision
is a ``<details id="decision-N">`` whose transcript is one click away; each trade links to
the decisions that opened and closed it, each fill to the decision that placed it.

The writers block (pillow, file I/O): call them through ``anyio.to_thread`` from async code.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from functools import cache
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from trading_agent.backtest.audit import Audit
from trading_agent.backtest.files import private_folder, write_private
from trading_agent.backtest.metrics import (
    Figures,
    buy_and_hold_curve,
    compute_figures,
    drawdown_curve,
    iso_time,
)
from trading_agent.backtest.record import BacktestRecord, Decision, FillRecord
from trading_agent.tools.charts import DARK, ChartTheme
from trading_agent.trading.books import RoundTrip

__all__ = ["CHART_SIZE", "FILL_COLUMNS", "TRADE_COLUMNS", "equity_chart_png",
           "spreadsheet_safe", "summary_table",
           "write_comparison", "write_report"]

TRADE_COLUMNS = ("opened_at", "closed_at", "symbol", "side", "amount", "entry_price",
                 "exit_price", "profit", "profit_percent", "fees", "exit_reason",
                 "opened_turn", "closed_turn")
"""The header of ``trades.csv`` (one row per round trip), in order."""

FILL_COLUMNS = ("decided_at", "filled_at", "symbol", "side", "amount", "price", "fee",
                "client_order_id", "reason")
"""The header of ``fills.csv`` (one row per fill), in order."""

OPEN_REASON = "open"
"""The ``exit_reason`` of a round trip still open at the end of the run."""

_PERCENT_PLACES = Decimal("0.0001")

CHART_SIZE = (1200, 640)
"""Width and height of ``equity.png`` in pixels."""

_SCALE = 2  # drawn at twice the size, then scaled down with a good filter (as the charts)
_ENTRY_LIMIT = 20_000  # characters of one transcript entry shown; keeps huge results light
_REASON_PREVIEW = 160  # characters of a trade's reason in the trades table
_ANSWER_PREVIEW = 140  # characters of the final answer in a decision's summary

_RGB = tuple[int, int, int]
_BENCHMARK_COLOUR: _RGB = DARK.fast_average
_RUN_COLOURS: tuple[_RGB, ...] = (DARK.slow_average, DARK.up, (240, 98, 146), (179, 136, 255),
                                  (205, 220, 57), (77, 208, 225))


# --- the figures as text ---------------------------------------------------------------

def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.2f}%"


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.2f}%"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _count(value: int) -> str:
    return f"{value:,}"


def _money(value: float, currency: str) -> str:
    return f"{value:,.2f} {currency}"


def _cost(value: float | None) -> str:
    # Model costs are cents or less per call: four places, as the operator CLI shows them.
    return "n/a" if value is None else f"${value:,.4f}"


_ROWS: tuple[tuple[str, str, Callable[[Figures], str]], ...] = (
    ("total_return", "Total return", lambda f: _percent(f.total_return)),
    ("buy_and_hold_return", "Buy and hold", lambda f: _percent(f.buy_and_hold_return)),
    ("max_drawdown", "Max drawdown", lambda f: _share(f.max_drawdown)),
    ("sharpe", "Sharpe", lambda f: _ratio(f.sharpe)),
    ("sortino", "Sortino", lambda f: _ratio(f.sortino)),
    ("trades", "Trades", lambda f: _count(f.trades)),
    ("open_trades", "Open trades", lambda f: _count(f.open_trades)),
    ("fills", "Fills", lambda f: _count(f.fills)),
    ("win_rate", "Win rate", lambda f: _share(f.win_rate)),
    ("realized_profit", "Realized profit", lambda f: _money(f.realized_profit,
                                                            f.quote_currency)),
    ("fees", "Fees", lambda f: _money(f.fees, f.quote_currency)),
    ("exposure", "Exposure", lambda f: _share(f.exposure)),
    ("starting_equity", "Starting equity", lambda f: _money(f.starting_equity,
                                                            f.quote_currency)),
    ("final_equity", "Final equity", lambda f: _money(f.final_equity, f.quote_currency)),
    ("candles", "Candles", lambda f: _count(f.candles)),
    ("decisions", "Decisions", lambda f: _count(f.decisions)),
    ("model_calls", "Model calls", lambda f: _count(f.model_calls)),
    ("cache_hits", "Cache hits", lambda f: _count(f.cache_hits)),
    ("input_tokens", "Input tokens", lambda f: _count(f.input_tokens)),
    ("output_tokens", "Output tokens", lambda f: _count(f.output_tokens)),
    ("cost", "Model cost", lambda f: _cost(f.cost)),
)


def summary_table(figures: Sequence[tuple[str, Figures]]) -> str:
    """A plain-text table of the figures for the terminal: one row per figure, one column
    per run.

    Args:
        figures: ``(label, figures)`` of each run, in the order of the columns.

    Returns:
        The table, lines joined by newlines (no trailing newline): returns as ``+5.23%``,
        money with two decimals and its currency, ``n/a`` where a figure is undefined.

    Raises:
        ValueError: No run.
    """
    if not figures:
        raise ValueError("a summary table needs at least one run")
    header = ["", *(label for label, _ in figures)]
    rows = [[title, *(render(f) for _, f in figures)] for _, title, render in _ROWS]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join((first, *rest)).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join((line(header), rule, *(line(row) for row in rows)))


# --- writing --------------------------------------------------------------------------

def write_report(record: BacktestRecord, out_dir: Path) -> Figures:
    """Writes the report of one run (blocking; from async code use ``anyio.to_thread``).

    Everything is computed before the first file is written, so a record that cannot be
    reported leaves ``out_dir`` as it was.

    Args:
        record: What the run produced.
        out_dir: An existing, empty directory; receives ``report.json``, ``trades.csv``,
            ``fills.csv``, ``equity.png`` and ``report.html``.

    Returns:
        The figures written to ``report.json``.

    Raises:
        ValueError: The record has no equity point or no candles (see
            :func:`~.metrics.compute_figures`).
    """
    figures = compute_figures(record)
    png = equity_chart_png([record])
    links = _Links(record, "decision-")
    body = [
        _header(f"Backtest of {record.desk}", _e(_span_line(record))),
        _notices_section(record.notices),
        _figures_section([(record.desk, figures)]),
        _chart_section(png),
        _trades_section(record.trades, links, "Trades"),
        _fills_section(record.fills, links, "Fills"),
    ]
    transcripts: dict[str, str | bytes] = {}
    body.append(_decisions_section(record.decisions, "decision-", "Decisions", transcripts))
    page = _page(f"Backtest of {record.desk} · {record.model}", body)
    files: dict[str, str | bytes] = {
        **transcripts,
        "report.json": _json_text(figures.to_json()),
        "trades.csv": _trades_csv(record.trades),
        "fills.csv": _fills_csv(record.fills),
        "equity.png": png,
        "report.html": page,
    }
    _write_all(out_dir, files)
    return figures


def write_comparison(records: Sequence[BacktestRecord], labels: Sequence[str],
                     out_dir: Path, *, audit: Audit | None = None) -> list[Figures]:
    """Writes one report comparing several runs over the same span, side by side.

    Args:
        records: The runs (several desks, or one desk under several configs).
        labels: A distinct name for each run, in the same order.
        out_dir: An existing, empty directory; receives ``report.json`` (``from``, ``to``
            and ``runs``, each the run's figures with its ``label``), one
            ``trades-<slug>.csv`` and one ``fills-<slug>.csv`` per run (the label in lower
            case, runs of other characters as ``-``: ``Scalper v2`` →
            ``trades-scalper-v2.csv``), ``equity.png`` (every run's equity and the
            buy-and-hold of the first run) and ``report.html`` (the figures in one column
            per run, then each run's trades, fills and decisions, anchored
            ``#decision-<slug>-N``).
        audit: The memorisation audit of a plain and a masked run (:mod:`.audit`): in
            ``report.json`` as ``audit``, and above the figures.

    Returns:
        The figures of each run, in order.

    Raises:
        ValueError: No run, labels that do not match the runs or repeat, runs over
            different spans, or a run that cannot be reported.
    """
    if not records:
        raise ValueError("a comparison needs at least one run")
    if len(labels) != len(records):
        raise ValueError(f"a comparison got {len(records)} runs but {len(labels)} labels; "
                         "give one label per run")
    if len(set(labels)) != len(labels):
        raise ValueError(f"the labels of a comparison must differ; got {list(labels)}")
    first = records[0]
    for label, record in zip(labels, records, strict=True):
        if (record.start, record.end) != (first.start, first.end):
            raise ValueError(
                f"run {label!r} spans {iso_time(record.start)} to {iso_time(record.end)} but "
                f"run {labels[0]!r} spans {iso_time(first.start)} to {iso_time(first.end)}; "
                "a comparison needs the same span")
    figures = [compute_figures(record) for record in records]
    slugs = _slugs(labels)
    png = equity_chart_png(records, labels)
    title = "Backtest comparison: " + " vs ".join(labels)
    span = (f"{_when(first.start)} to {_when(first.end)} UTC · {first.timeframe} · "
            + ", ".join(first.candles))
    body = [_header(title, _e(span)), _audit_section(audit),
            _figures_section(list(zip(labels, figures, strict=True))), _chart_section(png)]
    transcripts: dict[str, str | bytes] = {}
    for label, slug, record in zip(labels, slugs, records, strict=True):
        prefix = f"decision-{slug}-"
        body.append(f'<section class="run" id="run-{slug}">\n<h2>{_e(label)}</h2>\n'
                    f'<p class="meta">{_e(_span_line(record))}</p>')
        body.append(_notices_section(record.notices))
        links = _Links(record, prefix)
        body.append(_trades_section(record.trades, links, f"Trades of {label}"))
        body.append(_fills_section(record.fills, links, f"Fills of {label}"))
        body.append(_decisions_section(record.decisions, prefix, f"Decisions of {label}",
                                       transcripts, page_name=slug))
        body.append("</section>")
    report: dict[str, object] = {
        "from": iso_time(first.start), "to": iso_time(first.end),
        "runs": [{"label": label, **f.to_json()}
                 for label, f in zip(labels, figures, strict=True)]}
    if audit is not None:
        report["audit"] = audit.to_json()
    files: dict[str, str | bytes] = {**transcripts, "report.json": _json_text(report)}
    for slug, record in zip(slugs, records, strict=True):
        files[f"trades-{slug}.csv"] = _trades_csv(record.trades)
        files[f"fills-{slug}.csv"] = _fills_csv(record.fills)
    files["equity.png"] = png
    files["report.html"] = _page(title, body)
    _write_all(out_dir, files)
    return figures


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


TRANSCRIPTS = "transcripts"
"""The folder of a long run's transcript pages, beside ``report.html``."""


def _write_all(out_dir: Path, files: dict[str, str | bytes]) -> None:
    for name, content in files.items():
        if "/" in name:
            private_folder(out_dir / name.rpartition("/")[0])
        # Half an emoji from a broken model stream cannot be UTF-8: shown as U+FFFD, as the
        # operator views show it, rather than failing the whole report.
        data = (_LONE_SURROGATE.sub("\ufffd", content).encode()
                if isinstance(content, str) else content)
        write_private(out_dir / name, data)


def _json_text(content: object) -> str:
    return json.dumps(content, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def _decimal(value: Decimal) -> str:
    """Exact, and never in exponent form (``0.00000001``, not ``1E-8``)."""
    return format(value, "f")


def _optional(value: Decimal | None) -> str:
    return "" if value is None else _decimal(value)


def _profit_percent(trade: RoundTrip) -> Decimal:
    """Four decimal places: a division's 28 digits say nothing more."""
    return trade.profit_percent.quantize(_PERCENT_PLACES)


_FORMULA_START = frozenset("=+-@\t\r")
"""What a spreadsheet may read as the start of a formula (OWASP's CSV injection list)."""
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def spreadsheet_safe(cell: str) -> str:
    """A CSV cell a spreadsheet shows as text, never runs: one starting with ``=``, ``+``,
    ``-``, ``@``, a tab or a carriage return gets a leading ``'``, unless it is a number
    (``-12.5`` stays a number)."""
    if cell and cell[0] in _FORMULA_START and not _NUMBER.match(cell):
        return "'" + cell
    return cell


class _SafeWriter:
    """``csv.writer`` whose every cell is :func:`spreadsheet_safe`."""

    def __init__(self, buffer: io.StringIO) -> None:
        self._writer = csv.writer(buffer)  # RFC 4180: CRLF rows, quotes doubled, newlines kept

    def writerow(self, row: Sequence[str]) -> None:
        self._writer.writerow([spreadsheet_safe(cell) for cell in row])


def _trades_csv(trades: Sequence[RoundTrip]) -> str:
    buffer = io.StringIO()
    writer = _SafeWriter(buffer)
    writer.writerow(TRADE_COLUMNS)
    for trade in trades:
        writer.writerow([
            iso_time(trade.opened_at),
            "" if trade.closed_at is None else iso_time(trade.closed_at), trade.symbol,
            trade.side, _decimal(trade.amount), _decimal(trade.entry_price),
            _optional(trade.exit_price if trade.closed_at is not None else None),
            _decimal(trade.profit), _decimal(_profit_percent(trade)), _decimal(trade.fees),
            OPEN_REASON if trade.closed_at is None else trade.exit_reason or "",
            trade.opened_turn or "", trade.closed_turn or ""])
    return buffer.getvalue()


def _fills_csv(fills: Sequence[FillRecord]) -> str:
    buffer = io.StringIO()
    writer = _SafeWriter(buffer)
    writer.writerow(FILL_COLUMNS)
    for fill in fills:
        writer.writerow([iso_time(fill.decided_at), iso_time(fill.filled_at), fill.symbol,
                         fill.side, _decimal(fill.amount), _decimal(fill.price),
                         _decimal(fill.fee), fill.client_order_id, fill.reason])
    return buffer.getvalue()


def _slugs(labels: Sequence[str]) -> list[str]:
    """File- and anchor-safe names for the labels, distinct even when labels fold together."""
    result: list[str] = []
    for index, label in enumerate(labels, start=1):
        slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") or f"run-{index}"
        candidate, number = slug, 2
        while candidate in result:
            candidate, number = f"{slug}-{number}", number + 1
        result.append(candidate)
    return result


# --- the page -------------------------------------------------------------------------

_CSS = """
:root { color-scheme: light; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       margin: 0 auto; max-width: 1240px; padding: 24px; color: #1d2230; background: #f6f7fa; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 10px; }
.notices { background: #fff4e5; border-left: 4px solid #e8a33d; padding: 2px 16px; }
.meta { color: #5b6275; margin: 0 0 16px; }
table { border-collapse: collapse; background: #fff; }
th, td { padding: 5px 10px; border-bottom: 1px solid #e3e6ee; text-align: left;
         vertical-align: top; }
table.figures td { text-align: right; font-variant-numeric: tabular-nums; }
table.figures thead th { text-align: right; }
table.trades td.number, table.fills td.number { text-align: right;
                                                font-variant-numeric: tabular-nums; }
td.buy, td.long, td.win { color: #1b8a7e; } td.sell, td.short, td.loss { color: #c73e3a; }
img.chart { display: block; max-width: 100%; height: auto; border-radius: 6px; }
details.decision { background: #fff; border: 1px solid #e3e6ee; border-radius: 6px;
                   margin: 6px 0; padding: 6px 10px; }
details.decision:target { outline: 2px solid #6495ed; }
ol.decision-list li:target { outline: 2px solid #6495ed; }
details.decision > summary { cursor: pointer; }
summary time, summary .number { font-variant-numeric: tabular-nums; color: #5b6275; }
summary .number { display: inline-block; min-width: 3.2em; }
td.time { white-space: nowrap; font-variant-numeric: tabular-nums; }
summary .trigger { font-weight: 600; margin: 0 8px; }
ol.transcript { list-style: none; padding: 0; margin: 10px 0 4px; }
ol.transcript li { border-left: 3px solid #c9cedb; margin: 6px 0; padding: 2px 10px; }
ol.transcript li.text { border-color: #6495ed; }
ol.transcript li.tool_call { border-color: #ffb74d; }
ol.transcript li.error { border-color: #ef5350; background: #fdf0f0; }
.kind { font-size: 12px; text-transform: uppercase; letter-spacing: .04em; color: #5b6275; }
li.error .kind { color: #c73e3a; font-weight: 600; }
pre { white-space: pre-wrap; word-break: break-word; margin: 2px 0; font: 13px/1.4
      ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; }
.empty { color: #5b6275; }
"""


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _when(moment: datetime) -> str:
    return _utc(moment).strftime("%Y-%m-%d %H:%M")


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _preview(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 1].rstrip() + "…"


def _span_line(record: BacktestRecord) -> str:
    masked = " · masked" if record.masked else ""
    return (f"model {record.model} · {_when(record.start)} to {_when(record.end)} UTC · "
            f"{record.timeframe} · {', '.join(record.candles)}{masked}")


def _page(title: str, body: Sequence[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{_e(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")


def _header(title: str, subtitle: str) -> str:
    """A page's title and its line below (``subtitle`` is HTML: escape text first)."""
    return f"<header>\n<h1>{_e(title)}</h1>\n<p class=\"meta\">{subtitle}</p>\n</header>"


def _audit_section(audit: Audit | None) -> str:
    if audit is None:
        return ""
    agreement = "n/a" if audit.agreement is None else f"{audit.agreement:.0%}"
    rows = [("Return, plain", _percent(audit.plain_return)),
            ("Return, masked", _percent(audit.masked_return)),
            ("Difference (plain − masked)", f"{audit.return_difference * 100:+.2f} points"),
            ("Trades, plain / masked", f"{audit.plain_trades} / {audit.masked_trades}"),
            ("Decisions agreeing", f"{agreement} of {audit.decisions}")]
    cells = "".join(f"<tr><th>{_e(name)}</th><td>{_e(value)}</td></tr>" for name, value in rows)
    return (f'<section class="audit">\n<h2>Memorisation audit</h2>\n'
            f'<p>{_e(audit.verdict)}</p>\n<table class="figures">{cells}</table>\n</section>')


def _notices_section(notices: Sequence[str]) -> str:
    if not notices:
        return ""
    items = "".join(f"<li>{_e(notice)}</li>" for notice in notices)
    return f'<section class="notices">\n<h2>Read this first</h2>\n<ul>{items}</ul>\n</section>'


def _figures_section(runs: Sequence[tuple[str, Figures]]) -> str:
    parts = ['<section id="figures">\n<h2>Figures</h2>\n<table class="figures">',
             "<thead><tr><th></th>"
             + "".join(f"<th scope=\"col\">{_e(label)}</th>" for label, _ in runs)
             + "</tr></thead>\n<tbody>"]
    for key, title, render in _ROWS:
        cells = "".join(f"<td>{_e(render(figures))}</td>" for _, figures in runs)
        parts.append(f'<tr data-figure="{key}"><th scope="row">{_e(title)}</th>{cells}</tr>')
    parts.append("</tbody>\n</table>\n</section>")
    return "\n".join(parts)


def _chart_section(png: bytes) -> str:
    width, height = CHART_SIZE
    data = base64.b64encode(png).decode("ascii")
    return ('<section id="chart">\n<h2>Equity and drawdown</h2>\n'
            f'<img class="chart" width="{width}" height="{height}" '
            'alt="Equity against buy-and-hold, with the drawdown below" '
            f'src="data:image/png;base64,{data}">\n</section>')


class _Links:
    """Where each decision of a run is on the page: by the turn that made it (what a round
    trip names), and by the orders it placed (what a fill names)."""

    def __init__(self, record: BacktestRecord, prefix: str) -> None:
        self.turns = {decision.turn: f"{prefix}{decision.index}"
                      for decision in record.decisions if decision.turn is not None}
        self.orders: dict[str, str] = {}
        for decision in record.decisions:
            for order in decision.orders:
                self.orders.setdefault(order, f"{prefix}{decision.index}")
        # An order the engine did not attribute still belongs to the turn decided at its time.
        by_time = {decision.at: f"{prefix}{decision.index}" for decision in reversed(
            record.decisions)}
        for fill in record.fills:
            if fill.client_order_id not in self.orders and fill.decided_at in by_time:
                self.orders[fill.client_order_id] = by_time[fill.decided_at]

    def of_turn(self, turn: str | None) -> str:
        """A link to the decision of ``turn`` (its id as text when it has none)."""
        return "" if turn is None else _link(self.turns.get(turn)) or _e(turn)

    def of_fill(self, fill: FillRecord) -> str:
        """A link to the decision that placed the fill's order."""
        return _link(self.orders.get(fill.client_order_id)
                     or (self.turns.get(fill.turn) if fill.turn is not None else None))


def _link(anchor: str | None) -> str:
    return (f'<a href="#{_e(anchor)}">#{_e(anchor.rsplit("-", 1)[1])}</a>'
            if anchor else "")


def _trades_section(trades: Sequence[RoundTrip], links: _Links, title: str) -> str:
    parts = [f"<section class=\"trades\">\n<h2>{_e(title)}</h2>"]
    if not trades:
        parts.append('<p class="empty">No trade.</p>\n</section>')
        return "\n".join(parts)
    parts.append('<table class="trades">\n<thead><tr><th>Opened by</th><th>Opened (UTC)</th>'
                 "<th>Closed (UTC)</th><th>Symbol</th><th>Side</th><th>Amount</th>"
                 "<th>Entry</th><th>Exit</th><th>Profit</th><th>Profit %</th><th>Fees</th>"
                 "<th>Exit reason</th><th>Closed by</th></tr></thead>\n<tbody>")
    for trade in trades:
        closed = trade.closed_at is not None
        outcome = "win" if trade.profit > 0 else "loss" if trade.profit < 0 else ""
        parts.append(
            f'<tr data-trade="{trade.id}"><td>{links.of_turn(trade.opened_turn)}</td>'
            f'<td class="time">{_when(trade.opened_at)}</td>'
            f'<td class="time">{_when(trade.closed_at) if trade.closed_at else ""}</td>'
            f'<td>{_e(trade.symbol)}</td><td class="{trade.side}">{trade.side}</td>'
            f'<td class="number">{_decimal(trade.amount)}</td>'
            f'<td class="number">{_decimal(trade.entry_price)}</td>'
            f'<td class="number">{_optional(trade.exit_price) if closed else ""}</td>'
            f'<td class="number {outcome}">{_decimal(trade.profit)}</td>'
            f'<td class="number {outcome}">{_profit_percent(trade):+.2f}%</td>'
            f'<td class="number">{_decimal(trade.fees)}</td>'
            f"<td>{_e(trade.exit_reason or '') if closed else OPEN_REASON}</td>"
            f"<td>{links.of_turn(trade.closed_turn)}</td></tr>")
    parts.append("</tbody>\n</table>")
    if any(trade.closed_at is None for trade in trades):
        parts.append('<p class="meta">An open trade\'s profit is what it realized so far less '
                     "its fees; what it holds is valued in the final equity.</p>")
    parts.append("</section>")
    return "\n".join(parts)


def _fills_section(fills: Sequence[FillRecord], links: _Links, title: str) -> str:
    parts = [f"<section class=\"fills\">\n<h2>{_e(title)}</h2>"]
    if not fills:
        parts.append('<p class="empty">No fill.</p>\n</section>')
        return "\n".join(parts)
    parts.append('<table class="fills">\n<thead><tr><th>Decision</th><th>Decided (UTC)</th>'
                 "<th>Filled (UTC)</th><th>Symbol</th><th>Side</th><th>Amount</th>"
                 "<th>Price</th><th>Fee</th><th>Order</th><th>Reason</th></tr></thead>\n"
                 "<tbody>")
    for fill in fills:
        parts.append(
            f'<tr><td>{links.of_fill(fill)}</td><td class="time">{_when(fill.decided_at)}</td>'
            f'<td class="time">{_when(fill.filled_at)}</td><td>{_e(fill.symbol)}</td>'
            f'<td class="{_e(fill.side)}">{_e(fill.side)}</td>'
            f'<td class="number">{_decimal(fill.amount)}</td>'
            f'<td class="number">{_decimal(fill.price)}</td>'
            f'<td class="number">{_decimal(fill.fee)}</td>'
            f"<td><code>{_e(fill.client_order_id)}</code></td>"
            f'<td title="{_e(_preview(fill.reason, 2000))}">'
            f"{_e(_preview(fill.reason, _REASON_PREVIEW))}</td></tr>")
    parts.append("</tbody>\n</table>\n</section>")
    return "\n".join(parts)


_KIND_NAMES = {"trigger": "trigger", "operator": "operator", "text": "model",
               "tool_call": "tool call", "tool_result": "tool result", "notice": "notice"}


INLINE_DECISIONS = 100
"""Up to this many decisions, their transcripts are on the report page itself; past it, the
page lists one line per decision and the transcripts go to ``transcripts/``, this many to a
page, so a year of decisions opens as fast as a day."""


def _decisions_section(decisions: Sequence[Decision], prefix: str, title: str,
                       files: dict[str, str | bytes], page_name: str = "decisions") -> str:
    """The decisions of a run: inline when few, else a list linking to transcript pages
    (added to ``files``)."""
    parts = [f'<section class="decisions">\n<h2>{_e(title)}</h2>']
    if not decisions:
        parts.append('<p class="empty">No decision.</p>')
    if len(decisions) <= INLINE_DECISIONS:
        parts.extend(_decision(decision, prefix) for decision in decisions)
        parts.append("</section>")
        return "\n".join(parts)
    pages = [decisions[at:at + INLINE_DECISIONS]
             for at in range(0, len(decisions), INLINE_DECISIONS)]
    names = [f"{TRANSCRIPTS}/{page_name}-{number}.html" for number in range(1, len(pages) + 1)]
    parts.append(f'<p class="meta">{len(decisions):,} decisions: their transcripts are on '
                 f"{len(pages)} pages in {TRANSCRIPTS}/, each decision's one click away.</p>"
                 '<ol class="decision-list">')
    for page, name in zip(pages, names, strict=True):
        for decision in page:
            anchor = f"{prefix}{decision.index}"
            parts.append(
                f'<li id="{_e(anchor)}"><a href="{_e(name)}#{_e(anchor)}">#{decision.index}</a> '
                f'<time>{_when(decision.at)}</time> <span class="trigger">'
                f"{_e(decision.trigger)}</span> <span class=\"answer\">"
                f"{_e(_preview(decision.final_text, _ANSWER_PREVIEW))}</span></li>")
    parts.append("</ol>\n</section>")
    for number, (page, name) in enumerate(zip(pages, names, strict=True), start=1):
        nav = ['<a href="../report.html">back to the report</a>']
        if number > 1:
            nav.append(f'<a href="{_e(Path(names[number - 2]).name)}">previous page</a>')
        if number < len(pages):
            nav.append(f'<a href="{_e(Path(names[number]).name)}">next page</a>')
        heading = (f"{title}: #{page[0].index} to #{page[-1].index} "
                   f"(page {number} of {len(pages)})")
        body = [_header(heading, " · ".join(nav)),
                '<section class="decisions">',
                *(_decision(decision, prefix, open_=True) for decision in page),
                "</section>", f'<p class="meta">{" · ".join(nav)}</p>']
        files[name] = _page(heading, body)
    return "\n".join(parts)


def _decision(decision: Decision, prefix: str, *, open_: bool = False) -> str:
    moment = _utc(decision.at)
    summary = (f'<summary><span class="number">#{decision.index}</span> '
               f'<time datetime="{moment.isoformat()}">{_when(moment)}</time>'
               f'<span class="trigger">{_e(decision.trigger)}</span>'
               f'<span class="answer">{_e(_preview(decision.final_text, _ANSWER_PREVIEW))}'
               "</span></summary>")
    entries: list[str] = []
    for entry in decision.transcript:
        name = _KIND_NAMES.get(entry.kind, entry.kind)
        classes = f"entry {entry.kind}" + (" error" if entry.is_error else "")
        label = f"{name} · error" if entry.is_error else name
        text = entry.text
        if len(text) > _ENTRY_LIMIT:
            text = (f"{text[:_ENTRY_LIMIT]}\n… ({len(text) - _ENTRY_LIMIT:,} more characters "
                    "not shown)")
        entries.append(f'<li class="{_e(classes)}"><span class="kind">{_e(label)}</span>'
                       f"<pre>{_e(text)}</pre></li>")
    if decision.final_text and not any(e.kind == "text" for e in decision.transcript):
        entries.append('<li class="entry text"><span class="kind">answer</span>'
                       f"<pre>{_e(decision.final_text)}</pre></li>")
    footer = []
    if decision.orders:
        footer.append("orders " + ", ".join(f"<code>{_e(o)}</code>" for o in decision.orders))
    footer.append(f"{decision.model_calls} model call{'' if decision.model_calls == 1 else 's'}")
    shown = " open" if open_ else ""
    return (f'<details class="decision" id="{_e(prefix)}{decision.index}"{shown}>{summary}'
            f'<ol class="transcript">{"".join(entries)}</ol>'
            f'<p class="meta">{" · ".join(footer)}</p></details>')


# --- the chart ------------------------------------------------------------------------

@dataclass(frozen=True)
class _Series:
    label: str
    colour: _RGB
    times: list[float]  # seconds since the epoch, increasing
    values: list[float]


@cache
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _seconds(moment: datetime) -> float:
    return _utc(moment).timestamp()


def _curves(record: BacktestRecord) -> tuple[list[float], list[float], list[float]]:
    """Times, equity and buy-and-hold, starting from the starting equity at the start."""
    times = [_seconds(point.at) for point in record.equity]
    equity = [float(point.equity) for point in record.equity]
    benchmark = buy_and_hold_curve(record)
    start = _seconds(record.start)
    if start < times[0]:
        starting = float(record.starting_equity)
        times, equity, benchmark = [start, *times], [starting, *equity], [starting, *benchmark]
    return times, equity, benchmark


def equity_chart_png(records: Sequence[BacktestRecord],
                     labels: Sequence[str] | None = None) -> bytes:
    """Draws the equity of one or more runs against buy-and-hold, the drawdown below
    (blocking; from async code use ``anyio.to_thread``).

    Args:
        records: The runs, over the same span; the buy-and-hold line is the first's.
        labels: A name for each run in the legend (the desk's name by default).

    Returns:
        A PNG of :data:`CHART_SIZE`; the same records always give the same bytes.

    Raises:
        ValueError: No run, or a run without equity points or candles.
    """
    if not records:
        raise ValueError("an equity chart needs at least one run")
    for record in records:
        if not record.equity:
            raise ValueError(f"the backtest record of desk {record.desk!r} has no equity "
                             "point to chart")
    names = list(labels) if labels is not None else [record.desk for record in records]
    lines: list[_Series] = []
    drawdowns: list[_Series] = []
    benchmark: _Series | None = None
    for index, (name, record) in enumerate(zip(names, records, strict=True)):
        times, equity, hold = _curves(record)
        colour = _RUN_COLOURS[index % len(_RUN_COLOURS)]
        change = equity[-1] / equity[0] - 1
        lines.append(_Series(f"{name} {equity[-1]:,.2f} ({change * 100:+.2f}%)", colour,
                             times, equity))
        drawdowns.append(_Series(name, colour, times, drawdown_curve(equity)))
        if benchmark is None:
            change = hold[-1] / hold[0] - 1
            benchmark = _Series(f"buy & hold {hold[-1]:,.2f} ({change * 100:+.2f}%)",
                                _BENCHMARK_COLOUR, times, hold)
    assert benchmark is not None
    first = records[0]
    title = f"{first.desk} · {first.model}" if len(records) == 1 else " vs ".join(names)
    stamp = f"{_when(first.start)} to {_when(first.end)} UTC · {first.timeframe}"
    return _render(title, stamp, first.quote_currency, [benchmark, *lines], drawdowns)


def _nice_step(span: float, target: int) -> float:
    """A round step (1, 2, 2.5 or 5 × 10ⁿ) giving about ``target`` ticks over ``span``."""
    if span <= 0:
        return 1.0
    raw = span / target
    power = 10.0 ** math.floor(math.log10(raw))
    return next(m * power for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * power >= raw)


def _places(step: float) -> int:
    """Decimals that show every tick of ``step`` distinctly."""
    places = 0
    while places < 8 and abs(step * 10**places - round(step * 10**places)) > 1e-9:
        places += 1
    return places


def _reduce(xs: Sequence[float], ys: Sequence[float]) -> list[tuple[int, float, float, float,
                                                                     float]]:
    """Per pixel column: its x and the first, smallest, largest and last y falling in it."""
    result: list[tuple[int, float, float, float, float]] = []
    column = -1
    first = low = high = last = 0.0
    for x, y in zip(xs, ys, strict=True):
        index = int(x)
        if index != column:
            if column >= 0:
                result.append((column, first, low, high, last))
            column, first, low, high, last = index, y, y, y, y
        else:
            low, high, last = min(low, y), max(high, y), y
    if column >= 0:
        result.append((column, first, low, high, last))
    return result


def _polyline(columns: Sequence[tuple[int, float, float, float, float]]) -> list[
        tuple[float, float]]:
    points: list[tuple[float, float]] = []
    for x, first, low, high, last in columns:
        for y in (first, low, high, last) if first <= last else (first, high, low, last):
            if not points or points[-1] != (x, y):
                points.append((x, y))
    return points


def _time_ticks(start: float, end: float, pixels: float) -> list[tuple[float, str, bool]]:
    """Round times between ``start`` and ``end`` about 110 px apart: (seconds, label, major)."""
    span = max(end - start, 1.0)
    hour, day = 3600, 86400
    for step in (hour, 2 * hour, 3 * hour, 4 * hour, 6 * hour, 12 * hour, day, 2 * day,
                 7 * day):
        if step / span * pixels >= 110:
            # Weeks start on Monday: the epoch was a Thursday, four days after one.
            offset = 4 * day if step == 7 * day else 0
            tick = math.ceil((start - offset) / step) * step + offset
            ticks: list[tuple[float, str, bool]] = []
            while tick <= end:
                moment = datetime.fromtimestamp(tick, UTC)
                midnight = moment.hour == 0 and moment.minute == 0
                if step < day:
                    label = f"{moment:%b %d}" if midnight else f"{moment:%H:%M}"
                else:
                    label = f"{moment:%b %d}" if moment.month != 1 or moment.day != 1 \
                        else f"{moment:%Y}"
                ticks.append((float(tick), label, midnight and step < day))
                tick += step
            return ticks
    months = next((n for n in (1, 2, 3, 6, 12, 24, 60, 120)
                   if n * 30.44 * day / span * pixels >= 110), 240)
    moment = datetime.fromtimestamp(start, UTC)
    year, month = moment.year, moment.month
    ticks = []
    while True:
        when = datetime(year, month, 1, tzinfo=UTC)
        if when.timestamp() > end:
            return ticks
        index = year * 12 + month - 1
        if when.timestamp() >= start and index % months == 0:
            label = f"{when:%Y}" if months >= 12 else f"{when:%b %Y}"
            ticks.append((when.timestamp(), label, month == 1))
        year, month = (year + 1, 1) if month == 12 else (year, month + 1)


def _render(title: str, stamp: str, quote: str, lines: Sequence[_Series],
            drawdowns: Sequence[_Series], theme: ChartTheme = DARK) -> bytes:
    s = _SCALE
    width, height = CHART_SIZE
    image = Image.new("RGB", (width * s, height * s), theme.background)
    draw = ImageDraw.Draw(image)
    small, medium, large = _font(11 * s), _font(13 * s), _font(18 * s)

    # Layout: title and legend, equity pane, drawdown pane, time axis; values on the right.
    left, right = 14 * s, (width - 84) * s
    top, axis = 66 * s, 26 * s
    bottom = height * s - axis
    gap = 14 * s
    equity_bottom = top + int((bottom - top - gap) * 0.7)
    drawdown_top = equity_bottom + gap

    start = min(series.times[0] for series in lines)
    end = max(series.times[-1] for series in lines)
    if end <= start:
        end = start + 1.0

    def x_of(moment: float) -> float:
        return left + (moment - start) / (end - start) * (right - left - 1)

    low = min(min(series.values) for series in lines)
    high = max(max(series.values) for series in lines)
    padding = (high - low) * 0.06 or abs(high) * 0.01 or 1.0
    low, high = low - padding, high + padding

    def y_equity(value: float) -> float:
        return top + (high - value) / (high - low) * (equity_bottom - top)

    deepest = min(min(series.values) for series in drawdowns)
    floor = deepest * 1.1 if deepest < 0 else -0.01

    def y_drawdown(value: float) -> float:
        return drawdown_top + value / floor * (bottom - drawdown_top)

    # Value grids and labels.
    step = _nice_step(high - low, 6)
    places = _places(step)
    tick = math.ceil(low / step) * step
    while tick <= high:
        y = y_equity(tick)
        draw.line([(left, y), (right, y)], fill=theme.grid, width=s)
        draw.text((right + 8 * s, y), f"{tick:,.{places}f}", font=small, fill=theme.axis_text,
                  anchor="lm")
        tick += step
    step = _nice_step(-floor, 3)
    places = max(0, _places(step * 100))
    tick = 0.0
    while tick >= floor:
        y = y_drawdown(tick)
        draw.line([(left, y), (right, y)], fill=theme.grid, width=s)
        draw.text((right + 8 * s, y), f"{tick * 100:.{places}f}%", font=small,
                  fill=theme.axis_text, anchor="lm")
        tick -= step

    # Time grid and labels, in UTC.
    for moment, label, major in _time_ticks(start, end, (right - left) / s):
        x = x_of(moment)
        draw.line([(x, top), (x, bottom)], fill=theme.grid, width=s)
        half = draw.textlength(label, font=small) / 2
        if x - half >= 0 and x + half <= right:  # a label cut by an edge is left out
            draw.text((x, bottom + 13 * s), label, font=small,
                      fill=theme.title if major else theme.axis_text, anchor="mm")
    draw.text((right + 8 * s, bottom + 13 * s), "UTC", font=small, fill=theme.axis_text,
              anchor="lm")

    # Drawdown: areas filled down from zero, then their edges.
    # Several runs' areas are translucent, so one never hides another.
    zero = y_drawdown(0.0)
    opacity = 90 if len(drawdowns) == 1 else 60
    reduced = [_reduce([x_of(t) for t in series.times], [y_drawdown(v) for v in series.values])
               for series in drawdowns]
    for series, columns in zip(drawdowns, reduced, strict=True):
        colour = theme.down if len(drawdowns) == 1 else series.colour
        # Each column filled down to its deepest point, so no spike is lost.
        outline = [(float(x), deepest_y) for x, _, _, deepest_y, _ in columns]
        if len(outline) > 1:
            mask = Image.new("L", image.size, 0)
            ImageDraw.Draw(mask).polygon(
                [(outline[0][0], zero), *outline, (outline[-1][0], zero)], fill=opacity)
            image.paste(colour, (0, 0, *image.size), mask)
    for series, columns in zip(drawdowns, reduced, strict=True):
        colour = theme.down if len(drawdowns) == 1 else series.colour
        _draw_line(draw, _polyline(columns), colour, s)

    # Equity: buy-and-hold first, the runs over it.
    for series in lines:
        columns = _reduce([x_of(t) for t in series.times],
                          [y_equity(v) for v in series.values])
        _draw_line(draw, _polyline(columns), series.colour, 2 * s)

    # Frames and pane captions.
    draw.line([(right, top), (right, bottom)], fill=theme.axis_text, width=s)
    draw.line([(left, bottom), (right, bottom)], fill=theme.axis_text, width=s)
    draw.line([(left, equity_bottom + gap // 2), (right, equity_bottom + gap // 2)],
              fill=theme.grid, width=2 * s)
    for y, caption in ((top + 2 * s, f"Equity ({quote})"), (drawdown_top + 2 * s, "Drawdown")):
        box = draw.textbbox((left + 4 * s, y), caption, font=small, anchor="la")
        draw.rectangle([box[0] - 3 * s, box[1] - 2 * s, box[2] + 3 * s, box[3] + 2 * s],
                       fill=theme.background)  # legible over the lines
        draw.text((left + 4 * s, y), caption, font=small, fill=theme.axis_text, anchor="la")

    # Title, span and legend.
    draw.text((left, 12 * s), title, font=large, fill=theme.title, anchor="la")
    draw.text((right, 12 * s), stamp, font=medium, fill=theme.axis_text, anchor="ra")
    x = float(left)
    for series in [*lines[1:], lines[0]]:  # the runs first, buy-and-hold last
        draw.line([(x, 47 * s), (x + 16 * s, 47 * s)], fill=series.colour, width=3 * s)
        x += 22 * s
        draw.text((x, 40 * s), series.label, font=medium, fill=series.colour, anchor="la")
        x += draw.textlength(series.label, font=medium) + 22 * s

    output = io.BytesIO()
    image.resize((width, height), Image.Resampling.LANCZOS).save(output, format="PNG")
    return output.getvalue()


def _draw_line(draw: ImageDraw.ImageDraw, points: Sequence[tuple[float, float]],
               colour: _RGB, width: int) -> None:
    if len(points) > 1:
        draw.line(list(points), fill=colour, width=width, joint="curve")
    elif points:
        x, y = points[0]
        draw.ellipse([x - width, y - width, x + width, y + width], fill=colour)

