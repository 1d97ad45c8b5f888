"""A many-window run: the desk and its baselines over each window, one window a job.

:func:`run_window` runs one window to its :class:`~.scorecard.WindowResult`: the desk through
the engine (the response cache shared with every other window), then buy and hold, the
moving-average crossover and the random traders through the same paper exchange
(:mod:`.baselines`). It is a plain function of a picklable :class:`WindowJob`, so ``--jobs``
can hand windows to worker processes; the results do not depend on which process ran them.
"""

from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass, replace

import anyio

from trading_agent.backtest.baselines import (
    BuyAndHold,
    MovingAverageCrossover,
    Strategy,
    random_trader_for,
    run_baseline,
)
from trading_agent.backtest.engine import (
    BackendFactory,
    BacktestSpec,
    desk_settings,
    load_history,
    paper_exchange,
    run_backtest,
    scratch_folder,
)
from trading_agent.backtest.metrics import compute_figures
from trading_agent.backtest.record import BacktestRecord
from trading_agent.backtest.scorecard import WindowResult
from trading_agent.backtest.windows import Window

__all__ = ["WindowJob", "run_window", "window_result"]


@dataclass(frozen=True)
class WindowJob:
    """One window of one run.

    Attributes:
        spec: The run (its span is replaced by the window's).
        window: The window.
        random_traders: How many random traders (seeds) to run.
        seed: The random traders' first seed.
        backend: A model to use instead of the desk's own, by import path
            (``module:function``, a :data:`~.engine.BackendFactory`): a benchmark's
            in-process model, which a worker process imports by name.
    """

    spec: BacktestSpec
    window: Window
    random_traders: int = 20
    seed: int = 0
    backend: str | None = None


def run_window(job: WindowJob) -> WindowResult:
    """Runs one window (blocking: its own event loop; what a worker process calls)."""
    result: WindowResult = anyio.run(window_result, job, backend="asyncio")
    return result


async def window_result(job: WindowJob) -> WindowResult:
    """The desk and its baselines over one window.

    Raises:
        ConfigError: Bad input (as :func:`~.engine.run_backtest`).
        BackendError: The model failed, or the strict cache missed.
    """
    spec = replace(job.spec, start=job.window.start, end=job.window.end)
    record = await run_backtest(spec, backend_factory=_factory(job.backend))
    figures = compute_figures(record)
    config = desk_settings(spec)
    series, timeframe = load_history(spec, config)
    exchange = paper_exchange(config.exchange)
    quote = config.risk.quote_currency
    scratch = scratch_folder()

    async def baseline_return(strategy: Strategy) -> float:
        run = await run_baseline(strategy, series, timeframe, spec.start, exchange, quote,
                                 scratch=scratch)
        return compute_figures(run).total_return

    rules: list[Strategy] = [BuyAndHold(), MovingAverageCrossover()]
    baselines = {strategy.name: await baseline_return(strategy) for strategy in rules}
    randoms = [await baseline_return(random_trader_for(record, job.seed + index))
               for index in range(job.random_traders)]
    return WindowResult(
        label=job.window.label, total_return=figures.total_return, sharpe=figures.sharpe,
        max_drawdown=figures.max_drawdown, trades=len(record.trades),
        decisions=figures.decisions, baselines=baselines, random_returns=randoms,
        tokens=figures.input_tokens + figures.output_tokens, cost=figures.cost,
        model_seconds=figures.model_seconds, returns=_returns(record))


def _factory(path: str | None) -> BackendFactory | None:
    if path is None:
        return None
    module, _, name = path.partition(":")
    found: BackendFactory = getattr(importlib.import_module(module), name)
    return found


def _returns(record: BacktestRecord) -> tuple[float, ...]:
    values = [float(record.starting_equity), *(float(p.equity) for p in record.equity)]
    return tuple(b / a - 1 for a, b in itertools.pairwise(values) if a)
