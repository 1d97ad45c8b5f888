"""``data fetch`` against the fake Binance on loopback: ccxt's real paging, parsing and errors."""

from __future__ import annotations

import argparse
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest

from trading_agent.backtest.candles import cached_candles_path, load_history_csv
from trading_agent.backtest.fetch import FetchResult, add_data_subcommand, fetch_history
from trading_agent.cli import main
from trading_agent.errors import ConfigError, ExchangeError, ExchangeUnavailableError
from trading_agent.trading.config import CcxtExchangeConfig
from trading_agent.trading.exchange import Candle

from ..trading.binance_server import FakeBinance
from ..trading.conftest import fake_binance_config

KLINES = "/api/v3/klines"
T0 = datetime(2023, 1, 3, tzinfo=UTC)
T0_MS = 1_672_704_000_000
STEP = timedelta(minutes=5)
STEP_MS = 300_000
PAGE = 100
LATER = T0 + timedelta(days=30)
"""A clock long after every candle of the history: all of them have closed."""


def history(count: int) -> list[list[Any]]:
    """``count`` Binance 5m klines from T0, each one's prices its own."""
    rows: list[list[Any]] = []
    for index in range(count):
        opened = T0_MS + index * STEP_MS
        base = 16_000 + index * 0.5
        rows.append([opened, f"{base:.8f}", f"{base + 3.25:.8f}", f"{base - 2.5:.8f}",
                     f"{base + 1:.8f}", f"{10 + index % 7}.125", opened + STEP_MS - 1,
                     "0", 10, "0", "0", "0"])
    return rows


def as_candles(rows: list[list[Any]]) -> list[Candle]:
    return [Candle("BTC/USDT", "5m", T0 + (row[0] - T0_MS) // STEP_MS * STEP,
                   *(Decimal(value) for value in row[1:6])) for row in rows]


def at(index: int) -> datetime:
    """The open time of the ``index``-th candle of the history."""
    return T0 + index * STEP


def files_under(folder: Path) -> list[Path]:
    return list(folder.rglob("*"))


def kline_starts(binance: FakeBinance, since: int = 0) -> list[int]:
    """The startTime of each klines request from the ``since``-th request on, as indexes."""
    return [(int(r.params["startTime"]) - T0_MS) // STEP_MS
            for r in binance.requests[since:] if r.path == KLINES]


@pytest.fixture
async def binance() -> AsyncIterator[FakeBinance]:
    server = FakeBinance("unused-key", "unused-secret")
    await server.start()
    server.serve_history(history(350), page_limit=PAGE)
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def config(binance: FakeBinance) -> CcxtExchangeConfig:
    """The trading tests' Binance on the fake server, without credentials (candles are
    public) and with ccxt's own rate limiting on, as a fetch runs."""
    return fake_binance_config(binance).model_copy(update={
        "api_key_env": None, "secret_env": None, "timeout_seconds": 1.0,
        "enable_rate_limit": True, "read_attempts": 2, "backoff_seconds": 0.0})


async def fetch(config: CcxtExchangeConfig, data_dir: Path, start: datetime, end: datetime,
                *, now: datetime = LATER, symbol: str = "BTC/USDT", timeframe: str = "5m",
                progress: list[tuple[int, datetime]] | None = None) -> FetchResult:
    def on_progress(count: int, up_to: datetime) -> None:
        if progress is not None:
            progress.append((count, up_to))

    return await fetch_history(config, symbol, timeframe, start, end, data_dir=data_dir,
                               on_progress=on_progress, now=lambda: now)


# -- paging ------------------------------------------------------------------------------------

async def test_pages_through_the_span_into_a_contiguous_file(
        binance: FakeBinance, config: CcxtExchangeConfig, tmp_path: Path) -> None:
    progress: list[tuple[int, datetime]] = []

    result = await fetch(config, tmp_path, T0, at(350), progress=progress)

    path = tmp_path / "binance" / "BTC_USDT-5m.csv"
    assert result == FetchResult(path, 350, 350, T0, at(349))
    assert load_history_csv(path, "BTC/USDT") == as_candles(history(350))
    # The fake answers at most 100 candles a request: four pages, each from the last's end.
    assert kline_starts(binance) == [0, 100, 200, 300]
    # ccxt says Binance spot gives 1000 candles a request: that is what each page asks for.
    assert {r.params["limit"] for r in binance.requests if r.path == KLINES} == {"1000"}
    assert progress == [(100, at(100)), (200, at(200)), (300, at(300)), (350, at(350))]


async def test_only_the_span_asked_for_is_kept(
        binance: FakeBinance, config: CcxtExchangeConfig, tmp_path: Path) -> None:
    # Neither the candle open at --from nor the one still open at --to is whole: left out.
    result = await fetch(config, tmp_path, at(10) - timedelta(minutes=2),
                         at(30) + timedelta(minutes=4))

    assert (result.written, result.first_open, result.last_open) == (20, at(10), at(29))
    assert load_history_csv(result.path, "BTC/USDT") == as_candles(history(350)[10:30])


async def test_a_second_overlapping_fetch_asks_only_for_what_is_missing(
        binance: FakeBinance, config: CcxtExchangeConfig, tmp_path: Path) -> None:
    await fetch(config, tmp_path, at(100), at(200))
    asked_before = len(binance.requests)

    result = await fetch(config, tmp_path, at(0), at(300))

    assert kline_starts(binance, asked_before) == [0, 200]
    assert (result.written, result.fetched) == (300, 200)
    assert load_history_csv(result.path, "BTC/USDT") == as_candles(history(300))

    asked_before = len(binance.requests)
    again = await fetch(config, tmp_path, at(50), at(250))

    # Everything is cached: the exchange is not even opened.
    assert binance.requests[asked_before:] == []
    assert (again.written, again.fetched) == (300, 0)


async def test_a_span_beyond_the_cache_is_bridged_so_the_file_keeps_no_gap(
        binance: FakeBinance, config: CcxtExchangeConfig, tmp_path: Path) -> None:
    await fetch(config, tmp_path, at(0), at(50))
    asked_before = len(binance.requests)

    result = await fetch(config, tmp_path, at(200), at(250))

    assert kline_starts(binance, asked_before) == [50, 150]
    assert (result.first_open, result.last_open, result.fetched) == (at(0), at(249), 200)
    assert len(load_history_csv(result.path, "BTC/USDT")) == 250


async def test_the_forming_candle_is_dropped_and_fetched_once_it_has_closed(
        binance: FakeBinance, config: CcxtExchangeConfig, tmp_path: Path) -> None:
    # Candle 349 opened two minutes ago: Binance serves it, still moving.
    now = at(349) + timedelta(minutes=2)

    result = await fetch(config, tmp_path, T0, T0 + timedelta(days=7), now=now)

    assert (result.written, result.last_open) == (349, at(348))
    assert load_history_csv(result.path, "BTC/USDT")[-1] == as_candles(history(349))[-1]

    later = await fetch(config, tmp_path, T0, T0 + timedelta(days=7), now=at(350))

    assert (later.written, later.fetched, later.last_open) == (350, 1, at(349))
    assert kline_starts(binance)[-1] == 349


async def test_a_market_listed_after_the_start_is_fetched_from_its_first_candle(
        binance: FakeBinance, config: CcxtExchangeConfig, tmp_path: Path) -> None:
    result = await fetch(config, tmp_path, T0 - timedelta(days=3), at(150))

    assert (result.first_open, result.written) == (T0, 150)


@pytest.mark.parametrize(("missing", "last", "to", "next_open"), [
    (range(150, 153), "12:25", "12:30", "12:45"),   # inside a page
    (range(100, 103), "08:15", "08:20", "08:35"),   # where a page starts
])
async def test_a_hole_in_the_exchange_data_is_reported_and_nothing_written(
        binance: FakeBinance, config: CcxtExchangeConfig, tmp_path: Path, missing: range,
        last: str, to: str, next_open: str) -> None:
    rows = history(350)
    del rows[missing.start:missing.stop]
    binance.serve_history(rows, page_limit=PAGE)

    with pytest.raises(ExchangeError) as caught:
        await fetch(config, tmp_path, T0, at(300))

    assert str(caught.value).startswith(
        f"binance has a hole in its 5m candles of BTC/USDT: 3 missing between 2023-01-03 {last} "
        f"and 2023-01-03 {next_open} UTC. A backtest needs candles without gaps, so nothing "
        f"was written; expected a span on one side of the hole (--to 2023-01-03 {to} or --from "
        f"2023-01-03 {next_open})")
    assert files_under(tmp_path) == []


# -- refusals --------------------------------------------------------------------------------

async def test_a_timeframe_the_exchange_does_not_offer_names_the_ones_it_does(
        config: CcxtExchangeConfig, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        await fetch(config, tmp_path, T0, at(10), timeframe="7m")

    assert str(caught.value) == (
        "binance does not offer 7m candles; it offers 1s, 1m, 3m, 5m, 15m, 30m, 1h, 2h, 4h, "
        "6h, 8h, 12h, 1d, 3d, 1w, 1M")


async def test_a_timeframe_not_like_5m_is_refused_before_the_exchange_is_asked(
        binance: FakeBinance, config: CcxtExchangeConfig, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown timeframe '5 minutes'"):
        await fetch(config, tmp_path, T0, at(10), timeframe="5 minutes")
    assert binance.requests == []


@pytest.mark.parametrize("symbol", ["BTC/USDX", "btc/usdt", "BTCUSDT"])
async def test_an_unknown_symbol_names_close_matches(
        config: CcxtExchangeConfig, tmp_path: Path, symbol: str) -> None:
    with pytest.raises(ConfigError) as caught:
        await fetch(config, tmp_path, T0, at(10), symbol=symbol)

    assert str(caught.value).startswith(f"binance has no market {symbol!r}; close matches: "
                                        "BTC/USDT")


async def test_an_unknown_exchange_is_the_configs_usual_error(tmp_path: Path) -> None:
    config = CcxtExchangeConfig(exchange_id="binanse")

    with pytest.raises(ConfigError, match=re.escape(
            "exchange.ccxt.exchange_id: ccxt has no exchange 'binanse'")):
        await fetch(config, tmp_path, T0, at(10))


async def test_a_span_not_yet_closed_or_backwards_is_refused(
        config: CcxtExchangeConfig, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no whole 5m candle of BTC/USDT between 2023-01-03 "
                                          "00:00 and 2023-01-03 01:00 UTC has closed"):
        await fetch(config, tmp_path, T0, at(12), now=at(0) + timedelta(minutes=3))
    with pytest.raises(ConfigError, match="is empty; expected --from before --to"):
        await fetch(config, tmp_path, at(12), T0)


async def test_a_corrupt_cache_file_is_named_with_what_to_do(
        config: CcxtExchangeConfig, tmp_path: Path) -> None:
    path = cached_candles_path(tmp_path, "binance", "BTC/USDT", "5m")
    path.parent.mkdir(parents=True)
    path.write_text("timestamp_ms,open,high,low,close,volume\n1672704000000,1,1,1,x,1\n")

    with pytest.raises(ConfigError) as caught:
        await fetch(config, tmp_path, T0, at(10))

    message = str(caught.value)
    assert f"{path}:2: column close: 'x' is not a number" in message
    assert message.endswith(f"delete {path} to fetch them again")


# -- exchange failures -------------------------------------------------------------------------

async def test_a_failure_mid_fetch_leaves_no_partial_file(
        binance: FakeBinance, config: CcxtExchangeConfig, tmp_path: Path) -> None:
    progress: list[tuple[int, datetime]] = []

    def fail_after_first_page(count: int, up_to: datetime) -> None:
        progress.append((count, up_to))
        # Every attempt at the next page gets Binance's 502.
        binance.fail("GET", KLINES, "bad_gateway", "bad_gateway")

    with pytest.raises(ExchangeUnavailableError) as caught:
        await fetch_history(config, "BTC/USDT", "5m", T0, at(350), data_dir=tmp_path,
                            on_progress=fail_after_first_page, now=lambda: LATER)

    assert str(caught.value).startswith(
        "binance unreachable during fetch 5m candles BTC/USDT")
    assert str(caught.value).endswith("(after 2 attempts)")
    assert progress == [(100, at(100))]
    assert files_under(tmp_path) == []


async def test_a_failure_leaves_the_cache_file_as_it_was(
        binance: FakeBinance, config: CcxtExchangeConfig, tmp_path: Path) -> None:
    first = await fetch(config, tmp_path, at(100), at(200))
    before = first.path.read_bytes()
    binance.fail("GET", KLINES, "rate_limit", "rate_limit")

    with pytest.raises(ExchangeUnavailableError, match="rate limit exceeded"):
        await fetch(config, tmp_path, at(0), at(300))

    assert first.path.read_bytes() == before
    assert [p.name for p in first.path.parent.iterdir()] == ["BTC_USDT-5m.csv"]


# -- the command line ------------------------------------------------------------------------

def command_line(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="trading-agent")
    add_data_subcommand(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["data", "fetch", *argv])


async def run(*argv: str) -> int:
    """Runs the command's handler as ``main`` would, off the loop serving the fake exchange."""
    args = command_line(*argv)
    return int(await anyio.to_thread.run_sync(args.handler, args))


def config_file(tmp_path: Path, binance: FakeBinance) -> Path:
    urls = binance.api_urls()
    path = tmp_path / "trading-agent.toml"
    path.write_text(f"""
[model]
provider = "openai"
base_url = "http://127.0.0.1:8080/v1"
model = "small"
context_window = 32000

[exchange.ccxt]
exchange_id = "kraken"           # replaced by the command's EXCHANGE
options = {{ fetchMarkets = {{ types = ["spot"] }}, fetchCurrencies = false, fetchMargins = false }}
api_urls = {{ public = "{urls['public']}", private = "{urls['private']}" }}
client_settings = {{ timeout_on_exit = 0 }}
timeout_seconds = 1.0
read_attempts = 2
backoff_seconds = 0

[desks.alpha]
system_prompt = "You trade."
symbols = ["BTC/USDT"]
""", encoding="utf-8")
    return path


async def test_the_command_fetches_prints_progress_and_where_the_file_is(
        binance: FakeBinance, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = await run("binance", "BTC/USDT", "5m", "--from", "2023-01-03", "--to",
                     "2023-01-04T05:10", "--data-dir", str(tmp_path / "candles"),
                     "--config", str(config_file(tmp_path, binance)))

    out, err = capsys.readouterr()
    path = tmp_path / "candles" / "binance" / "BTC_USDT-5m.csv"
    assert code == 0, err
    assert out == (f"{path}: 350 5m candles of BTC/USDT opening 2023-01-03 00:00 to "
                   "2023-01-04 05:05 UTC (350 fetched now)\n")
    assert err.splitlines() == [
        "fetched 100 candles, up to 2023-01-03 08:20 UTC",
        "fetched 200 candles, up to 2023-01-03 16:40 UTC",
        "fetched 300 candles, up to 2023-01-04 01:00 UTC",
        "fetched 350 candles, up to 2023-01-04 05:10 UTC",
    ]
    assert load_history_csv(path, "BTC/USDT") == as_candles(history(350))


async def test_the_command_uses_the_cache_under_xdg_cache_home_by_default(
        binance: FakeBinance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))

    code = await run("binance", "BTC/USDT", "5m", "--from", "2023-01-03T01:00", "--to",
                     "2023-01-03T02:00+00:00", "--config", str(config_file(tmp_path, binance)))

    out, _ = capsys.readouterr()
    assert code == 0
    assert out.startswith(f"{tmp_path}/xdg/trading-agent/candles/binance/BTC_USDT-5m.csv: "
                          "12 5m candles")


@pytest.mark.parametrize(("argv", "expected"), [
    (["--from", "2023-13-01", "--to", "2023-01-05"],
     "trading-agent data fetch: --from: '2023-13-01' is not a date; expected ISO 8601 like "
     "2023-01-05 or 2023-01-05T12:00 (UTC unless an offset is given)"),
    (["--from", "2023-01-05", "--to", "2023-01-04T12:00"],
     "trading-agent data fetch: --from 2023-01-05 00:00 is not before --to 2023-01-04 12:00; "
     "expected --from before --to"),
])
async def test_a_bad_argument_exits_2_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
        expected: str) -> None:
    code = await run("binance", "BTC/USDT", "5m", *argv, "--data-dir", str(tmp_path))

    out, err = capsys.readouterr()
    assert (code, out, err) == (2, "", expected + "\n")


async def test_an_unknown_timeframe_exits_2(
        binance: FakeBinance, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = await run("binance", "BTC/USDT", "2m", "--from", "2023-01-03", "--to", "2023-01-04",
                     "--data-dir", str(tmp_path / "c"),
                     "--config", str(config_file(tmp_path, binance)))

    _, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("trading-agent data fetch: binance does not offer 2m candles; it "
                          "offers 1s, 1m, 3m, 5m")


async def test_a_bad_config_file_exits_2_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[exchange.ccxt]\ntimeout_seconds = -1\n")

    code = await run("binance", "BTC/USDT", "5m", "--from", "2023-01-03", "--to", "2023-01-04",
                     "--config", str(path), "--data-dir", str(tmp_path))

    _, err = capsys.readouterr()
    assert code == 2
    assert err.startswith(f"trading-agent data fetch: {path}: ")
    assert "timeout_seconds" in err


async def test_an_exchange_failure_exits_1_with_the_reason_and_no_file(
        binance: FakeBinance, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    binance.fail("GET", KLINES, "bad_gateway", "bad_gateway")

    code = await run("binance", "BTC/USDT", "5m", "--from", "2023-01-03", "--to", "2023-01-04",
                     "--data-dir", str(tmp_path / "candles"),
                     "--config", str(config_file(tmp_path, binance)))

    out, err = capsys.readouterr()
    assert (code, out) == (1, "")
    assert err.startswith("trading-agent data fetch: binance unreachable during fetch 5m "
                          "candles BTC/USDT")
    assert not (tmp_path / "candles").exists()


async def test_the_trading_agent_command_has_data_fetch(
        binance: FakeBinance, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["data", "fetch", "binance", "ETH/USDT", "5m", "--from", "2023-01-03", "--to",
            "2023-01-03T01:00", "--data-dir", str(tmp_path / "candles"),
            "--config", str(config_file(tmp_path, binance))]

    code = await anyio.to_thread.run_sync(main, argv)

    out, err = capsys.readouterr()
    # The fake serves candles of BTCUSDT only: ETH/USDT is a known market with none.
    assert code == 1
    assert err == ("trading-agent data fetch: binance has no 5m candles of ETH/USDT between "
                   "2023-01-03 00:00 and 2023-01-03 01:00 UTC; nothing was written\n")
    assert out == ""

    argv[3] = "BTC/USDT"
    code = await anyio.to_thread.run_sync(main, argv)

    out, _ = capsys.readouterr()
    assert code == 0
    assert out.endswith(": 12 5m candles of BTC/USDT opening 2023-01-03 00:00 to 2023-01-03 "
                        "00:55 UTC (12 fetched now)\n")


def test_the_command_refuses_a_missing_option_with_exit_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["data", "fetch", "binance", "BTC/USDT", "5m", "--from", "2023-01-03"])

    assert caught.value.code == 2
    assert "the following arguments are required: --to" in capsys.readouterr().err
