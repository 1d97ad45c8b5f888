"""Many windows: which spans run, and the scorecard through the command line."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.backtest.test_backtest_cli import write_config
from tests.backtest.test_cutoff import _with_cutoff
from tests.backtest.trader import trading_responder
from tests.scripted_server import ScriptedServer
from trading_agent.backtest.scorecard_report import WINDOW_COLUMNS
from trading_agent.backtest.windows import choose_windows
from trading_agent.cli import main

FROM = datetime(2023, 1, 5, tzinfo=UTC)
TO = datetime(2023, 1, 9, tzinfo=UTC)
DAY = timedelta(days=1)


def test_random_windows_are_seeded_inside_the_range_on_candle_boundaries() -> None:
    windows = choose_windows(FROM, TO, DAY, count=5, seed=1)
    assert windows == choose_windows(FROM, TO, DAY, count=5, seed=1)
    assert windows != choose_windows(FROM, TO, DAY, count=5, seed=2)
    assert windows == sorted(windows)
    for window in windows:
        assert window.start >= FROM and window.end <= TO and window.end - window.start == DAY
        assert window.start.minute % 5 == 0 and window.start.second == 0


def test_even_and_walk_forward_windows() -> None:
    even = choose_windows(FROM, TO, DAY, count=4, spacing="even")
    assert [w.start for w in even] == [FROM, FROM + DAY, FROM + 2 * DAY, FROM + 3 * DAY]
    walk = choose_windows(FROM, TO, DAY * 1.5, spacing="walk-forward")
    assert [(w.start, w.end) for w in walk] == [(FROM, FROM + 1.5 * DAY),
                                                (FROM + 1.5 * DAY, FROM + 3 * DAY)]
    with pytest.raises(ValueError, match="shorter than one window of 5 days"):
        choose_windows(FROM, TO, 5 * DAY, count=2)


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with ScriptedServer(responder=trading_responder) as scripted:
        yield scripted


def sweep(config: Path, out: Path, cache: Path, *more: str) -> int:
    return main(["backtest", str(config), "--from", "2023-01-05", "--to", "2023-01-07",
                 "--out", str(out), "--cache-dir", str(cache), "--quiet", "--window", "0.25",
                 "--random-traders", "3", *more])


def test_a_sweep_writes_a_scorecard_against_every_baseline(
        tmp_path: Path, server: ScriptedServer, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "desk.toml", server)
    assert sweep(config, tmp_path / "out", tmp_path / "cache", "--windows", "3") == 0
    printed = capsys.readouterr().out
    assert "hourly: 3 windows of 0.25 days" in printed
    for baseline in ("buy and hold", "MA crossover 12/48", "random traders"):
        assert f"- vs {baseline}: ahead in " in printed
    assert "beats a random trader with probability" in printed
    assert "Per decision:" in printed and "tokens" in printed
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (run,) = report["runs"]
    assert len(run["windows"]) == 3 and len(report["windows"]) == 3
    assert [b["baseline"] for b in run["baselines"]] == ["buy and hold", "MA crossover 12/48",
                                                         "random traders"]
    assert all(b["verdict"] in ("beat", "lost", "unclear") for b in run["baselines"])
    assert run["total_return"]["median"] == sorted(
        w["total_return"] for w in run["windows"])[1]
    assert run["tokens_per_decision"] > 0 and run["cost_per_decision"] > 0
    assert len(report["verdicts"]) == 3 and report["notices"] == []
    with (tmp_path / "out" / "windows.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == list(WINDOW_COLUMNS) and len(rows) == 3
    page = (tmp_path / "out" / "report.html").read_text()
    assert "Scorecard over 3 windows" in page and "vs random traders" in page


def test_a_sweep_needs_a_window_length(tmp_path: Path, server: ScriptedServer,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "desk.toml", server)
    assert main(["backtest", str(config), "--from", "2023-01-05", "--to", "2023-01-07",
                 "--out", str(tmp_path / "out"), "--windows", "3"]) == 2
    assert "--window DAYS" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_sweep_over_a_period_the_model_may_have_seen_says_so(
        tmp_path: Path, server: ScriptedServer, capsys: pytest.CaptureFixture[str]) -> None:
    config = _with_cutoff(tmp_path / "desk.toml", server, '"2023-06"')
    assert sweep(config, tmp_path / "out", tmp_path / "cache", "--windows", "1",
                 "--random-traders", "0") == 0
    assert "Read this first: hourly: the span starts" in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert len(report["notices"]) == 1 and "run with --mask" in report["notices"][0]
    assert "Read this first" in (tmp_path / "out" / "report.html").read_text()
