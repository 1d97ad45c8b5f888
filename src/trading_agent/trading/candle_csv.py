"""Candle files: the one reader of OHLCV CSV files, for the daemon's replay and backtests.

:func:`load_history_csv` reads a CSV file (the packaged candles, a replay's files, one a user
names for a backtest, one ``trading-agent data fetch`` wrote) and checks every line: numbers,
high and low against open and close, volume, time order, duplicates, gaps and alignment to
the timeframe. Each problem is a :class:`~trading_agent.errors.ConfigError` whose message
starts with ``FILE:LINE:`` and says what was found and what is expected.

Bytes read and checked once are not checked again: the daemon's desks, a reload and each job
of a backtest share the packaged candles, which take ~85 ms to parse and check and ~1 ms to
read and hash. The memo is keyed by the bytes' BLAKE2 digest (never by a file's name or time,
which a rewrite within a clock tick would leave equal) and keeps at most
:data:`MEMO_CANDLES` candles, the least recently read going first; the candles are frozen and
shared with whoever read them, so candles a feed holds cost the memo only its references.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import threading
from collections import OrderedDict
from collections.abc import Generator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path

from trading_agent.errors import ConfigError
from trading_agent.trading.exchange import Candle, timeframe_delta

__all__ = ["CACHE_HEADER", "TIME_COLUMNS", "format_time", "load_history_csv"]

TIME_COLUMNS = ("timestamp_ms", "timestamp", "time", "date", "datetime", "open_time", "ts")
"""The names a CSV file's time column may have (any case), the first one present winning."""

_PRICE_COLUMNS = ("open", "high", "low", "close")
_VALUE_COLUMNS = (*_PRICE_COLUMNS, "volume")
CACHE_HEADER = ("timestamp_ms", *_VALUE_COLUMNS)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)
# Below this, an integer time is seconds since the epoch (1e11 s is the year 5138); from it
# on, milliseconds (1e11 ms is March 1973, before any market data a backtest would use).
_SECONDS_BELOW = 10**11
# Milliseconds from this on are past the year 5138: a time in microseconds or a wrong column.
_MILLIS_BELOW = 10**14
# Weekly candles open on Mondays (ccxt, Binance); the epoch was a Thursday.
_WEEK_OFFSET_MS = 4 * 86_400_000

MEMO_CANDLES = 500_000
"""The most candles the memo of files read keeps (about 40 days of 5-minute candles of a
dozen symbols)."""

_MemoKey = tuple[bytes, str, str]
_memo: OrderedDict[_MemoKey, tuple[Candle, ...]] = OrderedDict()
_memo_lock = threading.Lock()  # files are read in worker threads too

def format_time(moment: datetime) -> str:
    """A time as messages show it: ``2023-01-03 10:00`` (seconds only when not zero), UTC."""
    moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S" if moment.second else "%Y-%m-%d %H:%M")


def _timeframe_step(timeframe: str, where: str) -> timedelta:
    try:
        return timeframe_delta(timeframe)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


# -- reading -------------------------------------------------------------------------------


class _Columns:
    """Where each needed column is in a file's rows."""

    def __init__(self, path: Path, header: Sequence[str]) -> None:
        names = [name.strip().lower() for name in header]
        positions: dict[str, int] = {}
        for index, name in enumerate(names):
            if name in positions and name in (*TIME_COLUMNS, *_VALUE_COLUMNS):
                raise ConfigError(f"{path}:1: the column {name!r} appears twice in the header")
            positions.setdefault(name, index)
        time_name = next((name for name in TIME_COLUMNS if name in positions), None)
        missing = [name for name in _VALUE_COLUMNS if name not in positions]
        if time_name is None or missing:
            wanted = (["a time column"] if time_name is None else []) + missing
            found = ", ".join(repr(name) for name in header) or "nothing"
            raise ConfigError(
                f"{path}:1: the header lacks {', '.join(wanted)}; found {found}; expected a "
                f"time column ({', '.join(TIME_COLUMNS)}) and open, high, low, close, volume "
                "(any case, in any order, other columns ignored)")
        self.time_name = time_name
        self.time = positions[time_name]
        self.values = tuple(positions[name] for name in _VALUE_COLUMNS)
        self.count = len(header)


def _parse_time_ms(path: Path, line: int, column: str, text: str) -> int:
    """Milliseconds since the epoch of a time field: integer s or ms, or ISO 8601."""
    value = text.strip()
    try:
        number = int(value)
    except ValueError:
        number = None
        try:
            as_float = float(value)
        except ValueError:
            pass
        else:
            # Spreadsheets and pandas write integer times as 1672677900000.0.
            if as_float.is_integer():
                number = int(as_float)
    if number is not None:
        if abs(number) < _SECONDS_BELOW:
            return number * 1000
        if abs(number) < _MILLIS_BELOW:
            return number
        raise ConfigError(
            f"{path}:{line}: column {column}: {text!r} is too large for milliseconds since "
            "the epoch; expected seconds or milliseconds since 1970-01-01 UTC, or ISO 8601")
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(
            f"{path}:{line}: column {column}: {text!r} is not a time; expected milliseconds "
            "or seconds since the epoch, or ISO 8601 like 2023-01-03T10:00:00Z (UTC when no "
            "offset is given)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - _EPOCH) // _MS


def _parse_number(path: Path, line: int, column: str, text: str) -> Decimal:
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        value = None
    if value is None or not value.is_finite():
        raise ConfigError(f"{path}:{line}: column {column}: {text!r} is not a number; "
                          "expected a decimal number like 16727.3")
    return value


def _check_candle(path: Path, line: int, values: Sequence[Decimal]) -> None:
    open_, high, low, close, volume = values
    for name, price in zip(_PRICE_COLUMNS, values, strict=False):
        if price <= 0:
            raise ConfigError(f"{path}:{line}: column {name}: {price} is not a price; "
                              "expected a number above 0")
    if high < max(open_, close) or low > min(open_, close):
        raise ConfigError(
            f"{path}:{line}: inconsistent candle: open {open_}, high {high}, low {low}, close "
            f"{close}; expected low <= open, close <= high")
    if volume < 0:
        raise ConfigError(f"{path}:{line}: column volume: {volume} is negative; "
                          "expected 0 or more")


def _rows(data: bytes) -> Generator[tuple[int, list[str]], None, None]:
    """The file's rows with the line each starts on; blank lines skipped.

    Raises:
        UnicodeDecodeError: The bytes are not UTF-8 text.
    """
    # utf-8-sig: spreadsheets save CSV with a byte order mark before the header.
    reader = csv.reader(io.StringIO(data.decode("utf-8-sig"), newline=""))
    line = 1
    for row in reader:
        if row and any(field.strip() for field in row):
            yield line, row
        line = reader.line_num + 1


def load_history_csv(path: Path, symbol: str, timeframe: str = "5m") -> list[Candle]:
    """Reads and checks one symbol's candles from any OHLCV CSV file (once while it is
    unchanged: see the module's notes).

    The header is required. Columns are found by name, in any case and order: a time column
    (see :data:`TIME_COLUMNS`), then ``open``, ``high``, ``low``, ``close``, ``volume``;
    others are ignored. Times are candle open times, as integer milliseconds or seconds since
    the epoch (told apart by size) or ISO 8601 (UTC when naive). The candles must be in time
    order, one every ``timeframe``, with no gap, each opening on a multiple of the timeframe.

    Args:
        path: The CSV file.
        symbol: The market the candles belong to (``BTC/USDT``).
        timeframe: Their timeframe (``5m``, ``1h``, ``1d``...).

    Returns:
        The candles, oldest first.

    Raises:
        ConfigError: The file cannot be read, or its first problem, as ``FILE:LINE: what is
            wrong; what is expected``.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the candles of {symbol}: "
                          f"{exc.strerror or exc}") from exc
    key = (hashlib.blake2b(data, digest_size=32).digest(), symbol, timeframe)
    with _memo_lock:
        known = _memo.get(key)
        if known is not None:
            _memo.move_to_end(key)
            return list(known)
    candles = _parse_candles(path, data, symbol, timeframe)
    if len(candles) <= MEMO_CANDLES:
        with _memo_lock:
            _memo[key] = tuple(candles)
            kept = sum(len(each) for each in _memo.values())
            while kept > MEMO_CANDLES:
                kept -= len(_memo.popitem(last=False)[1])
    return candles


def _parse_candles(path: Path, data: bytes, symbol: str, timeframe: str) -> list[Candle]:
    step = _timeframe_step(timeframe, f"{path}: the timeframe")
    step_ms = step // _MS
    offset_ms = _WEEK_OFFSET_MS if step_ms % (7 * 86_400_000) == 0 else 0
    candles: list[Candle] = []
    lines: dict[int, int] = {}
    # A gap is reported only once the whole file is read: a line out of order further on
    # makes a gap before it, and is the clearer message.
    first_gap: str | None = None
    try:
        with contextlib.closing(_rows(data)) as rows:
            first = next(rows, None)
            if first is None:
                raise ConfigError(
                    f"{path}:1: the file is empty; expected a header such as "
                    f"{','.join(CACHE_HEADER)} and one line per {timeframe} candle")
            columns = _Columns(path, first[1])
            previous_ms: int | None = None
            previous_line = 0
            for line, row in rows:
                if len(row) != columns.count:
                    raise ConfigError(f"{path}:{line}: {len(row)} fields; expected "
                                      f"{columns.count} like the header")
                opened_ms = _parse_time_ms(path, line, columns.time_name, row[columns.time])
                values = [_parse_number(path, line, name, row[index])
                          for name, index in zip(_VALUE_COLUMNS, columns.values, strict=True)]
                _check_candle(path, line, values)
                gap = _check_time(path, line, opened_ms, previous_ms, previous_line, lines,
                                  step_ms, offset_ms, timeframe)
                first_gap = first_gap or gap
                lines[opened_ms] = line
                previous_ms, previous_line = opened_ms, line
                candles.append(Candle(symbol, timeframe, _EPOCH + opened_ms * _MS, *values))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text CSV file ({exc.reason} at byte {exc.start}); "
                          "expected UTF-8 text") from exc
    if first_gap is not None:
        raise ConfigError(first_gap)
    if not candles:
        raise ConfigError(f"{path}:2: no candles after the header; expected one line per "
                          f"{timeframe} candle")
    return candles


def _ms_text(milliseconds: int) -> str:
    return format_time(_EPOCH + milliseconds * _MS)


def _check_time(path: Path, line: int, opened_ms: int, previous_ms: int | None,
                previous_line: int, lines: Mapping[int, int], step_ms: int, offset_ms: int,
                timeframe: str) -> str | None:
    """Raises on a duplicate, unaligned or unordered time; returns a gap's message."""
    where = f"{path}:{line}:"
    if opened_ms in lines:
        raise ConfigError(f"{where} duplicate timestamp {_ms_text(opened_ms)} UTC, already on "
                          f"line {lines[opened_ms]}; expected one candle per time")
    if (opened_ms - offset_ms) % step_ms:
        on = "Mondays 00:00 UTC" if offset_ms else f"multiples of {timeframe} since the epoch"
        raise ConfigError(f"{where} {_ms_text(opened_ms)} UTC is not aligned to the "
                          f"{timeframe} timeframe; expected candle open times on {on}")
    if previous_ms is None:
        return None
    if opened_ms < previous_ms:
        raise ConfigError(
            f"{where} unordered timestamp: {_ms_text(opened_ms)} UTC is earlier than "
            f"{_ms_text(previous_ms)} UTC on line {previous_line}; expected candles in time "
            "order, oldest first")
    missing = (opened_ms - previous_ms) // step_ms - 1
    if missing:
        return (
            f"{where} a gap: {missing} candle{'s' if missing > 1 else ''} of {timeframe} "
            f"missing between {_ms_text(previous_ms)} and {_ms_text(opened_ms)} UTC; "
            f"expected one candle every {timeframe}")
    return None
