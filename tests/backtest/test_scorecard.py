"""The scorecard's figures, checked by hand on small cases."""

from __future__ import annotations

import pytest

from trading_agent.backtest.scorecard import (
    RANDOM,
    WindowResult,
    bootstrap_interval,
    deflated_sharpe,
    quantile,
    scorecard,
    share_above,
    spread,
    with_deflated_sharpe,
)


def _window(label: str, desk: float, hold: float, cross: float,
            randoms: tuple[float, ...] = (), *, sharpe: float | None = 1.0,
            returns: tuple[float, ...] = ()) -> WindowResult:
    return WindowResult(label=label, total_return=desk, sharpe=sharpe, max_drawdown=0.01,
                        trades=2, decisions=4, baselines={"buy and hold": hold,
                                                          "MA crossover 12/48": cross},
                        random_returns=randoms, tokens=4000, cost=0.02, model_seconds=2.0,
                        returns=returns)


def test_quantiles_and_spread_by_hand() -> None:
    assert quantile([1, 2, 3, 4], 0.25) == 1.75  # 1 + (2 - 1) * 0.75
    assert quantile([4, 1, 3, 2], 0.5) == 2.5
    figures = spread([0.01, -0.02, 0.03])
    # Sorted -0.02, 0.01, 0.03: the 25th percentile is halfway from -0.02 to 0.01.
    assert figures.median == 0.01
    assert figures.p25 == pytest.approx(-0.005) and figures.p75 == pytest.approx(0.02)
    assert (figures.low, figures.high) == (-0.02, 0.03)
    assert figures.mean == pytest.approx(0.02 / 3)
    low, high = figures.interval
    assert -0.02 <= low < figures.mean < high <= 0.03


def test_the_bootstrap_interval_is_seeded_and_narrows_with_agreement() -> None:
    assert bootstrap_interval([0.05]) == (0.05, 0.05)
    values = [0.0, 1.0] * 10
    assert bootstrap_interval(values, seed=3) == bootstrap_interval(values, seed=3)
    low, high = bootstrap_interval(values)
    # The mean of 20 coin flips: within about two standard errors (0.11 each) of 0.5.
    assert 0.25 < low < 0.5 < high < 0.75


def test_share_above_counts_a_tie_half() -> None:
    assert share_above([0.01, -0.02, 0.03], [0.0, -0.02, 0.05]) == 0.5  # (1 + 0.5 + 0) / 3


def test_verdicts_beyond_chance_and_not() -> None:
    ahead = scorecard("alpha", [_window(f"w{i}", 0.02 + i / 100, 0.0, 0.05 + i / 100)
                                for i in range(5)])
    hold, cross = ahead.comparisons
    assert hold.verdict == "beat" and hold.beats == 1.0
    assert hold.line == ("vs buy and hold: ahead in 100% of 5 windows, mean excess return "
                         "+4.00 points (95% interval +2.80 to +5.20): beat it beyond chance.")
    assert cross.verdict == "lost" and cross.beats == 0.0
    assert "lost to it beyond chance" in cross.line
    mixed = scorecard("alpha", [_window("a", 0.01, 0.0, 0.0), _window("b", -0.01, 0.0, 0.0),
                                _window("c", 0.0, 0.0, 0.0)])
    assert mixed.comparisons[0].verdict == "unclear"
    assert "not beyond chance" in mixed.comparisons[0].line


def test_the_probability_of_beating_the_random_traders_by_hand() -> None:
    card = scorecard("alpha", [_window("a", 0.02, 0.0, 0.0, (0.0, 0.05)),
                               _window("b", 0.02, 0.0, 0.0, (0.01, 0.03))])
    random = card.comparisons[-1]
    assert random.baseline == RANDOM
    # Pairs: 0.02 > 0.0 yes, > 0.05 no, > 0.01 yes, > 0.03 no.
    assert random.probability == 0.5
    # Against each window's median random trader (0.025, 0.02): behind, then a tie.
    assert random.beats == 0.25
    assert random.line.endswith("beats a random trader with probability 50%.")


def test_costs_per_decision_over_every_window() -> None:
    card = scorecard("alpha", [_window("a", 0.0, 0.0, 0.0), _window("b", 0.0, 0.0, 0.0)])
    assert card.tokens_per_decision == 1000  # 8,000 tokens over 8 decisions
    assert card.cost_per_decision == pytest.approx(0.005)
    assert card.model_seconds_per_decision == 0.5
    assert card.sharpe is not None and card.sharpe.median == 1.0


def test_the_deflated_sharpe_ratio_by_hand() -> None:
    returns = [0.02, -0.01] * 3
    # Mean 0.005, sample deviation sqrt(6 * 0.015^2 / 5) = 0.0164317: SR* = 0.304290.
    # Standardized returns are +-0.912871: skewness 0, kurtosis 0.912871^4 = 0.694444.
    # Two configs, Sharpe ratios 0.304290 and 0.1: Var = 0.204290^2 / 2 = 0.0208672.
    # SR0 = sqrt(Var) * ((1 - g) * inv_cdf(1/2) + g * inv_cdf(1 - 1/(2e)))
    #     = 0.144455 * (0 + 0.577216 * 0.900453) = 0.075079.
    # DSR = cdf((0.304290 - 0.075079) * sqrt(5) / sqrt(1 + (0.694444 - 1) / 4 * 0.092593))
    #     = cdf(0.512531 / 0.996457) = cdf(0.514353) = 0.6965.
    best = 0.005 / 0.016431677
    assert deflated_sharpe(returns, [best, 0.1]) == pytest.approx(0.6965, abs=5e-4)
    assert deflated_sharpe(returns, [best]) is None  # one config: nothing to deflate


def test_only_the_best_of_several_runs_gets_a_deflated_sharpe_ratio() -> None:
    steady = scorecard("steady", [_window("a", 0.01, 0, 0, returns=(0.02, -0.01) * 3)])
    noisy = scorecard("noisy", [_window("a", 0.0, 0, 0, returns=(0.03, -0.03) * 3)])
    cards = with_deflated_sharpe([steady, noisy])
    assert cards[0].deflated_sharpe is not None and cards[1].deflated_sharpe is None
    assert with_deflated_sharpe([steady])[0].deflated_sharpe is None
