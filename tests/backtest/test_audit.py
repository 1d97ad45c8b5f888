"""The memorisation audit: the same span plain and masked, compared by hand on made-up
records, then through the command line against the scripted model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.backtest.test_backtest_cli import backtest, write_config
from tests.backtest.test_metrics import _record
from tests.backtest.trader import trading_responder
from tests.scripted_server import ScriptedServer
from trading_agent.backtest.audit import agreement, audit, decision_actions, verdict
from trading_agent.backtest.metrics import compute_figures
from trading_agent.backtest.record import Decision, TranscriptEntry

AT = datetime(2023, 1, 5, tzinfo=UTC)


def _decision(hour: int, *sides: str) -> Decision:
    calls = [TranscriptEntry("tool_call", 'place_order({"symbol": "ASSET/USD", "side": "'
                             + side + '", "type": "market", "amount": "0.01"})')
             for side in sides]
    return Decision(index=hour, at=AT + timedelta(hours=hour), trigger="schedule",
                    final_text="done", transcript=[TranscriptEntry("tool_call", "get_ticker({})"),
                                                   *calls])


def test_actions_and_agreement_by_hand() -> None:
    plain = _record(["100", "103"])
    plain.decisions = [_decision(1, "buy"), _decision(2), _decision(3, "sell", "buy"),
                       _decision(4, "sell")]
    masked = _record(["100", "101"])
    masked.decisions = [_decision(1, "buy"), _decision(2, "buy"), _decision(3, "buy", "sell")]
    assert decision_actions(plain) == {AT + timedelta(hours=1): "buy",
                                       AT + timedelta(hours=2): "hold",
                                       AT + timedelta(hours=3): "buy+sell",
                                       AT + timedelta(hours=4): "sell"}
    # Hours 1 and 3 agree; 2 differs; 4 was decided by one run only: 2 of 4.
    assert agreement(decision_actions(plain), decision_actions(masked)) == 0.5
    result = audit(plain, masked, compute_figures(plain), compute_figures(masked))
    assert result.plain_return == pytest.approx(0.03)
    assert result.masked_return == pytest.approx(0.01)
    assert result.return_difference == pytest.approx(0.02)
    assert (result.decisions, result.agreement) == (4, 0.5)
    assert "2.0 points more" in result.verdict and "trust the masked figures" in result.verdict


def test_the_verdict_names_what_the_difference_suggests() -> None:
    assert "no sign that the model recognised" in verdict(0.001, 0.9, 4)
    assert "may be using what it remembers" in verdict(0.03, 0.9, 4)
    assert "no sign that memory helped" in verdict(-0.03, 0.4, 4)
    assert "as much chance as skill" in verdict(0.0, 0.3, 4)
    assert "cannot tell" in verdict(0.0, None, 0)
    assert "Neither run closed a trade (100% of decisions agree)" in verdict(0.0, 1.0, 0)
    assert agreement({}, {}) is None


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with ScriptedServer(responder=trading_responder) as scripted:
        yield scripted


def test_audit_runs_the_span_plain_and_masked_and_reports_the_difference(
        tmp_path: Path, server: ScriptedServer, capsys: pytest.CaptureFixture[str]) -> None:
    """The scripted trader does the same whatever it reads: every decision agrees."""
    config = write_config(tmp_path / "desk.toml", server)
    assert backtest(config, tmp_path / "out", tmp_path / "cache", "--audit") == 0
    printed = capsys.readouterr().out
    assert "Audit: return plain" in printed and "decisions agreeing 100% of 6" in printed
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [run["label"] for run in report["runs"]] == ["plain", "masked"]
    assert [run["masked"] for run in report["runs"]] == [False, True]
    result = report["audit"]
    assert (result["decisions"], result["agreement"]) == (6, 1.0)
    assert result["plain_return"] == report["runs"][0]["total_return"]
    assert result["return_difference"] == pytest.approx(
        report["runs"][0]["total_return"] - report["runs"][1]["total_return"])
    assert result["verdict"] in printed
    page = (tmp_path / "out" / "report.html").read_text()
    assert "Memorisation audit" in page
    assert "buy-and-hold" not in result["verdict"]
    assert report["runs"][0]["fills"] > 0 and report["runs"][1]["fills"] > 0
    # The masked run's requests named no real symbol.
    masked = [r.body.decode() for r in server.requests if "ASSET/USD" in r.body.decode()]
    assert masked and not any("BTC" in body for body in masked)


def test_audit_takes_one_desk_and_no_mask(tmp_path: Path, server: ScriptedServer,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "desk.toml", server)
    assert backtest(config, tmp_path / "out", tmp_path / "cache", "--audit", "--mask") == 2
    assert "--audit runs one desk plain and masked" in capsys.readouterr().err

