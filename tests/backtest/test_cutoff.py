"""A model's knowledge cutoff: a span it may have seen is flagged, or refused on request.

Through the real command line against the scripted model on loopback, as
``tests/backtest/test_backtest_cli.py`` runs it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, date, datetime
from pathlib import Path

import pytest

from tests.backtest.test_backtest_cli import backtest, write_config
from tests.backtest.trader import trading_responder
from tests.scripted_server import ScriptedServer
from trading_agent.backtest.cutoff import seen_notice
from trading_agent.errors import ConfigError
from trading_agent.settings import load_settings
from trading_agent.settings.model import knowledge_cutoff


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with ScriptedServer(responder=trading_responder) as scripted:
        yield scripted


def _with_cutoff(path: Path, server: ScriptedServer, cutoff: str) -> Path:
    config = write_config(path, server)
    text = config.read_text().replace("context_window = 32000",
                                      f"context_window = 32000\nknowledge_cutoff = {cutoff}")
    config.write_text(text)
    return config


@pytest.mark.parametrize("value", ['"2024-13"', '"2024-8"', '"August 2024"', "2024"])
def test_a_cutoff_that_is_not_a_month_names_the_file_key_and_form(
        tmp_path: Path, server: ScriptedServer, value: str) -> None:
    config = _with_cutoff(tmp_path / "desk.toml", server, value)
    with pytest.raises(ConfigError) as caught:
        load_settings(config)
    message = str(caught.value)
    assert "desk.toml" in message and "knowledge_cutoff" in message, message
    assert "YYYY-MM" in message, message


def test_the_cutoff_is_read_as_the_first_day_after_its_month(
        tmp_path: Path, server: ScriptedServer) -> None:
    settings = load_settings(_with_cutoff(tmp_path / "a.toml", server, '"2024-12"'))
    assert knowledge_cutoff(settings.desks["hourly"].model) == date(2025, 1, 1)
    # A TOML date is taken as its month.
    settings = load_settings(_with_cutoff(tmp_path / "b.toml", server, "2024-08-15"))
    assert knowledge_cutoff(settings.desks["hourly"].model) == date(2024, 9, 1)
    settings = load_settings(write_config(tmp_path / "c.toml", server))
    assert knowledge_cutoff(settings.desks["hourly"].model) is None


def test_a_span_is_seen_until_the_end_of_the_cutoff_month() -> None:
    after = date(2023, 2, 1)  # a cutoff of 2023-01
    assert seen_notice(datetime(2023, 1, 31, 23, 55, tzinfo=UTC), after, "2023-01",
                       masked=False) is not None
    assert seen_notice(datetime(2023, 2, 1, tzinfo=UTC), after, "2023-01", masked=False) is None
    assert seen_notice(datetime(2020, 1, 1, tzinfo=UTC), None, None, masked=False) is None
    masked = seen_notice(datetime(2023, 1, 5, tzinfo=UTC), after, "2023-01", masked=True)
    assert masked is not None and "masked" in masked and "--mask" not in masked


def test_a_span_before_the_cutoff_is_flagged_on_the_terminal_and_in_the_report(
        tmp_path: Path, server: ScriptedServer, capsys: pytest.CaptureFixture[str]) -> None:
    config = _with_cutoff(tmp_path / "desk.toml", server, '"2023-06"')
    assert backtest(config, tmp_path / "out", tmp_path / "cache") == 0
    printed = capsys.readouterr()
    hint = "the model may have seen this period; run with --mask"
    assert hint in printed.err and "2023-06" in printed.err
    assert hint in printed.out  # under the figures, too
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert len(report["notices"]) == 1 and hint in report["notices"][0]
    assert report["masked"] is False
    page = (tmp_path / "out" / "report.html").read_text()
    assert "Read this first" in page and hint in page


def test_require_unseen_refuses_a_seen_span_and_runs_an_unseen_one(
        tmp_path: Path, server: ScriptedServer, capsys: pytest.CaptureFixture[str]) -> None:
    seen = _with_cutoff(tmp_path / "seen.toml", server, '"2023-01"')
    assert backtest(seen, tmp_path / "refused", tmp_path / "cache", "--require-unseen") == 2
    err = capsys.readouterr().err
    assert "--require-unseen" in err and "may have seen this period" in err
    assert not (tmp_path / "refused").exists()
    assert server.requests == []

    unseen = _with_cutoff(tmp_path / "unseen.toml", server, '"2022-12"')
    assert backtest(unseen, tmp_path / "ran", tmp_path / "cache", "--require-unseen") == 0
    report = json.loads((tmp_path / "ran" / "report.json").read_text())
    assert report["notices"] == []
    assert "may have seen" not in capsys.readouterr().err
