"""Historical candles for backtests: any OHLCV CSV file, checked line by line, and the cache.

A backtest refuses data it cannot trust. :func:`load_history_csv` (the one reader of candle
files, :mod:`trading_agent.trading.candle_csv`, which the daemon's replay uses too) reads a
CSV file a user names (or the packaged one, or one ``trading-agent data fetch`` wrote) and
checks every line: numbers, high and low against open and close, volume, time order,
duplicates, gaps and alignment to the timeframe. Each problem is a
:class:`~trading_agent.errors.ConfigError` whose message starts with ``FILE:LINE:`` and
says what was found and what is expected.

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
import os
import re
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from trading_agent.backtest.files import private_folder
from trading_agent.errors import ConfigError
from trading_agent.trading.candle_csv import (
    CACHE_HEADER,
    TIME_COLUMNS,
    format_time,
    load_history_csv,
)
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

_CACHE_HEADER = CACHE_HEADER
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


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
