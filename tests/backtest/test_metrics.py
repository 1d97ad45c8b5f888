"""The figures of a backtest, on records made up by hand so each can be worked out on paper."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from trading_agent.backtest.metrics import (
    buy_and_hold_curve,
    candles_per_year,
    compute_figures,
    drawdown_curve,
)
from trading_agent.backtest.record import (
    BacktestRecord,
    Decision,
    EquityPoint,
    FillRecord,
    ModelUsage,
)
from trading_agent.trading.books import RoundTrip
from trading_agent.trading.exchange import Candle

START = datetime(2023, 1, 5, tzinfo=UTC)
HOUR = timedelta(hours=1)
HOURS_PER_YEAR = 8760


def _candles(symbol: str, prices: Sequence[tuple[str, str]]) -> list[Candle]:
    """Hourly candles from (open, close) pairs, starting at START."""
    return [Candle(symbol, "1h", START + i * HOUR, Decimal(o), max(Decimal(o), Decimal(c)),
                   min(Decimal(o), Decimal(c)), Decimal(c), Decimal(1))
            for i, (o, c) in enumerate(prices)]


def _record(equity: Sequence[str], *, starting: str = "100", exposure: Sequence[str] = (),
            trades: Sequence[RoundTrip] = (), fills: Sequence[FillRecord] = (),
            candles: dict[str, list[Candle]] | None = None,
            timeframe: str = "1h") -> BacktestRecord:
    """A record whose equity points close hourly candles from START."""
    shares = list(exposure) or ["0"] * len(equity)
    points = [EquityPoint(START + (i + 1) * HOUR, Decimal(value), Decimal(share))
              for i, (value, share) in enumerate(zip(equity, shares, strict=True))]
    if candles is None:
        candles = {"BTC/USDT": _candles("BTC/USDT", [("100", "100")] * max(len(equity), 1))}
    return BacktestRecord(desk="alpha", model="gemma-3-270m", start=START,
                          end=START + len(equity) * HOUR, timeframe=timeframe,
                          quote_currency="USDT", candles=candles,
                          starting_equity=Decimal(starting), equity=points, trades=list(trades),
                          fills=list(fills))


def _trip(number: int, entry: str, exit_price: str | None, profit: str, fees: str, *,
          amount: str = "1") -> RoundTrip:
    """A round trip as the desk's books hold it, opened at hour ``number`` and closed an hour
    later (or still open when ``exit_price`` is None)."""
    opened = START + number * HOUR
    closed = exit_price is not None
    return RoundTrip(number, "BTC/USDT", "long", opened, Decimal(amount), Decimal(entry),
                     closed_at=opened + HOUR if closed else None,
                     exit_price=Decimal(exit_price) if closed else None,
                     exited=Decimal(amount) if closed else Decimal(0), profit=Decimal(profit),
                     fees=Decimal(fees), exit_reason="decision" if closed else None,
                     opened_turn=f"t{number:06d}",
                     closed_turn=f"t{number + 1:06d}" if closed else None)


def _fill(hour: int, side: str) -> FillRecord:
    return FillRecord(decided_at=START + hour * HOUR, filled_at=START + hour * HOUR,
                      symbol="BTC/USDT", side="buy" if side == "buy" else "sell",
                      amount=Decimal(1), price=Decimal(100), fee=Decimal("0.1"),
                      client_order_id=f"ta{hour:030d}", reason="because",
                      turn=f"t{hour:06d}")


def test_flat_equity_has_no_return_no_drawdown_and_no_sharpe() -> None:
    figures = compute_figures(_record(["100"] * 24))
    assert figures.total_return == 0.0
    assert figures.max_drawdown == 0.0
    assert figures.sharpe is None  # zero deviation: undefined, not infinite
    assert figures.sortino is None  # no negative return
    assert figures.candles == 24
    assert json.loads(json.dumps(figures.to_json()))["sharpe"] is None


def test_a_known_rise_and_fall() -> None:
    # 100 → 110 → 121 → 99 → 108.9: the peak is 121, the trough after it 99.
    figures = compute_figures(_record(["110", "121", "99", "108.9"]))
    assert figures.total_return == pytest.approx(0.089)
    assert figures.max_drawdown == pytest.approx(22 / 121)
    assert figures.final_equity == pytest.approx(108.9)


def test_the_starting_equity_is_the_first_peak() -> None:
    figures = compute_figures(_record(["90", "95", "99"]))
    assert figures.max_drawdown == pytest.approx(0.10)
    assert figures.total_return == pytest.approx(-0.01)


def test_drawdown_curve_is_the_fall_from_the_running_peak() -> None:
    assert drawdown_curve([100, 120, 90, 130, 65]) == pytest.approx(
        [0.0, 0.0, -0.25, 0.0, -0.5])
    assert drawdown_curve([]) == []


def test_sharpe_and_sortino_from_per_candle_returns() -> None:
    # Returns: +10%, -10%, +10%. Mean 0.1/3; deviations 0.2/3, -0.4/3, 0.2/3, so the sample
    # variance is (0.04/9 + 0.16/9 + 0.04/9) / 2 = 0.24/18. Downside: √(0.01 / 3).
    figures = compute_figures(_record(["110", "99", "108.9"]))
    mean = 0.1 / 3
    assert figures.sharpe == pytest.approx(mean / math.sqrt(0.24 / 18)
                                           * math.sqrt(HOURS_PER_YEAR))
    assert figures.sortino == pytest.approx(mean / math.sqrt(0.01 / 3)
                                            * math.sqrt(HOURS_PER_YEAR))
    assert figures.sharpe == pytest.approx(27.02, abs=0.01)
    assert figures.sortino == pytest.approx(54.04, abs=0.01)


def test_sharpe_is_undefined_with_a_single_return() -> None:
    figures = compute_figures(_record(["105"]))
    assert figures.sharpe is None
    assert figures.sortino is None
    assert figures.total_return == pytest.approx(0.05)


def test_a_steady_rise_has_no_sortino_but_a_sharpe() -> None:
    figures = compute_figures(_record(["101", "103", "104"]))
    assert figures.sortino is None
    assert figures.sharpe is not None and figures.sharpe > 0


def test_candles_per_year() -> None:
    assert candles_per_year("5m") == 105_120
    assert candles_per_year("1h") == 8_760
    assert candles_per_year("1d") == 365
    with pytest.raises(ValueError, match="timeframe"):
        candles_per_year("5x")


def test_sharpe_is_annualized_by_the_timeframe() -> None:
    hourly = compute_figures(_record(["110", "99", "108.9"]))
    five_minutes = compute_figures(_record(["110", "99", "108.9"], timeframe="5m"))
    assert hourly.sharpe is not None and five_minutes.sharpe is not None
    assert five_minutes.sharpe / hourly.sharpe == pytest.approx(math.sqrt(12))


def test_buy_and_hold_over_two_symbols() -> None:
    # 1,000 split in two: BTC bought at 100 ends at 150 (+50%), ETH at 200 ends at 180 (-10%).
    candles = {
        "BTC/USDT": _candles("BTC/USDT", [("100", "110"), ("110", "120"), ("120", "150")]),
        "ETH/USDT": _candles("ETH/USDT", [("200", "190"), ("190", "220"), ("220", "180")]),
    }
    record = _record(["1000", "1000", "1000"], starting="1000", candles=candles)
    figures = compute_figures(record)
    assert figures.buy_and_hold_return == pytest.approx(0.20)
    assert figures.symbols == ("BTC/USDT", "ETH/USDT")
    # At each close: 500 × close/100 + 500 × close/200.
    assert buy_and_hold_curve(record) == pytest.approx([
        500 * 1.10 + 500 * 0.95, 500 * 1.20 + 500 * 1.10, 500 * 1.50 + 500 * 0.90])


def test_trades_and_the_win_rate_are_the_closed_round_trips_of_the_books() -> None:
    trades = [
        # Bought 1 at 100, sold at 102, 0.50 of fees in all: (102 - 100) x 1 - 0.50 = 1.50.
        _trip(1, "100", "102", "1.5", "0.5"),
        # Sold above the entry, yet a loss once both fees are paid: 0.50 - 0.75 = -0.25.
        _trip(3, "100", "100.5", "-0.25", "0.75"),
        # Still open at the end: what it realized so far is its entry fee.
        _trip(5, "101", None, "-0.1", "0.1"),
    ]
    fills = [_fill(1, "buy"), _fill(2, "sell"), _fill(3, "buy"), _fill(4, "sell"),
             _fill(5, "buy")]
    figures = compute_figures(_record(["100", "101", "101", "100.75", "100.65"],
                                      trades=trades, fills=fills))
    assert (figures.trades, figures.open_trades, figures.fills) == (2, 1, 5)
    assert figures.win_rate == pytest.approx(0.5)
    assert figures.realized_profit == pytest.approx(1.5 - 0.25 - 0.1)
    assert figures.fees == pytest.approx(0.5 + 0.75 + 0.1)
    content = figures.to_json()
    assert (content["trades"], content["open_trades"], content["fills"]) == (2, 1, 5)
    assert content["realized_profit"] == pytest.approx(1.15)


def test_a_round_trip_that_breaks_even_is_not_a_win() -> None:
    trades = [_trip(1, "100", "100.2", "0", "0.2"), _trip(3, "100", "101", "0.8", "0.2")]
    figures = compute_figures(_record(["100", "100", "100", "100"], trades=trades))
    assert figures.win_rate == pytest.approx(0.5)
    assert figures.trades == 2


def test_win_rate_is_undefined_before_a_round_trip_closes() -> None:
    figures = compute_figures(_record(["100", "100"], trades=[_trip(1, "100", None, "-0.1",
                                                                     "0.1")],
                                      fills=[_fill(1, "buy")]))
    assert figures.win_rate is None
    assert (figures.trades, figures.open_trades, figures.fills) == (0, 1, 1)
    assert figures.fees == pytest.approx(0.1)
    assert figures.realized_profit == pytest.approx(-0.1)
    assert figures.to_json()["win_rate"] is None


def test_no_trade_no_profit() -> None:
    figures = compute_figures(_record(["100", "100"]))
    assert (figures.trades, figures.open_trades, figures.fills) == (0, 0, 0)
    assert (figures.win_rate, figures.realized_profit, figures.fees) == (None, 0.0, 0.0)


def test_exposure_is_the_mean_share_held() -> None:
    figures = compute_figures(_record(["100", "100", "100", "100"],
                                      exposure=["0", "0.5", "1", "0.5"]))
    assert figures.exposure == pytest.approx(0.5)


def test_usage_and_span_reach_the_json() -> None:
    record = _record(["100", "102"])
    record.usage = ModelUsage(model_calls=3, cache_hits=5, input_tokens=12_000,
                              output_tokens=900, cost=0.0123)
    record.decisions = [Decision(1, START + HOUR, "schedule: check", "Holding."),
                        Decision(2, START + 2 * HOUR, "schedule: check", "Still holding.")]
    content = compute_figures(record).to_json()
    required = {"desk", "from", "to", "candles", "decisions", "model_calls", "cache_hits",
                "input_tokens", "output_tokens", "cost", "total_return",
                "buy_and_hold_return", "max_drawdown", "sharpe", "sortino", "trades",
                "open_trades", "fills", "win_rate", "realized_profit", "fees", "exposure"}
    assert required <= content.keys()
    assert content["from"] == "2023-01-05T00:00:00+00:00"
    assert content["to"] == "2023-01-05T02:00:00+00:00"
    assert (content["model_calls"], content["cache_hits"], content["decisions"]) == (3, 5, 2)
    assert (content["input_tokens"], content["output_tokens"]) == (12_000, 900)
    assert content["cost"] == 0.0123
    for key in ("total_return", "buy_and_hold_return", "max_drawdown", "fees", "exposure",
                "starting_equity", "final_equity", "realized_profit"):
        assert type(content[key]) is float, key
    assert content["total_return"] == pytest.approx(0.02)
    json.dumps(content, allow_nan=False)  # plain JSON, nothing a strict reader refuses


def test_unknown_cost_is_null() -> None:
    assert compute_figures(_record(["100"])).to_json()["cost"] is None


def test_an_empty_equity_curve_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match=r"desk 'alpha' has no equity point"):
        compute_figures(_record([]))
