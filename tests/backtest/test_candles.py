"""Historical candles from CSV files: every bad line named, every time form read, spans cut."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from trading_agent.backtest.candles import (
    cached_candles_path,
    candles_in_span,
    default_data_dir,
    load_history_csv,
    write_history_csv,
)
from trading_agent.errors import ConfigError
from trading_agent.trading.config import PACKAGED_CANDLES
from trading_agent.trading.exchange import Candle
from trading_agent.trading.replay import load_candles_csv

T0 = datetime(2023, 1, 3, 10, 0, tzinfo=UTC)
T0_MS = 1_672_740_000_000
FIVE = timedelta(minutes=5)
HEADER = "timestamp_ms,open,high,low,close,volume"


def write(tmp_path: Path, *lines: str, name: str = "candles.csv") -> Path:
    path = tmp_path / name
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def row(index: int, close: str = "101") -> str:
    """The line of the ``index``-th 5-minute candle from T0."""
    return f"{T0_MS + index * 300_000},100,102,99,{close},5.5"


def load(path: Path, timeframe: str = "5m") -> list[Candle]:
    return load_history_csv(path, "BTC/USDT", timeframe)


def refused(path: Path, timeframe: str = "5m") -> str:
    with pytest.raises(ConfigError) as caught:
        load(path, timeframe)
    return str(caught.value)


# -- reading -------------------------------------------------------------------------------

def test_the_replay_format_is_read_as_candles(tmp_path: Path) -> None:
    path = write(tmp_path, HEADER, row(0), row(1, close="100.5"))

    candles = load(path)

    assert candles == [
        Candle("BTC/USDT", "5m", T0, Decimal(100), Decimal(102), Decimal(99), Decimal(101),
               Decimal("5.5")),
        Candle("BTC/USDT", "5m", T0 + FIVE, Decimal(100), Decimal(102), Decimal(99),
               Decimal("100.5"), Decimal("5.5")),
    ]


@pytest.mark.parametrize(("column", "first", "second"), [
    ("timestamp", "1672740000", "1672740300"),                    # seconds
    ("Time", "1672740000000", "1672740300000"),                   # milliseconds
    ("date", "2023-01-03T10:00:00Z", "2023-01-03T10:05:00Z"),     # ISO with Z
    ("datetime", "2023-01-03 10:00:00", "2023-01-03 10:05:00"),   # naive ISO: UTC
    ("open_time", "2023-01-03T11:00:00+01:00", "2023-01-03T11:05:00+01:00"),  # an offset
    ("ts", "1672740000000.0", "1672740300000.0"),                 # a spreadsheet's floats
])
def test_times_in_seconds_milliseconds_or_iso_mean_the_same_opens(
        tmp_path: Path, column: str, first: str, second: str) -> None:
    path = write(tmp_path, f"{column},open,high,low,close,volume",
                 f"{first},1,2,1,2,0", f"{second},2,2,1,1,0")

    assert [c.opened_at for c in load(path)] == [T0, T0 + FIVE]


def test_columns_are_found_by_name_in_any_case_and_order_and_extras_are_ignored(
        tmp_path: Path) -> None:
    path = write(tmp_path,
                 "Volume,Close,symbol,Low,High,Open,Date,trades",
                 "7,101,BTCUSDT,99,102,100,2023-01-03 10:00,12",
                 "8,103,BTCUSDT,100,104,101,2023-01-03 10:05,15")

    candles = load(path)

    assert [(c.opened_at, c.open, c.high, c.low, c.close, c.volume) for c in candles] == [
        (T0, *map(Decimal, (100, 102, 99, 101, 7))),
        (T0 + FIVE, *map(Decimal, (101, 104, 100, 103, 8)))]


def test_a_byte_order_mark_and_blank_lines_are_tolerated(tmp_path: Path) -> None:
    path = tmp_path / "excel.csv"
    path.write_bytes(("\ufeff" + HEADER + "\r\n" + row(0) + "\r\n\r\n" + row(1) + "\r\n")
                     .encode("utf-8"))

    assert len(load(path)) == 2


def test_hourly_and_weekly_candles_are_aligned_to_their_own_boundaries(tmp_path: Path) -> None:
    hourly = write(tmp_path, "time,open,high,low,close,volume", "2023-01-03T10:00,1,1,1,1,0",
                   "2023-01-03T11:00,1,1,1,1,0", name="hourly.csv")
    # Weekly candles open on Mondays, as exchanges publish them.
    weekly = write(tmp_path, "time,open,high,low,close,volume", "2023-01-02,1,1,1,1,0",
                   "2023-01-09,1,1,1,1,0", name="weekly.csv")

    assert len(load(hourly, "1h")) == 2
    assert [c.opened_at.weekday() for c in load(weekly, "1w")] == [0, 0]


# -- every problem with its line ---------------------------------------------------------------

@pytest.mark.parametrize(("lines", "expected"), [
    pytest.param([HEADER, row(0), "1672740300000,100,102,99"],
                 ":3: 4 fields; expected 6 like the header", id="fields"),
    pytest.param([HEADER, row(0), row(1, close="abc")],
                 ":3: column close: 'abc' is not a number", id="not-a-number"),
    pytest.param([HEADER, f"{T0_MS},100,102,99,NaN,1"],
                 ":2: column close: 'NaN' is not a number", id="nan"),
    pytest.param([HEADER, row(0), "yesterday,100,102,99,101,1"],
                 ":3: column timestamp_ms: 'yesterday' is not a time; expected milliseconds "
                 "or seconds since the epoch, or ISO 8601", id="not-a-time"),
    pytest.param([HEADER, f"{T0_MS},100,102,99,103,1"],
                 ":2: inconsistent candle: open 100, high 102, low 99, close 103; expected "
                 "low <= open, close <= high", id="high-below-close"),
    pytest.param([HEADER, f"{T0_MS},100,102,100.5,101,1"],
                 ":2: inconsistent candle: open 100, high 102, low 100.5, close 101",
                 id="low-above-open"),
    pytest.param([HEADER, f"{T0_MS},0,102,0,101,1"],
                 ":2: column open: 0 is not a price; expected a number above 0", id="zero"),
    pytest.param([HEADER, f"{T0_MS},100,102,99,101,-1"],
                 ":2: column volume: -1 is negative; expected 0 or more", id="volume"),
    pytest.param([HEADER, row(0), row(1), row(1)],
                 ":4: duplicate timestamp 2023-01-03 10:05 UTC, already on line 3",
                 id="duplicate"),
    pytest.param([HEADER, row(0), row(2), row(1)],
                 ":4: unordered timestamp: 2023-01-03 10:05 UTC is earlier than 2023-01-03 "
                 "10:10 UTC on line 3; expected candles in time order, oldest first",
                 id="unordered"),
    pytest.param([HEADER, row(0), row(4)],
                 ":3: a gap: 3 candles of 5m missing between 2023-01-03 10:00 and 2023-01-03 "
                 "10:20 UTC", id="gap"),
    pytest.param([HEADER, row(0), f"{T0_MS + 420_000},100,102,99,101,1"],
                 ":3: 2023-01-03 10:07 UTC is not aligned to the 5m timeframe; expected "
                 "candle open times on multiples of 5m", id="unaligned"),
    pytest.param([HEADER], ":2: no candles after the header", id="header-only"),
    pytest.param(["when,open,high,low,close", "1,2,3,4,5"],
                 ":1: the header lacks a time column, volume; found 'when', 'open', 'high', "
                 "'low', 'close'; expected a time column (timestamp_ms, timestamp, time, date, "
                 "datetime, open_time, ts) and open, high, low, close, volume", id="columns"),
])
def test_each_problem_is_named_with_its_file_and_line(
        tmp_path: Path, lines: list[str], expected: str) -> None:
    path = write(tmp_path, *lines)

    message = refused(path)

    assert message.startswith(f"{path}{expected}"), message


def test_an_empty_file_asks_for_a_header(tmp_path: Path) -> None:
    path = write(tmp_path)

    assert refused(path).startswith(f"{path}:1: the file is empty; expected a header such as "
                                    f"{HEADER}")


def test_line_numbers_count_blank_lines_and_quoted_line_breaks(tmp_path: Path) -> None:
    path = write(tmp_path, "timestamp,open,high,low,close,volume,note", row(0) + ',"two',
                 'lines"', "", row(1, close="x") + ",")

    assert refused(path).startswith(f"{path}:5: column close: 'x' is not a number")


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.csv"

    message = refused(path)

    assert message.startswith(f"{path}: cannot read the candles of BTC/USDT")
    assert "No such file" in message


def test_a_binary_file_is_refused_as_not_text(tmp_path: Path) -> None:
    path = tmp_path / "candles.csv"
    path.write_bytes(b"timestamp,open\n\xff\xfe\x00garbage\n")

    assert refused(path).startswith(f"{path}: not a text CSV file")


def test_an_unknown_timeframe_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, HEADER, row(0))

    assert "unknown timeframe '5x'" in refused(path, "5x")


# -- the packaged candles --------------------------------------------------------------------

def test_the_packaged_candles_load_quickly_and_match_the_replay() -> None:
    started = time.perf_counter()
    candles = load_history_csv(PACKAGED_CANDLES, "BTC/USDT")
    elapsed = time.perf_counter() - started

    assert len(candles) == 10_999
    assert candles == load_candles_csv(PACKAGED_CANDLES, "BTC/USDT")
    # About 0.06 s on the development machine; loaded on every backtest.
    assert elapsed < 1.0, f"loading took {elapsed:.2f} s"


def test_a_file_rewritten_at_once_with_the_same_size_is_read_anew(tmp_path: Path) -> None:
    """Files read before are remembered by their bytes, never by name, size or time (a
    rewrite within one tick of the file system's clock leaves those equal)."""
    path = write(tmp_path, HEADER, row(0), row(1))
    first = load(path)
    write(tmp_path, HEADER, row(0), row(1, close="100"))

    again = load(path)

    assert [c.close for c in first] == [Decimal(101), Decimal(101)]
    assert [c.close for c in again] == [Decimal(101), Decimal(100)]


def test_a_caller_changing_its_candles_changes_no_one_elses(tmp_path: Path) -> None:
    path = write(tmp_path, HEADER, row(0), row(1))
    mine = load(path)
    mine.clear()

    assert len(load(path)) == 2


# -- spans ---------------------------------------------------------------------------------

@pytest.fixture
def hour(tmp_path: Path) -> list[Candle]:
    """Twelve candles, 10:00 to 11:00."""
    return load(write(tmp_path, HEADER, *(row(i) for i in range(12))))


def test_a_span_inside_the_data_gives_its_candles(hour: list[Candle]) -> None:
    span, first = candles_in_span(hour, T0 + 2 * FIVE, T0 + 5 * FIVE, source="x.csv")

    assert [c.opened_at for c in span] == [T0 + 2 * FIVE, T0 + 3 * FIVE, T0 + 4 * FIVE]
    assert first == 0


def test_the_whole_data_is_a_span_and_naive_times_are_utc(hour: list[Candle]) -> None:
    span, first = candles_in_span(hour, datetime(2023, 1, 3, 10), datetime(2023, 1, 3, 11),
                                  source="x.csv")

    assert span == hour
    assert first == 0


def test_a_candle_still_open_at_the_end_is_left_out(hour: list[Candle]) -> None:
    span, _ = candles_in_span(hour, T0 + 1 * FIVE + timedelta(minutes=1),
                              T0 + 4 * FIVE + timedelta(minutes=4), source="x.csv")

    assert [c.opened_at for c in span] == [T0 + 2 * FIVE, T0 + 3 * FIVE]


def test_warm_up_candles_come_before_the_span(hour: list[Candle]) -> None:
    span, first = candles_in_span(hour, T0 + 4 * FIVE, T0 + 6 * FIVE, source="x.csv",
                                  warmup=3)

    assert [c.opened_at for c in span] == [T0 + i * FIVE for i in range(1, 6)]
    assert first == 3
    assert span[first].opened_at == T0 + 4 * FIVE


@pytest.mark.parametrize(("start", "end"), [
    (T0 - FIVE, T0 + FIVE),                    # starts before the data
    (T0 + 10 * FIVE, T0 + 13 * FIVE),          # ends after it
    (T0 + timedelta(days=1), T0 + timedelta(days=2)),   # wholly after it
])
def test_a_span_outside_the_data_names_the_data_and_the_span(
        hour: list[Candle], start: datetime, end: datetime) -> None:
    with pytest.raises(ConfigError) as caught:
        candles_in_span(hour, start, end, source="data/btc.csv")

    message = str(caught.value)
    assert message.startswith("BTC/USDT in data/btc.csv covers 2023-01-03 10:00 to 2023-01-03 "
                              "11:00 UTC (5m candles); the span asked for, ")
    assert f"{start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M} UTC, is outside it" in message


def test_too_little_warm_up_says_how_much_there_is(hour: list[Candle]) -> None:
    with pytest.raises(ConfigError) as caught:
        candles_in_span(hour, T0 + 2 * FIVE, T0 + 6 * FIVE, source="x.csv", warmup=5)

    message = str(caught.value)
    assert "BTC/USDT in x.csv covers 2023-01-03 10:00 to 2023-01-03 11:00 UTC" in message
    assert ("needs 5 candles of warm-up before 2023-01-03 10:10 UTC but the data has 2; "
            "expected a start at 2023-01-03 10:25 UTC or later") in message


def test_a_span_that_ends_before_it_starts_is_refused(hour: list[Candle]) -> None:
    with pytest.raises(ConfigError, match="the span 2023-01-03 10:30 to 2023-01-03 10:10 UTC "
                                          "is empty; expected a start before its end"):
        candles_in_span(hour, T0 + 6 * FIVE, T0 + 2 * FIVE, source="x.csv")
    with pytest.raises(ConfigError, match="is empty"):
        candles_in_span(hour, T0, T0, source="x.csv")


def test_a_span_shorter_than_a_candle_holds_none(hour: list[Candle]) -> None:
    with pytest.raises(ConfigError, match="holds no whole 5m candle"):
        candles_in_span(hour, T0 + timedelta(minutes=1), T0 + timedelta(minutes=4),
                        source="x.csv")


# -- the cache -----------------------------------------------------------------------------

def test_the_cache_lives_under_xdg_cache_home_or_home(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_data_dir() == tmp_path / "xdg" / "trading-agent" / "candles"

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_data_dir() == tmp_path / "home" / ".cache" / "trading-agent" / "candles"


def test_cache_file_names_are_safe(tmp_path: Path) -> None:
    assert cached_candles_path(tmp_path, "binance", "BTC/USDT", "5m") == \
        tmp_path / "binance" / "BTC_USDT-5m.csv"
    assert cached_candles_path(tmp_path, "binanceusdm", "BTC/USDT:USDT", "1h") == \
        tmp_path / "binanceusdm" / "BTC_USDT_USDT-1h.csv"


def test_a_written_cache_file_reads_back_in_both_loaders(tmp_path: Path) -> None:
    candles = load(write(tmp_path, "date,open,high,low,close,volume",
                         "2023-01-03 10:00,16727.3,16728.8,16726.0,16726.1,0.00000001",
                         "2023-01-03 10:05,16726.0,16726.8,16705.0,16707.5,1301.173"))
    path = cached_candles_path(tmp_path / "cache", "binance", "BTC/USDT", "5m")

    write_history_csv(path, candles)

    assert path.read_text().splitlines()[:2] == [
        HEADER, "1672740000000,16727.3,16728.8,16726.0,16726.1,0.00000001"]
    assert load(path) == candles
    assert load_candles_csv(path, "BTC/USDT") == candles
    assert [p.name for p in path.parent.iterdir()] == ["BTC_USDT-5m.csv"]
