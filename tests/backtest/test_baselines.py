"""The baselines run through the real paper exchange, checked by hand on a few candles."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import anyio
import pytest

from trading_agent.backtest.baselines import (
    BuyAndHold,
    MovingAverageCrossover,
    RandomTrader,
    Strategy,
    run_baseline,
)
from trading_agent.backtest.metrics import compute_figures
from trading_agent.backtest.record import BacktestRecord
from trading_agent.trading.config import ExchangeConfig
from trading_agent.trading.exchange import Candle

START = datetime(2023, 1, 5, tzinfo=UTC)
STEP = timedelta(hours=1)


def _series(prices: list[tuple[str, str]], warmup: int = 2) -> list[Candle]:
    """Hourly candles from (open, close): ``warmup`` flat ones at the first open before
    START, then these."""
    first = Decimal(prices[0][0])
    candles = [Candle("BTC/USDT", "1h", START - (warmup - i) * STEP, first, first, first,
                      first, Decimal(10)) for i in range(warmup)]
    for i, (o, c) in enumerate(prices):
        op, cl = Decimal(o), Decimal(c)
        candles.append(Candle("BTC/USDT", "1h", START + i * STEP, op, max(op, cl),
                              min(op, cl), cl, Decimal(10)))
    return candles


EXCHANGE = ExchangeConfig.model_validate({
    "feed": "replay", "paper": {"starting_balances": {"USDT": "1000"}, "taker_fee": "0.001",
                                "slippage_bps": "0", "market_fill": "next_open"},
    "replay": {"timeframe": "1h"}})


def _run(strategy: Strategy, candles: list[Candle]) -> BacktestRecord:
    async def go() -> BacktestRecord:
        return await run_baseline(strategy, {"BTC/USDT": candles}, "1h", START, EXCHANGE,
                                  "USDT")
    return anyio.run(go)


def test_buy_and_hold_pays_the_fee_and_fills_at_the_next_open() -> None:
    record = _run(BuyAndHold(), _series([("100", "100"), ("100", "110"), ("110", "121")]))
    # At the first close (100) it spends 99.5% of 1,000: 9.95 BTC, which fill at the next
    # open, 100, paying 0.1%: 0.995. Cash left: 1000 - 995 - 0.995 = 4.005. At the last
    # close, 121: 9.95 * 121 + 4.005 = 1,207.955.
    assert [point.equity for point in record.equity] == [
        Decimal("1000"), Decimal("9.95") * 110 + Decimal("4.005"),
        Decimal("9.95") * 121 + Decimal("4.005")]
    assert compute_figures(record).total_return == pytest.approx(0.207955)
    assert len(record.trades) == 1 and record.trades[0].is_open


def test_the_crossover_buys_on_a_rise_and_sells_on_a_fall() -> None:
    rising = [("100", "100")] * 50 + [(str(100 + i), str(101 + i)) for i in range(20)]
    falling = [(str(120 - i), str(119 - i)) for i in range(60)]
    record = _run(MovingAverageCrossover(), _series(rising + falling, warmup=48))
    assert len(record.trades) == 1
    trade = record.trades[0]
    assert trade.closed_at is not None and trade.exit_price is not None
    # Bought once the fast mean rose above the slow one, sold once the fall took it below.
    assert START + 50 * STEP < trade.opened_at < START + 70 * STEP < trade.closed_at


def test_a_random_trader_makes_its_round_trips_at_seeded_closes() -> None:
    candles = _series([(str(100 + i % 3), str(100 + (i + 1) % 3)) for i in range(30)])
    first = _run(RandomTrader(7, trips=3, notional=Decimal(200), steps=30,
                              symbols=["BTC/USDT"]), candles)
    again = _run(RandomTrader(7, trips=3, notional=Decimal(200), steps=30,
                              symbols=["BTC/USDT"]), candles)
    other = _run(RandomTrader(8, trips=3, notional=Decimal(200), steps=30,
                              symbols=["BTC/USDT"]), candles)
    assert len(first.trades) == 3 and all(not trade.is_open for trade in first.trades)
    assert [t.opened_at for t in first.trades] == [t.opened_at for t in again.trades]
    assert [t.opened_at for t in first.trades] != [t.opened_at for t in other.trades]
    # Each buys about 200 USDT at a price near 100: some 2 BTC.
    assert all(Decimal("1.9") < trade.amount < Decimal("2.1") for trade in first.trades)
