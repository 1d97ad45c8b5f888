"""The scorecard of a many-window run: pure functions of each window's figures.

Nothing here runs anything; the same figures always give the same scorecard (the bootstrap
is seeded). Definitions (the README quotes them):

- Per window: the desk's ``total_return``, ``sharpe`` and ``max_drawdown``
  (:mod:`.metrics`), and each baseline's return over the same window through the same paper
  exchange (:mod:`.baselines`).
- ``median`` and spread of a figure over the windows: the median, the 25th and 75th
  percentiles (linear interpolation between order statistics) and the lowest and highest.
- ``interval``: a bootstrap 95% interval of the mean over windows: the windows resampled
  with replacement 2,000 times (seeded), the mean of each resample, the 2.5th and 97.5th
  percentiles of those means. Windows, not candles, are resampled: candles of one window
  are not independent draws.
- ``beats``: for each baseline, the share of windows where the desk's return is above the
  baseline's (a tie counts half). For the random traders, the baseline of a window is the
  median random trader, and ``probability_beats_random`` is the share of (window, random
  trader) pairs the desk beats (a tie counts half).
- ``excess``: the desk's return minus the baseline's, per window; its mean and interval.
  The desk **beat the baseline beyond chance** when the interval's low end is above zero,
  **lost to it beyond chance** when the high end is below zero, else the difference is
  **not beyond chance**.
- ``deflated_sharpe``: when several configs are compared, the probability that the best
  one's Sharpe ratio is above zero once the number of configs tried is accounted for
  (Bailey and López de Prado, 2014): with per-candle Sharpe ratios SR of every config, the
  best's SR*, its returns' skewness g3 and kurtosis g4 over T candles, and the expected
  maximum of N Sharpe ratios under no skill SR0 = √Var(SR) · ((1 − γ)·Φ⁻¹(1 − 1/N) +
  γ·Φ⁻¹(1 − 1/(N·e))), γ the Euler-Mascheroni constant: DSR = Φ((SR* − SR0)·√(T − 1) /
  √(1 − g3·SR* + (g4 − 1)/4·SR*²)).
- Costs: tokens, money and model seconds per decision, over every window.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["Comparison", "Scorecard", "Spread", "WindowResult", "bootstrap_interval",
           "deflated_sharpe", "quantile", "scorecard", "share_above", "spread",
           "with_deflated_sharpe"]

_RESAMPLES = 2000
_LEVEL = 0.95
_EULER_GAMMA = 0.5772156649015329
RANDOM = "random traders"
"""The name of the random traders' baseline."""


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by linear interpolation between order statistics (numpy's
    default).

    Raises:
        ValueError: No values.
    """
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Spread:
    """A figure over the windows.

    Attributes:
        median: The median.
        p25: The 25th percentile.
        p75: The 75th percentile.
        low: The lowest.
        high: The highest.
        mean: The mean.
        interval: The bootstrap 95% interval of the mean.
    """

    median: float
    p25: float
    p75: float
    low: float
    high: float
    mean: float
    interval: tuple[float, float]

    def to_json(self) -> dict[str, Any]:
        """As ``report.json`` holds it."""
        return {"median": self.median, "p25": self.p25, "p75": self.p75, "low": self.low,
                "high": self.high, "mean": self.mean, "interval": list(self.interval)}


def bootstrap_interval(values: Sequence[float], *, seed: int = 0,
                       resamples: int = _RESAMPLES, level: float = _LEVEL,
                       statistic: Callable[[Sequence[float]], float] = statistics.fmean,
                       ) -> tuple[float, float]:
    """A bootstrap interval of ``statistic`` over ``values`` (percentile method).

    Returns:
        The interval's ends; both the value itself for a single value.
    """
    if not values:
        raise ValueError("no values")
    rng = random.Random(f"bootstrap {seed}")
    count = len(values)
    draws = [statistic([values[rng.randrange(count)] for _ in range(count)])
             for _ in range(resamples)]
    tail = (1 - level) / 2
    return quantile(draws, tail), quantile(draws, 1 - tail)


def spread(values: Sequence[float], *, seed: int = 0) -> Spread:
    """A figure's median, percentiles, extremes, mean and the mean's bootstrap interval."""
    return Spread(median=statistics.median(values), p25=quantile(values, 0.25),
                  p75=quantile(values, 0.75), low=min(values), high=max(values),
                  mean=statistics.fmean(values),
                  interval=bootstrap_interval(values, seed=seed))


def share_above(mine: Sequence[float], theirs: Sequence[float]) -> float:
    """The share of pairs where ``mine`` is above ``theirs``, a tie counting half."""
    if len(mine) != len(theirs) or not mine:
        raise ValueError("two equally long, non-empty sequences")
    return sum(1.0 if a > b else 0.5 if a == b else 0.0
               for a, b in zip(mine, theirs, strict=True)) / len(mine)


@dataclass(frozen=True)
class WindowResult:
    """One window of one run.

    Attributes:
        label: The window (its start).
        total_return: The desk's return.
        sharpe: Its Sharpe ratio (None when undefined).
        max_drawdown: Its largest drawdown.
        trades: Its round trips.
        decisions: Its turns.
        baselines: Each baseline's return (buy and hold, the crossover).
        random_returns: Each random trader's return.
        tokens: Prompt and completion tokens.
        cost: Money at the configured prices (None without prices).
        model_seconds: Seconds spent waiting for the model.
        returns: The desk's per-candle returns (for the deflated Sharpe ratio; not in
            ``report.json``).
    """

    label: str
    total_return: float
    sharpe: float | None
    max_drawdown: float
    trades: int
    decisions: int
    baselines: Mapping[str, float]
    random_returns: Sequence[float] = ()
    tokens: int = 0
    cost: float | None = None
    model_seconds: float = 0.0
    returns: Sequence[float] = ()

    def to_json(self) -> dict[str, Any]:
        """As ``report.json`` holds it."""
        return {"window": self.label, "total_return": self.total_return,
                "sharpe": self.sharpe, "max_drawdown": self.max_drawdown,
                "trades": self.trades, "decisions": self.decisions,
                "baselines": dict(self.baselines),
                "random_median": (statistics.median(self.random_returns)
                                  if self.random_returns else None),
                "tokens": self.tokens, "cost": self.cost,
                "model_seconds": self.model_seconds}


@dataclass(frozen=True)
class Comparison:
    """The desk against one baseline over the windows.

    Attributes:
        baseline: Its name.
        beats: The share of windows the desk beat it in.
        excess: The desk's return minus its, over the windows.
        verdict: ``beat``, ``lost`` or ``unclear`` (beyond chance or not).
        line: The one-line verdict the report prints.
        probability: For the random traders, the share of (window, trader) pairs the desk
            beat; None for the others.
    """

    baseline: str
    beats: float
    excess: Spread
    verdict: str
    line: str
    probability: float | None = None

    def to_json(self) -> dict[str, Any]:
        """As ``report.json`` holds it."""
        return {"baseline": self.baseline, "beats": self.beats,
                "excess": self.excess.to_json(), "verdict": self.verdict, "line": self.line,
                "probability": self.probability}


@dataclass(frozen=True)
class Scorecard:
    """One run over all its windows.

    Attributes:
        label: The run (desk or config).
        windows: Each window's result.
        total_return: The desk's return over the windows.
        sharpe: Its Sharpe ratio over the windows that have one.
        max_drawdown: Its drawdown over the windows.
        comparisons: The desk against each baseline.
        tokens_per_decision: Tokens per decision.
        cost_per_decision: Money per decision (None without prices).
        model_seconds_per_decision: Seconds waited for the model per decision.
        deflated_sharpe: The best config's deflated Sharpe ratio when several were compared
            (on the best run only); None otherwise.
    """

    label: str
    windows: Sequence[WindowResult]
    total_return: Spread
    sharpe: Spread | None
    max_drawdown: Spread
    comparisons: Sequence[Comparison]
    tokens_per_decision: float | None
    cost_per_decision: float | None
    model_seconds_per_decision: float | None
    deflated_sharpe: float | None = field(default=None)

    def to_json(self) -> dict[str, Any]:
        """As ``report.json`` holds it."""
        return {"label": self.label, "windows": [w.to_json() for w in self.windows],
                "total_return": self.total_return.to_json(),
                "sharpe": None if self.sharpe is None else self.sharpe.to_json(),
                "max_drawdown": self.max_drawdown.to_json(),
                "baselines": [c.to_json() for c in self.comparisons],
                "tokens_per_decision": self.tokens_per_decision,
                "cost_per_decision": self.cost_per_decision,
                "model_seconds_per_decision": self.model_seconds_per_decision,
                "deflated_sharpe": self.deflated_sharpe}


def _compare(name: str, desk: Sequence[float], baseline: Sequence[float], *, seed: int,
             probability: float | None = None) -> Comparison:
    excess = spread([a - b for a, b in zip(desk, baseline, strict=True)], seed=seed)
    low, high = excess.interval
    verdict = "beat" if low > 0 else "lost" if high < 0 else "unclear"
    said = {"beat": "beat it beyond chance", "lost": "lost to it beyond chance",
            "unclear": "not beyond chance"}[verdict]
    wins = share_above(desk, baseline)
    line = (f"vs {name}: ahead in {wins:.0%} of {len(desk)} windows, mean excess return "
            f"{excess.mean * 100:+.2f} points (95% interval {low * 100:+.2f} to "
            f"{high * 100:+.2f}): {said}")
    if probability is not None:
        line += f"; beats a random trader with probability {probability:.0%}"
    return Comparison(name, wins, excess, verdict, line + ".", probability)


def scorecard(label: str, windows: Sequence[WindowResult], *, seed: int = 0) -> Scorecard:
    """The scorecard of one run over its windows.

    Raises:
        ValueError: No window.
    """
    if not windows:
        raise ValueError("a scorecard needs at least one window")
    returns = [w.total_return for w in windows]
    sharpes = [w.sharpe for w in windows if w.sharpe is not None]
    comparisons = [_compare(name, returns, [w.baselines[name] for w in windows], seed=seed)
                   for name in windows[0].baselines]
    if all(w.random_returns for w in windows):
        medians = [statistics.median(w.random_returns) for w in windows]
        pairs = [(w.total_return, r) for w in windows for r in w.random_returns]
        probability = share_above([a for a, _ in pairs], [b for _, b in pairs])
        comparisons.append(_compare(RANDOM, returns, medians, seed=seed,
                                    probability=probability))
    decisions = sum(w.decisions for w in windows)
    costs = [w.cost for w in windows]
    return Scorecard(
        label=label, windows=list(windows), total_return=spread(returns, seed=seed),
        sharpe=spread(sharpes, seed=seed) if sharpes else None,
        max_drawdown=spread([w.max_drawdown for w in windows], seed=seed),
        comparisons=comparisons,
        tokens_per_decision=sum(w.tokens for w in windows) / decisions if decisions else None,
        cost_per_decision=(sum(c for c in costs if c is not None) / decisions
                           if decisions and any(c is not None for c in costs) else None),
        model_seconds_per_decision=(sum(w.model_seconds for w in windows) / decisions
                                    if decisions else None))


def with_deflated_sharpe(cards: Sequence[Scorecard]) -> list[Scorecard]:
    """The scorecards, the best run's (by its per-candle Sharpe ratio over every window)
    given its deflated Sharpe ratio when there are several."""
    if len(cards) < 2:
        return list(cards)
    pooled = [[r for w in card.windows for r in w.returns] for card in cards]
    sharpes = [statistics.fmean(r) / statistics.stdev(r)
               if len(r) > 2 and statistics.stdev(r) > 0 else 0.0 for r in pooled]
    best = max(range(len(cards)), key=sharpes.__getitem__)
    deflated = deflated_sharpe(pooled[best], sharpes)
    return [replace(card, deflated_sharpe=deflated) if index == best else card
            for index, card in enumerate(cards)]


def deflated_sharpe(returns: Sequence[float], trial_sharpes: Sequence[float]) -> float | None:
    """The deflated Sharpe ratio of the best of several configs (see the module docstring).

    Args:
        returns: The best config's per-candle returns.
        trial_sharpes: The per-candle (not annualized) Sharpe ratio of every config tried,
            the best's included.

    Returns:
        A probability; None with fewer than two configs, fewer than three returns, or no
        spread among the configs' Sharpe ratios.
    """
    trials = len(trial_sharpes)
    count = len(returns)
    if trials < 2 or count < 3:
        return None
    mean = statistics.fmean(returns)
    deviation = statistics.stdev(returns)
    variance = statistics.variance(trial_sharpes)
    if deviation == 0 or variance == 0:
        return None
    best = mean / deviation
    skew = statistics.fmean(((r - mean) / deviation) ** 3 for r in returns)
    kurtosis = statistics.fmean(((r - mean) / deviation) ** 4 for r in returns)
    normal = statistics.NormalDist()
    expected_max = math.sqrt(variance) * (
        (1 - _EULER_GAMMA) * normal.inv_cdf(1 - 1 / trials)
        + _EULER_GAMMA * normal.inv_cdf(1 - 1 / (trials * math.e)))
    denominator = 1 - skew * best + (kurtosis - 1) / 4 * best ** 2
    if denominator <= 0:
        return None
    return normal.cdf((best - expected_max) * math.sqrt(count - 1) / math.sqrt(denominator))
