"""Historical candles for backtests: any OHLCV CSV file, checked line by line, and the cache.

A backtest refuses data it cannot trust. :func:`load_history_csv` reads a CSV file a user
names (or the packaged one, or one ``trading-agent data fetch`` wrote) and checks every line:
numbers, high and low against open and close, volume, time order, duplicates, gaps and
alignment to the timeframe. Each problem is a :class:`~trading_agent.errors.ConfigError`
whose message starts with ``FILE:LINE:`` and says what was found and what is expected.

:func:`candles_in_span` cuts the candles a backtest runs over (plus the warm-up its desk sees
before the first decision) and refuses a span the data does not cover.

Candles fetched from an exchange are kept under :func:`default_data_dir`, one file per
exchange, symbol and timeframe (:func:`cached_candles_path`), in the replay's own format
(``timestamp_ms,open,high,low,close,volume``) so the daemon's replay reads them too;
:func:`write_history_csv` writes one atomically.
"""

from __future__ import annotations

import bisect
import contextlib
import csv
import os
import re
import tempfile
from collections.abc import Generator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path

from trading_agent.backtest.files import private_folder
from trading_agent.errors import ConfigError
from trading_agent.trading.exchange import Candle, timeframe_delta

__all__ = [
    "TIME_COLUMNS",
    "cached_candles_path",
    "candles_in_span",
    "default_data_dir",
    "format_time",
    "load_history_csv",
    "write_history_csv",
]

TIME_COLUMNS = ("timestamp_ms", "timestamp", "time", "date", "datetime", "open_time", "ts")
"""The names a CSV file's time column may have (any case), the first one present winning."""

_PRICE_COLUMNS = ("open", "high", "low", "close")
_VALUE_COLUMNS = (*_PRICE_COLUMNS, "volume")
_CACHE_HEADER = ("timestamp_ms", *_VALUE_COLUMNS)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)
# Below this, an integer time is seconds since the epoch (1e11 s is the year 5138); from it
# on, milliseconds (1e11 ms is March 1973, before any market data a backtest would use).
_SECONDS_BELOW = 10**11
# Milliseconds from this on are past the year 5138: a time in microseconds or a wrong column.
_MILLIS_BELOW = 10**14
# Weekly candles open on Mondays (ccxt, Binance); the epoch was a Thursday.
_WEEK_OFFSET_MS = 4 * 86_400_000
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


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


def _rows(path: Path) -> Generator[tuple[int, list[str]], None, None]:
    """The file's rows with the line each starts on; blank lines skipped."""
    # utf-8-sig: spreadsheets save CSV with a byte order mark before the header.
    with path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle)
        line = 1
        for row in reader:
            if row and any(field.strip() for field in row):
                yield line, row
            line = reader.line_num + 1


def load_history_csv(path: Path, symbol: str, timeframe: str = "5m") -> list[Candle]:
    """Reads and checks one symbol's candles from any OHLCV CSV file.

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
    step = _timeframe_step(timeframe, f"{path}: the timeframe")
    step_ms = step // _MS
    offset_ms = _WEEK_OFFSET_MS if step_ms % (7 * 86_400_000) == 0 else 0
    candles: list[Candle] = []
    lines: dict[int, int] = {}
    # A gap is reported only once the whole file is read: a line out of order further on
    # makes a gap before it, and is the clearer message.
    first_gap: str | None = None
    try:
        with contextlib.closing(_rows(path)) as rows:
            first = next(rows, None)
            if first is None:
                raise ConfigError(
                    f"{path}:1: the file is empty; expected a header such as "
                    f"{','.join(_CACHE_HEADER)} and one line per {timeframe} candle")
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
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the candles of {symbol}: "
                          f"{exc.strerror or exc}") from exc
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


# -- spans ---------------------------------------------------------------------------------


def _aware(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def candles_in_span(candles: Sequence[Candle], start: datetime, end: datetime, *, source: str,
                    warmup: int = 0) -> tuple[list[Candle], int]:
    """The candles a backtest runs over: ``warmup`` before ``start``, then the span itself.

    The span is every candle opening at or after ``start`` and closing at or before ``end``.

    Args:
        candles: One symbol's candles, oldest first, one timeframe (as loaded).
        start: The start of the span (UTC when naive).
        end: The end of the span (UTC when naive).
        source: Where the candles come from (a file), for messages.
        warmup: How many candles before the first of the span the desk must see.

    Returns:
        The candles from ``warmup`` before the span through its last, and the index of the
        span's first candle in them (``warmup``).

    Raises:
        ConfigError: ``start`` is not before ``end``, the data does not cover the span, or
            it has fewer than ``warmup`` candles before it; the message names the symbol,
            the source, the data's first open and last close, and the span asked for.
    """
    start, end = _aware(start), _aware(end)
    asked = f"{format_time(start)} to {format_time(end)} UTC"
    if start >= end:
        raise ConfigError(f"the span {asked} is empty; expected a start before its end")
    if warmup < 0:
        raise ConfigError(f"the warm-up is {warmup} candles; expected 0 or more")
    if not candles:
        raise ConfigError(f"{source} has no candles for the span {asked}")
    first, last = candles[0], candles[-1]
    held = (f"{first.symbol} in {source} covers {format_time(first.opened_at)} to "
            f"{format_time(last.closes_at)} UTC ({first.timeframe} candles)")
    if start < first.opened_at or end > last.closes_at:
        raise ConfigError(f"{held}; the span asked for, {asked}, is outside it; expected a "
                          "span within the data (fetch more with `trading-agent data fetch`)")
    begin = bisect.bisect_left(candles, start, key=lambda candle: candle.opened_at)
    step = timeframe_delta(first.timeframe)
    stop = bisect.bisect_right(candles, end - step, key=lambda candle: candle.opened_at)
    if begin >= stop:
        raise ConfigError(f"{held}; the span asked for, {asked}, holds no whole "
                          f"{first.timeframe} candle; expected a span of one candle or more")
    if begin < warmup:
        raise ConfigError(
            f"{held}; the span asked for, {asked}, needs {warmup} candles of warm-up before "
            f"{format_time(candles[begin].opened_at)} UTC but the data has {begin}; expected "
            f"a start at {format_time(candles[warmup].opened_at)} UTC or later, or more data")
    return list(candles[begin - warmup:stop]), warmup


# -- the cache -----------------------------------------------------------------------------


def default_data_dir() -> Path:
    """Where fetched candles are kept: ``$XDG_CACHE_HOME/trading-agent/candles``, else
    ``~/.cache/trading-agent/candles``."""
    cache_home = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says a relative path there is invalid and must be ignored.
    base = Path(cache_home) if cache_home and Path(cache_home).is_absolute() \
        else Path.home() / ".cache"
    return base / "trading-agent" / "candles"


def _file_safe(text: str) -> str:
    return _UNSAFE.sub("_", text)


def cached_candles_path(data_dir: Path, exchange_id: str, symbol: str, timeframe: str) -> Path:
    """The cache file of one exchange's candles of one symbol and timeframe.

    Args:
        data_dir: The cache's folder (:func:`default_data_dir` by default).
        exchange_id: The ccxt exchange id (``binance``).
        symbol: The unified symbol (``BTC/USDT``, ``BTC/USDT:USDT``).
        timeframe: The timeframe (``5m``).

    Returns:
        ``DATA_DIR/EXCHANGE/SYMBOL-TIMEFRAME.csv``, with ``/``, ``:`` and anything else
        unsafe in a file name made ``_`` (``binance/BTC_USDT-5m.csv``).
    """
    return data_dir / _file_safe(exchange_id) / f"{_file_safe(symbol)}-{_file_safe(timeframe)}.csv"


def write_history_csv(path: Path, candles: Sequence[Candle]) -> None:
    """Writes candles in the replay's format, atomically: a reader sees the old file or the
    new one, never half of one.

    Args:
        path: The file; its folder is created if needed.
        candles: The candles, oldest first.

    Raises:
        ConfigError: The file could not be written (nothing is left behind).
    """
    try:
        private_folder(path.parent)
        handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed below, then renamed
            "w", encoding="utf-8", newline="", dir=path.parent, prefix=f".{path.name}.",
            suffix=".tmp", delete=False)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write the candles: {exc.strerror or exc}") from exc
    temporary = Path(handle.name)
    try:
        with handle:
            handle.write(",".join(_CACHE_HEADER) + "\n")
            handle.writelines(
                f"{(c.opened_at - _EPOCH) // _MS},{c.open:f},{c.high:f},{c.low:f},"
                f"{c.close:f},{c.volume:f}\n" for c in candles)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise ConfigError(f"{path}: cannot write the candles: {exc.strerror or exc}") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
