"""``--jobs N``: windows in worker processes give the same report as one job, and their
answers, appended to one cache file at once, all replay."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.backtest.test_backtest_cli import SPAN, write_config
from tests.backtest.test_windows import sweep
from tests.backtest.trader import trading_responder
from tests.scripted_server import ScriptedServer
from trading_agent.cli import main


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with ScriptedServer(responder=trading_responder) as scripted:
        yield scripted


def _files(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in ("report.json", "windows.csv",
                                                         "report.html")}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_jobs_record_one_cache_and_report_as_one_job_does(
        tmp_path: Path, server: ScriptedServer) -> None:
    config = write_config(tmp_path / "desk.toml", server)
    cache = tmp_path / "cache"
    # Two workers record four windows into one cache file at once.
    assert sweep(config, tmp_path / "recorded", cache, "--windows", "4", "--jobs", "2") == 0
    asked = len(server.requests)
    assert asked > 0
    # Every answer they appended replays: strict runs never reach the model.
    assert sweep(config, tmp_path / "one", cache, "--windows", "4", "--cache", "strict") == 0
    assert sweep(config, tmp_path / "two", cache, "--windows", "4", "--cache", "strict",
                 "--jobs", "2") == 0
    assert len(server.requests) == asked
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    # And the recording run's figures are those of the replays (its model time aside).
    recorded = json.loads((tmp_path / "recorded" / "report.json").read_text())
    replayed = json.loads((tmp_path / "one" / "report.json").read_text())
    for run in (recorded["runs"][0], replayed["runs"][0]):
        run.pop("model_seconds_per_decision")
        for window in run["windows"]:
            window.pop("model_seconds")
    assert recorded == replayed


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_configs_in_two_jobs_give_the_report_of_one_job(
        tmp_path: Path, server: ScriptedServer) -> None:
    first = write_config(tmp_path / "calm.toml", server)
    second = write_config(tmp_path / "bold.toml", server, prompt="You trade BTC/USDT boldly.")
    cache = tmp_path / "cache"

    def compare(out: str, *more: str) -> int:
        return main(["backtest", "--compare", str(first), str(second), *SPAN, "--out",
                     str(tmp_path / out), "--cache-dir", str(cache), "--quiet", *more])

    assert compare("recorded", "--jobs", "2") == 0
    asked = len(server.requests)
    assert compare("one", "--cache", "strict") == 0
    assert compare("two", "--cache", "strict", "--jobs", "2") == 0
    assert len(server.requests) == asked
    names = sorted(path.name for path in (tmp_path / "one").iterdir())
    assert names == sorted(path.name for path in (tmp_path / "two").iterdir())
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    # The recording's figures are the replays' too (it asked the model, they did not).
    recorded, replayed = (json.loads((tmp_path / name / "report.json").read_text())
                          for name in ("recorded", "one"))
    for report in (recorded, replayed):
        for run in report["runs"]:
            del run["model_calls"], run["cache_hits"]
    assert recorded == replayed
