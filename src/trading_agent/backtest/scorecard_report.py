"""The report of a many-window run: the scorecard on the terminal, in ``report.json``,
``windows.csv`` and ``report.html``.

Pure functions of the :class:`~.scorecard.Scorecard` s: the same scorecards always give the
same files. ``report.html`` opens offline (inline CSS, no script); ``windows.csv`` has one
row per window of each run, its cells safe in a spreadsheet.
"""

from __future__ import annotations

import csv
import html
import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from trading_agent.backtest.files import write_private
from trading_agent.backtest.report import spreadsheet_safe
from trading_agent.backtest.scorecard import Scorecard, Spread
from trading_agent.backtest.windows import Window

__all__ = ["WINDOW_COLUMNS", "scorecard_text", "write_scorecard"]

WINDOW_COLUMNS = ("run", "window", "total_return", "sharpe", "max_drawdown", "trades",
                  "decisions", "buy_and_hold_return", "ma_crossover_return",
                  "random_median_return", "tokens", "cost", "model_seconds")
"""The header of ``windows.csv``."""


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.2f}%"


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.2f}%"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _spread_text(spread: Spread | None, show: Callable[[float | None], str] = _percent) -> str:
    if spread is None:
        return "n/a"
    low, high = spread.interval
    return (f"median {show(spread.median)} (middle half {show(spread.p25)} to "
            f"{show(spread.p75)}; mean {show(spread.mean)}, 95% interval {show(low)} to "
            f"{show(high)})")


def _cost_lines(card: Scorecard) -> list[str]:
    tokens = ("n/a" if card.tokens_per_decision is None
              else f"{card.tokens_per_decision:,.0f} tokens")
    money = ("no prices configured" if card.cost_per_decision is None
             else f"${card.cost_per_decision:.4f}")
    seconds = ("n/a" if card.model_seconds_per_decision is None
               else f"{card.model_seconds_per_decision:.2f} s of the model")
    return [f"Per decision: {tokens}, {money}, {seconds}."]


def scorecard_text(cards: Sequence[Scorecard], windows: Sequence[Window]) -> str:
    """The scorecard as the terminal prints it."""
    lines: list[str] = []
    for card in cards:
        lines.append(f"{card.label}: {len(card.windows)} windows of "
                     f"{_days(windows)} from {windows[0].label} to {windows[-1].label} UTC")
        lines.append(f"  Return        {_spread_text(card.total_return)}")
        lines.append(f"  Sharpe        {_spread_text(card.sharpe, _ratio)}")
        lines.append(f"  Max drawdown  {_spread_text(card.max_drawdown, _share)}")
        lines.extend(f"  {line}" for line in _cost_lines(card))
        if card.deflated_sharpe is not None:
            lines.append(f"  Deflated Sharpe ratio (best of {len(cards)} configs): "
                         f"{card.deflated_sharpe:.2f}")
        lines.append("  Did it beat the baselines beyond chance?")
        lines.extend(f"  - {comparison.line}" for comparison in card.comparisons)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _days(windows: Sequence[Window]) -> str:
    days = (windows[0].end - windows[0].start).total_seconds() / 86400
    return f"{days:g} day{'s' if days != 1 else ''}"


def _windows_csv(cards: Sequence[Scorecard]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(WINDOW_COLUMNS)
    for card in cards:
        for window in card.windows:
            data = window.to_json()
            cells = [card.label, window.label, window.total_return, window.sharpe,
                     window.max_drawdown, window.trades, window.decisions,
                     *window.baselines.values(), data["random_median"], window.tokens,
                     window.cost, window.model_seconds]
            writer.writerow([spreadsheet_safe("" if cell is None else str(cell))
                             for cell in cells])
    return buffer.getvalue()


_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1240px;
       padding: 24px; color: #1d2230; background: #f6f7fa; }
table { border-collapse: collapse; background: #fff; margin: 8px 0 16px; }
th, td { padding: 5px 10px; border-bottom: 1px solid #e3e6ee; text-align: left; }
td.number { text-align: right; font-variant-numeric: tabular-nums; }
li.beat { color: #1a7f37; } li.lost { color: #c62828; }
.meta { color: #5b6275; }
"""


def _page(cards: Sequence[Scorecard], windows: Sequence[Window],
          notices: Sequence[str] = ()) -> str:
    e = html.escape
    body = [f"<h1>Scorecard over {len(windows)} windows of {e(_days(windows))}</h1>",
            f'<p class="meta">{e(windows[0].label)} to {e(windows[-1].label)} UTC; each '
            "baseline runs the same windows through the same paper exchange, fees and "
            "slippage.</p>"]
    if notices:
        body.append("<h2>Read this first</h2><ul>"
                    + "".join(f"<li>{e(notice)}</li>" for notice in notices) + "</ul>")
    for card in cards:
        body.append(f"<h2>{e(card.label)}</h2><ul>")
        body.extend(f'<li class="{e(c.verdict)}">{e(c.line)}</li>' for c in card.comparisons)
        body.append("</ul><table><tbody>")
        for name, spread, show in (("Return", card.total_return, _percent),
                                   ("Sharpe", card.sharpe, _ratio),
                                   ("Max drawdown", card.max_drawdown, _share)):
            body.append(f"<tr><th>{name}</th><td>{e(_spread_text(spread, show))}</td></tr>")
        body.append(f"<tr><th>Cost</th><td>{e(_cost_lines(card)[0])}</td></tr>")
        if card.deflated_sharpe is not None:
            body.append(f"<tr><th>Deflated Sharpe</th><td>{card.deflated_sharpe:.2f}</td></tr>")
        body.append("</tbody></table>")
        body.append("<table><thead><tr><th>Window (UTC)</th><th>Return</th><th>Sharpe</th>"
                    "<th>Drawdown</th><th>Trades</th><th>Buy and hold</th>"
                    "<th>MA crossover</th><th>Random (median)</th></tr></thead><tbody>")
        for window in card.windows:
            data = window.to_json()
            cells = [_percent(window.total_return),
                     "n/a" if window.sharpe is None else f"{window.sharpe:.2f}",
                     _share(window.max_drawdown), str(window.trades),
                     *(_percent(v) for v in window.baselines.values()),
                     _percent(data["random_median"])]
            body.append(f"<tr><td>{e(window.label)}</td>"
                        + "".join(f'<td class="number">{e(c)}</td>' for c in cells)
                        + "</tr>")
        body.append("</tbody></table>")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>Backtest scorecard</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")


def write_scorecard(cards: Sequence[Scorecard], windows: Sequence[Window],
                    out_dir: Path, *, notices: Sequence[str] = ()) -> None:
    """Writes ``report.json``, ``windows.csv`` and ``report.html`` (blocking).

    Args:
        cards: Each run's scorecard.
        windows: The windows.
        out_dir: An existing, empty folder.
        notices: What a reader must know first (a span the model may have seen).
    """
    report = {"from": windows[0].start.isoformat(), "to": windows[-1].end.isoformat(),
              "notices": list(notices),
              "windows": [{"start": w.start.isoformat(), "end": w.end.isoformat()}
                          for w in windows],
              "runs": [card.to_json() for card in cards],
              "verdicts": [f"{card.label} {c.line}" for card in cards
                           for c in card.comparisons]}
    files = {"report.json": json.dumps(report, indent=2, allow_nan=False) + "\n",
             "windows.csv": _windows_csv(cards),
             "report.html": _page(cards, windows, notices)}
    for name, text in files.items():
        write_private(out_dir / name, text.encode())
