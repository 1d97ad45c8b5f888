"""``trading-agent data fetch``: an exchange's candles, paged through ccxt into the local cache.

:func:`fetch_history` pages through ccxt's ``fetch_ohlcv`` from the start of a span to its
end (or to the newest candle that has closed), spaced by ccxt's own rate limiter, and merges
what it gets into the cache file of that exchange, symbol and timeframe
(:func:`~trading_agent.backtest.candles.cached_candles_path`). What the file already holds is
not asked for again. The file stays one run of candles with no gap, so a backtest can load it
with :func:`~trading_agent.backtest.candles.load_history_csv`: a hole in the exchange's data
is reported, never written. The file is replaced atomically, so a failed fetch leaves the
previous file (or none) as it was.

Errors are the project's own: :class:`~trading_agent.errors.ConfigError` for what the user
asked (unknown exchange, symbol or timeframe, an empty span),
:class:`~trading_agent.errors.ExchangeError` and its subclasses for what the exchange did
(unreachable after retries, a refusal, a hole in its data).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import anyio
import anyio.to_thread

from trading_agent.backtest.candles import (
    cached_candles_path,
    default_data_dir,
    format_time,
    load_history_csv,
    write_history_csv,
)
from trading_agent.errors import ConfigError, ExchangeError
from trading_agent.trading.config import CcxtExchangeConfig
from trading_agent.trading.exchange import Candle, timeframe_delta
from trading_agent.trading.timing import utc_now

if TYPE_CHECKING:  # ccxt takes a second to import: only `data fetch` needs it
    from trading_agent.trading.ccxt_exchange import CcxtExchange

__all__ = ["FetchResult", "add_data_subcommand", "fetch_history", "parse_time"]

_EXIT_CONFIG = 2
"""``trading_agent.cli.EXIT_CONFIG``, not imported: the CLI imports this module."""
_EXIT_FAILURE = 1
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_DEFAULT_PAGE = 500
"""Candles asked for per request when ccxt does not say what the exchange allows."""

Progress = Callable[[int, datetime], None]
"""Told after each page: the candles fetched so far, and the close of the newest one."""


@dataclass(frozen=True)
class FetchResult:
    """What a fetch left in the cache.

    Attributes:
        path: The cache file.
        written: How many candles the file holds.
        fetched: How many of them this fetch asked the exchange for.
        first_open: The open time of the file's first candle.
        last_open: The open time of its last candle.
    """

    path: Path
    written: int
    fetched: int
    first_open: datetime
    last_open: datetime


def _aware(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _floor(moment: datetime, step: timedelta) -> datetime:
    return moment - (moment - _EPOCH) % step


def _ceil(moment: datetime, step: timedelta) -> datetime:
    floored = _floor(moment, step)
    return floored if floored == moment else floored + step


async def fetch_history(
    config: CcxtExchangeConfig,
    symbol: str,
    timeframe: str,
    start: datetime,
    end: datetime,
    *,
    data_dir: Path,
    on_progress: Progress | None = None,
    now: Callable[[], datetime] = utc_now,
) -> FetchResult:
    """Fetches the candles of a span into the cache, asking only for what it lacks.

    The span is every candle opening at or after ``start`` and closing at or before ``end``
    and before ``now()`` (the candle still forming is never kept). When the cache already
    holds candles of that exchange, symbol and timeframe, only those before and after them
    are asked for (and any between them and the span, so the file has no gap).

    Args:
        config: The exchange (its id, options, ``api_urls``, timeouts, rate limiting).
        symbol: The unified symbol (``BTC/USDT``).
        timeframe: The candles' timeframe (``5m``).
        start: The span's start (UTC when naive).
        end: The span's end (UTC when naive).
        data_dir: The cache's folder (:func:`~.candles.default_data_dir` for the default).
        on_progress: Told after each page how many candles were fetched, up to when.
        now: The clock that says which candles have closed.

    Returns:
        Where the candles are and how many.

    Raises:
        ConfigError: Unknown exchange id, symbol or timeframe; ``start`` not before ``end``;
            no whole candle of the span has closed; the cache file is unreadable or corrupt.
        ExchangeUnavailableError: The exchange could not be reached, after retries.
        ExchangeError: The exchange refused, or its candles have a hole in the span.
    """
    try:
        step = timeframe_delta(timeframe)
    except ValueError as exc:
        raise ConfigError(f"timeframe: {exc}") from exc
    start, end = _aware(start), _aware(end)
    if start >= end:
        raise ConfigError(f"the span {format_time(start)} to {format_time(end)} UTC is empty; "
                          "expected --from before --to")
    path = cached_candles_path(data_dir, _cache_name(config), symbol, timeframe)
    cached = await anyio.to_thread.run_sync(_load_cache, path, symbol, timeframe)
    first = _ceil(start, step)
    if cached and cached[0].opened_at <= first and _floor(end, step) <= cached[-1].closes_at:
        # Everything asked for is at hand: no need to reach the exchange at all.
        return _result(path, cached, 0)
    from trading_agent.trading.ccxt_exchange import CcxtExchange

    exchange = await CcxtExchange.open(config, clock=now)
    try:
        page = await _check_offer(exchange, symbol, timeframe)
        moment = _aware(now())
        stop = _floor(min(end, moment), step)
        if stop <= first:
            raise ConfigError(
                f"no whole {timeframe} candle of {symbol} between {format_time(start)} and "
                f"{format_time(end)} UTC has closed (now is {format_time(moment)} UTC); "
                f"expected a span of one {timeframe} candle or more, in the past")
        pager = _Pager(exchange, symbol, timeframe, step, page, on_progress)
        before: list[Candle] = []
        after: list[Candle] = []
        if not cached:
            after = await pager.fetch(first, stop, must_start=False)
        else:
            if first < cached[0].opened_at:
                before = await pager.fetch(first, cached[0].opened_at, must_start=False)
                if before and before[-1].closes_at != cached[0].opened_at:
                    raise _hole(exchange.name, symbol, timeframe, before[-1].opened_at,
                                cached[0].opened_at)
            if stop > cached[-1].closes_at:
                after = await pager.fetch(cached[-1].closes_at, stop, must_start=True)
    finally:
        await exchange.close()
    candles = [*before, *cached, *after]
    if not candles:
        raise ExchangeError(
            f"{exchange.name} has no {timeframe} candles of {symbol} between "
            f"{format_time(start)} and {format_time(end)} UTC; nothing was written")
    if before or after:
        await anyio.to_thread.run_sync(write_history_csv, path, candles)
    return _result(path, candles, len(before) + len(after))


def _cache_name(config: CcxtExchangeConfig) -> str:
    # A testnet's candles are not the exchange's: they get a folder of their own.
    return config.exchange_id + ("-testnet" if config.sandbox else "")


def _load_cache(path: Path, symbol: str, timeframe: str) -> list[Candle]:
    if not path.exists():
        return []
    try:
        return load_history_csv(path, symbol, timeframe)
    except ConfigError as exc:
        raise ConfigError(f"the cached candles are unusable ({exc}); delete {path} to fetch "
                          "them again") from exc


def _result(path: Path, candles: Sequence[Candle], fetched: int) -> FetchResult:
    return FetchResult(path, len(candles), fetched, candles[0].opened_at, candles[-1].opened_at)


def _hole(exchange: str, symbol: str, timeframe: str, last_open: datetime,
          next_open: datetime) -> ExchangeError:
    """The error for candles missing between two the exchange has (opens, in order)."""
    step = timeframe_delta(timeframe)
    missing = (next_open - last_open) // step - 1
    return ExchangeError(
        f"{exchange} has a hole in its {timeframe} candles of {symbol}: {missing} missing "
        f"between {format_time(last_open)} and {format_time(next_open)} UTC. A backtest "
        "needs candles without gaps, so nothing was written; expected a span on one side of "
        f"the hole (--to {format_time(last_open + step)} or --from {format_time(next_open)}),"
        " in a data folder of its own if the cache already holds the other side")


async def _check_offer(exchange: CcxtExchange, symbol: str, timeframe: str) -> int:
    """Refuses an unknown symbol or timeframe; returns how many candles to ask per page."""
    markets = await exchange.markets()
    if symbol not in markets:
        raise ConfigError(_unknown_symbol(exchange.name, symbol, list(markets)))
    offered, limit = exchange.candle_offer(symbol)
    if not offered:
        raise ConfigError(f"{exchange.name} serves no candles through ccxt (no fetchOHLCV)")
    if timeframe not in offered:
        raise ConfigError(f"{exchange.name} does not offer {timeframe} candles; it offers "
                          f"{', '.join(offered)}")
    return limit or _DEFAULT_PAGE


def _unknown_symbol(exchange: str, symbol: str, known: Sequence[str]) -> str:
    by_upper = {name.upper(): name for name in known}
    close = [by_upper[name] for name in
             difflib.get_close_matches(symbol.upper(), list(by_upper), n=5, cutoff=0.6)]
    hint = (f"close matches: {', '.join(close)}" if close
            else f"it has {len(known)} markets, such as {', '.join(sorted(known)[:5])}")
    return f"{exchange} has no market {symbol!r}; {hint} (symbols are written like BTC/USDT)"


class _Pager:
    """Pages through one exchange's candles of one symbol and timeframe."""

    def __init__(self, exchange: CcxtExchange, symbol: str, timeframe: str, step: timedelta,
                 page: int, on_progress: Progress | None) -> None:
        self._exchange = exchange
        self._symbol = symbol
        self._timeframe = timeframe
        self._step = step
        self._page = page
        self._on_progress = on_progress
        self.fetched = 0

    async def fetch(self, begin: datetime, stop: datetime, *, must_start: bool) -> list[Candle]:
        """The candles opening in ``[begin, stop)``, checked contiguous.

        Args:
            begin: The first open time wanted.
            stop: The open time after the last wanted.
            must_start: Whether the first candle must open at ``begin`` (it continues
                candles already held); otherwise the exchange's data may start later
                (a market listed after ``begin``).

        Raises:
            ExchangeError: A hole in the exchange's candles, or the exchange failed.
        """
        candles: list[Candle] = []
        since = begin
        while since < stop:
            page = await self._exchange.fetch_candles(self._symbol, self._timeframe,
                                                      limit=self._page, since=since)
            fresh = [c for c in page if since <= c.opened_at < stop]
            if not fresh:
                break  # the exchange has nothing newer: the data ends here
            expected = since if (candles or must_start) else fresh[0].opened_at
            for candle in fresh:
                if candle.opened_at != expected:
                    raise _hole(self._exchange.name, self._symbol, self._timeframe,
                                expected - self._step, candle.opened_at)
                expected += self._step
            candles.extend(fresh)
            since = expected
            self.fetched += len(fresh)
            if self._on_progress is not None:
                self._on_progress(self.fetched, since)
        return candles


# -- the command line ------------------------------------------------------------------------


def parse_time(text: str, option: str) -> datetime:
    """A command-line time: ``2023-01-05`` or ``2023-01-05T12:00`` (UTC unless an offset is
    given).

    Args:
        text: What the user wrote.
        option: The option, for the message (``--from``).

    Returns:
        An aware UTC datetime.

    Raises:
        ConfigError: Not an ISO 8601 date or time.
    """
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(f"{option}: {text!r} is not a date; expected ISO 8601 like "
                          "2023-01-05 or 2023-01-05T12:00 (UTC unless an offset is given)") \
            from None
    return _aware(moment)


def add_data_subcommand(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``data fetch EXCHANGE SYMBOL TIMEFRAME --from ISO --to ISO [--data-dir DIR]
    [--config FILE]`` to the ``trading-agent`` command.

    Its handler (``args.handler(args)``) returns the exit code: 0 when the candles are in the
    cache, 2 for a bad argument or config, 1 when the exchange failed.

    Args:
        subparsers: The ``trading-agent`` parser's subcommands.
    """
    data = subparsers.add_parser(
        "data", help="historical candles for backtests",
        description="Historical candles for backtests, kept in a local cache.")
    actions = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    fetch = actions.add_parser(
        "fetch", help="fetch an exchange's candles into the local cache",
        description="Pages through an exchange's candles (ccxt's fetch_ohlcv, within its rate "
                    "limit) into the local cache, asking only for what the cache lacks. "
                    "Backtests read the file it names.")
    fetch.add_argument("exchange", metavar="EXCHANGE", help="a ccxt exchange id (binance)")
    fetch.add_argument("symbol", metavar="SYMBOL", help="a unified symbol (BTC/USDT)")
    fetch.add_argument("timeframe", metavar="TIMEFRAME", help="a timeframe (5m, 1h, 1d)")
    fetch.add_argument("--from", dest="start", required=True, metavar="ISO",
                       help="the first candle's open (2023-01-05 or 2023-01-05T12:00, UTC)")
    fetch.add_argument("--to", dest="end", required=True, metavar="ISO",
                       help="the last candle's close at the latest (UTC)")
    fetch.add_argument("--data-dir", type=Path, metavar="DIR",
                       help=f"the cache folder (default {default_data_dir()})")
    fetch.add_argument("--config", type=Path, metavar="FILE",
                       help="a trading-agent config whose [exchange.ccxt] section gives the "
                            "ccxt options, api_urls and timeouts (its exchange_id is replaced "
                            "by EXCHANGE)")
    fetch.set_defaults(handler=_fetch_command)


def _exchange_config(exchange_id: str, config_file: Path | None) -> CcxtExchangeConfig:
    if config_file is None:
        return CcxtExchangeConfig(exchange_id=exchange_id)
    # Imported here: the settings pull in every desk's schema, needed only with --config.
    from trading_agent.settings import load_settings

    section = load_settings(config_file).exchange.ccxt or CcxtExchangeConfig()
    return section.model_copy(update={"exchange_id": exchange_id})


class _ProgressLine:
    """Progress on stderr: one line rewritten in place on a terminal, a line a page if not."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._in_place = stream.isatty()
        self._open_line = False

    def __call__(self, fetched: int, up_to: datetime) -> None:
        text = f"fetched {fetched:,} candles, up to {format_time(up_to)} UTC"
        self._stream.write(f"\r{text}" if self._in_place else f"{text}\n")
        self._stream.flush()
        self._open_line = self._in_place

    def done(self) -> None:
        """Ends the line rewritten in place, so what follows starts on its own."""
        if self._open_line:
            self._stream.write("\n")
            self._open_line = False


def _fetch_command(args: argparse.Namespace) -> int:
    prefix = "trading-agent data fetch"
    progress = _ProgressLine(sys.stderr)
    try:
        start, end = parse_time(args.start, "--from"), parse_time(args.end, "--to")
        if start >= end:
            raise ConfigError(f"--from {format_time(start)} is not before --to "
                              f"{format_time(end)}; expected --from before --to")
        config = _exchange_config(args.exchange, args.config)
        data_dir = args.data_dir or default_data_dir()
        result = anyio.run(_fetch, config, args.symbol, args.timeframe, start, end, data_dir,
                           progress, backend="asyncio")
    except ConfigError as exc:
        progress.done()
        print(f"{prefix}: {exc}", file=sys.stderr)
        return _EXIT_CONFIG
    except ExchangeError as exc:
        progress.done()
        print(f"{prefix}: {exc}", file=sys.stderr)
        return _EXIT_FAILURE
    progress.done()
    print(f"{result.path}: {result.written:,} {args.timeframe} candles of {args.symbol} "
          f"opening {format_time(result.first_open)} to {format_time(result.last_open)} UTC "
          f"({result.fetched:,} fetched now)")
    return 0


async def _fetch(config: CcxtExchangeConfig, symbol: str, timeframe: str, start: datetime,
                 end: datetime, data_dir: Path, progress: Progress) -> FetchResult:
    return await fetch_history(config, symbol, timeframe, start, end, data_dir=data_dir,
                               on_progress=progress)
