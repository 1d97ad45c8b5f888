"""The figures of a backtest: pure functions of its :class:`~.record.BacktestRecord`.

Nothing here runs the desk, reads a clock or touches a file; the same record always gives
the same figures, so a re-run from the response cache gives an identical ``report.json``.

Definitions (the README quotes them):

- ``total_return``: final equity / starting equity − 1 (0.05 is +5%).
- ``buy_and_hold_return``: the starting equity split equally over the symbols, bought at the
  open of each symbol's first candle of the span and held to its last close, no fees: the
  mean over symbols of (last close / first open − 1). The buy-and-hold curve is starting
  equity × the mean over symbols of (close at t / first open).
- ``max_drawdown``: the largest fall from a running peak of equity (the starting equity is
  the first peak), as a positive fraction of that peak (0.12 is a 12% fall).
- ``sharpe``: the per-candle simple returns of equity (the first from the starting equity to
  the first point), their mean / their sample standard deviation (ddof=1) × √(candles per
  year), candles per year = 365 days / timeframe (105,120 for 5m, 8,760 for 1h). No
  risk-free rate. None when undefined: fewer than two returns or no deviation.
- ``sortino``: mean return / downside deviation × √(candles per year), the downside
  deviation being √(mean over all returns of min(r, 0)²). None when there is no negative
  return (or fewer than two returns).
- Trades are the round trips of the desk's books (:class:`~trading_agent.trading.books.
  RoundTrip`: a position opened and brought back to zero), the ledger the operator views
  read too. ``trades``: the closed round trips (before the books, this counted fills).
  ``open_trades``: those still open at the end. ``fills``: the fills of the books.
- ``win_rate``: closed round trips whose profit (fees of both sides subtracted) is above
  zero, over closed round trips; None when none closed.
- ``realized_profit``: the profit every round trip realized, every quote fee subtracted (an
  open one's: what its reductions realized so far less its fees; what it would make now is
  in the final equity, not here); the books' realized total. ``fees``: the quote-currency
  fees of the books' fills.
- ``exposure``: the mean over equity points of the share of equity held in positions.
- ``candles``: the number of equity points (steps); ``decisions``: the desk's turns;
  ``model_calls``, ``cache_hits``, ``input_tokens``, ``output_tokens``, ``cost``: from the
  run's model usage (tokens and cost count cached answers too: what the run would cost
  without the cache; ``cost`` None when no prices are configured).
- ``model_seconds``: wall-clock seconds spent waiting for the model (0 for cached answers);
  not in ``report.json``, which a re-run from the cache reproduces byte for byte, but in a
  many-window scorecard's cost per decision.
- ``masked``: whether the model read the run through the mask; ``notices``: what a reader
  must know first (a span before the model's knowledge cutoff), one sentence each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from trading_agent.backtest.record import BacktestRecord
from trading_agent.trading.exchange import Candle, timeframe_delta

__all__ = ["Figures", "buy_and_hold_curve", "candles_per_year", "compute_figures",
           "drawdown_curve", "iso_time"]

_YEAR = timedelta(days=365)


@dataclass(frozen=True)
class Figures:
    """The figures of one backtest (see the module docstring for each definition).

    Fractions are floats (0.05 is 5%); money is in ``quote_currency`` except ``cost``,
    which is at the model's configured prices.
    """

    desk: str
    model: str
    start: datetime
    end: datetime
    timeframe: str
    symbols: tuple[str, ...]
    quote_currency: str
    candles: int
    decisions: int
    model_calls: int
    cache_hits: int
    input_tokens: int
    output_tokens: int
    cost: float | None
    starting_equity: float
    final_equity: float
    total_return: float
    buy_and_hold_return: float
    max_drawdown: float
    sharpe: float | None
    sortino: float | None
    trades: int
    open_trades: int
    fills: int
    win_rate: float | None
    realized_profit: float
    fees: float
    exposure: float
    notices: tuple[str, ...] = ()
    masked: bool = False
    model_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The content of ``report.json``: plain JSON values, keys in a stable order.

        Returns:
            A dict with ``desk``, ``model``, ``from``, ``to`` (ISO 8601 UTC), ``timeframe``,
            ``symbols``, ``quote_currency``, the counts, the usage, then the figures.
        """
        return {
            "desk": self.desk,
            "model": self.model,
            "from": iso_time(self.start),
            "to": iso_time(self.end),
            "timeframe": self.timeframe,
            "symbols": list(self.symbols),
            "quote_currency": self.quote_currency,
            "candles": self.candles,
            "decisions": self.decisions,
            "model_calls": self.model_calls,
            "cache_hits": self.cache_hits,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost": self.cost,
            "starting_equity": self.starting_equity,
            "final_equity": self.final_equity,
            "total_return": self.total_return,
            "buy_and_hold_return": self.buy_and_hold_return,
            "max_drawdown": self.max_drawdown,
            "sharpe": self.sharpe,
            "sortino": self.sortino,
            "trades": self.trades,
            "open_trades": self.open_trades,
            "fills": self.fills,
            "win_rate": self.win_rate,
            "realized_profit": self.realized_profit,
            "fees": self.fees,
            "exposure": self.exposure,
            "masked": self.masked,
            "notices": list(self.notices),
        }


def iso_time(moment: datetime) -> str:
    """ISO 8601 in UTC (``2023-01-05T00:00:00+00:00``); a naive time is taken as UTC."""
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC).isoformat()
    return moment.astimezone(UTC).isoformat()


def candles_per_year(timeframe: str) -> float:
    """How many candles of ``timeframe`` fit in 365 days (105,120 for ``5m``).

    Args:
        timeframe: ``5m``, ``1h``, ``1d``...

    Returns:
        365 days divided by the timeframe.

    Raises:
        ValueError: The timeframe is not a count followed by m, h, d or w.
    """
    return _YEAR / timeframe_delta(timeframe)


def compute_figures(record: BacktestRecord) -> Figures:
    """Computes every figure of a run.

    Args:
        record: What the run produced.

    Returns:
        The figures.

    Raises:
        ValueError: The record has no equity point, a starting equity that is not positive,
            an unknown timeframe, or a symbol without candles.
    """
    _check(record)
    starting = record.starting_equity
    values = [float(point.equity) for point in record.equity]
    returns = _returns(float(starting), values)
    annualizer = math.sqrt(candles_per_year(record.timeframe))
    benchmark = buy_and_hold_curve(record)
    closed = [trade for trade in record.trades if not trade.is_open]
    return Figures(
        desk=record.desk,
        model=record.model,
        start=record.start,
        end=record.end,
        timeframe=record.timeframe,
        symbols=tuple(record.candles),
        quote_currency=record.quote_currency,
        candles=len(record.equity),
        decisions=len(record.decisions),
        model_calls=record.usage.model_calls,
        cache_hits=record.usage.cache_hits,
        input_tokens=record.usage.input_tokens,
        output_tokens=record.usage.output_tokens,
        cost=None if record.usage.cost is None else float(record.usage.cost),
        starting_equity=float(starting),
        final_equity=float(record.equity[-1].equity),
        total_return=float(record.equity[-1].equity / starting - 1),
        buy_and_hold_return=benchmark[-1] / float(starting) - 1,
        max_drawdown=max(0.0, -min(drawdown_curve([float(starting), *values]))),
        sharpe=_sharpe(returns, annualizer),
        sortino=_sortino(returns, annualizer),
        trades=len(closed),
        open_trades=len(record.trades) - len(closed),
        fills=len(record.fills),
        win_rate=sum(1 for trade in closed if trade.profit > 0) / len(closed) if closed
        else None,
        realized_profit=float(sum((trade.profit for trade in record.trades), Decimal(0))),
        fees=float(sum((trade.fees for trade in record.trades), Decimal(0))),
        exposure=math.fsum(float(point.exposure) for point in record.equity)
        / len(record.equity),
        notices=tuple(record.notices),
        model_seconds=record.usage.model_seconds,
        masked=record.masked,
    )


def buy_and_hold_curve(record: BacktestRecord) -> list[float]:
    """What buying every symbol at the start and holding would be worth at each equity point.

    The starting equity is split equally over the symbols, each bought at the open of its
    first candle of the span, no fees. At each equity point a symbol is valued at the close
    of its last candle closed by then (its first open before any has closed).

    Args:
        record: The run.

    Returns:
        One value per equity point, in the quote currency.

    Raises:
        ValueError: A symbol has no candles, or there are no symbols.
    """
    if not record.candles:
        raise ValueError(f"the backtest record of desk {record.desk!r} has no candles, so "
                         "there is no buy-and-hold to compare with")
    times = [point.at for point in record.equity]
    ratios = [0.0] * len(times)
    for symbol, candles in record.candles.items():
        if not candles:
            raise ValueError(f"the backtest record of desk {record.desk!r} has no candles of "
                             f"{symbol}")
        for index, price in enumerate(_closes_at(candles, times)):
            ratios[index] += price / float(candles[0].open)
    scale = float(record.starting_equity) / len(record.candles)
    return [scale * ratio for ratio in ratios]


def drawdown_curve(values: Sequence[float]) -> list[float]:
    """The fall of each value from the running peak before it, as a fraction of that peak.

    Args:
        values: A series of equity values; the first is the first peak.

    Returns:
        One value per input, 0 at a new peak and negative below one (-0.1 is 10% under the
        peak). Empty for an empty series.
    """
    result: list[float] = []
    peak = -math.inf
    for value in values:
        peak = max(peak, value)
        # A peak at or below zero has no meaningful fraction: the account is already gone.
        result.append(value / peak - 1 if peak > 0 else 0.0)
    return result


def _check(record: BacktestRecord) -> None:
    if not record.equity:
        raise ValueError(f"the backtest record of desk {record.desk!r} has no equity point "
                         f"(from {iso_time(record.start)} to {iso_time(record.end)}): a run "
                         "needs at least one candle close to have figures")
    if record.starting_equity <= 0:
        raise ValueError(f"the backtest record of desk {record.desk!r} starts with equity "
                         f"{record.starting_equity}; it must be positive")


def _closes_at(candles: Sequence[Candle], times: Sequence[datetime]) -> list[float]:
    """The close of the last candle closed at or before each time (both lists in order)."""
    prices: list[float] = []
    price = float(candles[0].open)
    position = 0
    for moment in times:
        while position < len(candles) and candles[position].closes_at <= moment:
            price = float(candles[position].close)
            position += 1
        prices.append(price)
    return prices


def _returns(starting: float, values: Sequence[float]) -> list[float]:
    result: list[float] = []
    previous = starting
    for value in values:
        result.append(value / previous - 1 if previous else 0.0)
        previous = value
    return result


def _sharpe(returns: Sequence[float], annualizer: float) -> float | None:
    if len(returns) < 2:
        return None
    mean = math.fsum(returns) / len(returns)
    variance = math.fsum((r - mean) ** 2 for r in returns) / (len(returns) - 1)
    deviation = math.sqrt(variance)
    # Identical returns leave only rounding noise in the deviation: that is no deviation.
    if deviation == 0 or deviation <= abs(mean) * 1e-9:
        return None
    return mean / deviation * annualizer


def _sortino(returns: Sequence[float], annualizer: float) -> float | None:
    if len(returns) < 2:
        return None
    downside = math.sqrt(math.fsum(min(r, 0.0) ** 2 for r in returns) / len(returns))
    if downside == 0:
        return None
    return math.fsum(returns) / len(returns) / downside * annualizer

