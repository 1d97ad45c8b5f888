"""The report and the cache as files: cells a spreadsheet never runs, folders and files no
other user can read."""

from __future__ import annotations

import csv
import os
import stat
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.backtest.test_backtest_cli import backtest, write_config
from tests.backtest.test_metrics import HOUR, START, _fill, _record, _trip
from tests.backtest.trader import trading_responder
from tests.scripted_server import ScriptedServer
from trading_agent.backtest.record import Decision, TranscriptEntry
from trading_agent.backtest.report import spreadsheet_safe, write_report


@pytest.mark.parametrize(("cell", "shown"), [
    ("=HYPERLINK(\"http://x\")", "'=HYPERLINK(\"http://x\")"),
    ("+cmd|' /C calc'!A0", "'+cmd|' /C calc'!A0"),
    ("-2+3", "'-2+3"),
    ("@SUM(A1)", "'@SUM(A1)"),
    ("\tindent", "'\tindent"),
    ("\rreturn", "'\rreturn"),
    ("-12.5", "-12.5"),
    ("+0.25", "+0.25"),
    ("-1E-8", "-1E-8"),
    ("Bought 0.01 = good", "Bought 0.01 = good"),
    ("", ""),
])
def test_a_cell_that_could_be_a_formula_is_quoted_but_a_number_stays(cell: str,
                                                                     shown: str) -> None:
    assert spreadsheet_safe(cell) == shown


def test_the_desks_words_in_fills_csv_cannot_run_in_a_spreadsheet(tmp_path: Path) -> None:
    record = _record(["100", "99"], trades=[_trip(1, "100", "99", "-1.2", "0.2")],
                     fills=[replace(_fill(1, "buy"), reason="=WEBSERVICE(\"http://evil\")")])
    write_report(record, tmp_path)
    with (tmp_path / "fills.csv").open(newline="") as file:
        fill = next(csv.DictReader(file))
    assert fill["reason"] == "'=WEBSERVICE(\"http://evil\")"
    with (tmp_path / "trades.csv").open(newline="") as file:
        trade = next(csv.DictReader(file))
    assert trade["profit"] == "-1.2"  # a loss stays a number


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with ScriptedServer(responder=trading_responder) as scripted:
        yield scripted


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_report_and_the_cache_are_the_operators_alone(tmp_path: Path,
                                                          server: ScriptedServer) -> None:
    config = write_config(tmp_path / "desk.toml", server)
    old = os.umask(0o022)
    try:
        assert backtest(config, tmp_path / "out", tmp_path / "deep" / "cache") == 0
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert _mode(out) == 0o700
    assert {path.name: _mode(path) for path in out.iterdir()} == {
        name: 0o600 for name in ("report.json", "trades.csv", "fills.csv", "equity.png",
                                 "report.html")}
    assert _mode(tmp_path / "deep") == 0o700 and _mode(tmp_path / "deep" / "cache") == 0o700
    files = list((tmp_path / "deep" / "cache").iterdir())
    assert files and all(_mode(path) == 0o600 for path in files)


def test_a_long_runs_transcripts_go_to_linked_pages_and_the_report_stays_small(
        tmp_path: Path) -> None:
    hours = 250
    record = _record(["100"] * hours)
    result = "x" * 5000  # a tool result of 5,000 characters in every decision
    record.decisions = [
        Decision(index=n, at=START + n * HOUR, trigger="schedule: hourly",
                 final_text=f"Held, decision {n}.", turn=f"t{n:06d}",
                 transcript=[TranscriptEntry("tool_call", "get_candles({})"),
                             TranscriptEntry("tool_result", f"candles {n} {result}")])
        for n in range(1, hours + 1)]
    write_report(record, tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert len(page) < 200_000  # the transcripts alone are 1.25 MB
    pages = sorted(path.name for path in (tmp_path / "transcripts").iterdir())
    assert pages == ["decisions-1.html", "decisions-2.html", "decisions-3.html"]
    # Decision 150 is listed on the report, linked to its transcript on page 2.
    assert '<li id="decision-150"><a href="transcripts/decisions-2.html#decision-150">' in page
    second = (tmp_path / "transcripts" / "decisions-2.html").read_text()
    assert 'id="decision-150" open>' in second and "candles 150 xxx" in second
    assert "candles 150 xxx" not in page
    assert '<a href="decisions-1.html">previous page</a>' in second
    assert '<a href="decisions-3.html">next page</a>' in second
    assert _mode(tmp_path / "transcripts") == 0o700
    assert _mode(tmp_path / "transcripts" / "decisions-2.html") == 0o600
