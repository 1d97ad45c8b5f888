"""A backtest answered by the real embedded model, then re-run from the cache for free.

The demo's own model (Gemma 3 270M in llama-cpp-python's server) backtests a desk waking
every three hours over one day of the packaged candles through ``trading-agent backtest``; a
second run with ``--cache strict`` must make no model call and give the same figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.local_model import needs_local_model

pytestmark = [pytest.mark.slow, needs_local_model]

CONFIG = """
[daemon]
state_dir = "state"

[model]
provider = "local"
context_window = 4096
max_output_tokens = 48
# One llama.cpp thread: make test runs two workers on two cores, and two spinning threads
# beside the other worker ran this test about three times slower than one (397 s, loaded).
threads = 1
cache_dir = "{models}"

[desks.thrice]
system_prompt = '''You are a paper-trading desk for BTC/USDT.
Check the ticker, then answer in one short sentence.'''
symbols = ["BTC/USDT"]
tools = ["get_ticker", "get_balance", "place_order"]
maximum_rounds = 3

[desks.thrice.triggers]
# Every three hours, not every hour: eight decisions show what 24 would, in a third of the
# suite's time.
schedules = [{{ every = "3h", name = "thrice", message = "Check the market." }}]

[desks.thrice.subagents]
enabled = false
"""


def _backtest(config: Path, out: Path, cache: Path, mode: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "trading_agent.cli", "backtest", str(config),
               "--from", "2023-01-10", "--to", "2023-01-11", "--out", str(out),
               "--cache", mode, "--cache-dir", str(cache), "--quiet"]
    return subprocess.run(command, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "NO_COLOR": "1"}, check=False)


@pytest.mark.timeout(900)
def test_the_local_model_backtests_a_day_and_the_cached_rerun_is_free(
        tmp_path: Path, model_cache: Path) -> None:
    config = tmp_path / "thrice.toml"
    config.write_text(CONFIG.format(models=model_cache))
    cache = tmp_path / "responses"

    first = _backtest(config, tmp_path / "first", cache, "record")
    assert first.returncode == 0, first.stderr
    report = json.loads((tmp_path / "first" / "report.json").read_text())
    assert report["desk"] == "thrice" and report["candles"] == 288
    assert report["decisions"] == 8  # one every three hours, the first at 03:00
    assert report["model_calls"] >= 8 and report["cache_hits"] == 0
    assert (tmp_path / "first" / "report.html").stat().st_size > 0
    assert "total return" in first.stdout.lower()

    second = _backtest(config, tmp_path / "second", cache, "strict")
    assert second.returncode == 0, second.stderr
    again = json.loads((tmp_path / "second" / "report.json").read_text())
    assert again["model_calls"] == 0
    assert again["cache_hits"] == report["model_calls"]
    figures = {key: value for key, value in report.items()
               if key not in ("model_calls", "cache_hits")}
    assert {key: again[key] for key in figures} == figures
    assert (tmp_path / "second" / "trades.csv").read_bytes() == \
        (tmp_path / "first" / "trades.csv").read_bytes()
