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
from tests.backtest.test_metrics import _fill, _record, _trip
from tests.backtest.trader import trading_responder
from tests.scripted_server import ScriptedServer
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
