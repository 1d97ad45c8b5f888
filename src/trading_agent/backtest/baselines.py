"""Baselines: what the desk must beat, run over its windows through the same paper exchange.

A desk's return means something only next to what simpler traders made on the same candles,
paying the same fees and slippage. Each baseline here is a small rule run on the desk's own
venue: the paper exchange of its config (fees, slippage, starting balances) on the replay,
market orders decided at a candle's close and filled at the next open, as the desk's are.

- **Buy and hold**: at the first close, every symbol bought with an equal share of the cash
  (99.5% of it: the rest pays the fees and slippage), held to the end.
- **Moving-average crossover**: per symbol, long (its share of the cash) while the mean of
  the last 12 closes is above the mean of the last 48, flat otherwise.
- **Random traders**: the desk's number of round trips in the window, opened and closed at
  random closes (seeded), each buying the desk's mean buy size of a random symbol: what
  trading as much as the desk, without its judgement, makes.

Each run gives a :class:`~trading_agent.backtest.record.BacktestRecord` like the desk's, so
the same figures (:mod:`.metrics`) apply.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Literal, Protocol

from trading_agent.backtest.record import BacktestRecord, EquityPoint
from trading_agent.errors import TradingAgentError
from trading_agent.store.trading_state import TradingStateFile
from trading_agent.trading.config import ExchangeConfig
from trading_agent.trading.exchange import Candle, OrderRequest, client_order_id_for
from trading_agent.trading.factory import open_exchange
from trading_agent.trading.replay import ReplayFeed
from trading_agent.trading.valuation import value_account

__all__ = ["BuyAndHold", "MovingAverageCrossover", "Order", "RandomTrader", "Strategy",
           "View", "random_trader_for", "run_baseline"]

_CASH_USED = Decimal("0.995")
FAST, SLOW = 12, 48


@dataclass(frozen=True)
class View:
    """What a baseline sees at a close.

    Attributes:
        index: The step of the window (0 at its first close).
        steps: The window's steps in all.
        closes: Each symbol's closes so far, the warm-up included, oldest first.
        held: Each symbol's base currency held.
        cash: The quote currency free.
    """

    index: int
    steps: int
    closes: Mapping[str, Sequence[Decimal]]
    held: Mapping[str, Decimal]
    cash: Decimal


Order = tuple[str, Literal["buy", "sell"], Decimal]
"""A market order: symbol, side, base amount."""


class Strategy(Protocol):
    """A baseline's rule."""

    name: str

    def decide(self, view: View) -> list[Order]:
        """The market orders to place at this close."""
        ...


class BuyAndHold:
    """Everything bought at the first close, held."""

    name = "buy and hold"

    def decide(self, view: View) -> list[Order]:
        if view.index != 0:
            return []
        share = view.cash * _CASH_USED / len(view.closes)
        return [(symbol, "buy", share / closes[-1]) for symbol, closes in view.closes.items()
                if closes and closes[-1] > 0]


class MovingAverageCrossover:
    """Long while the fast mean of closes is above the slow one."""

    name = f"MA crossover {FAST}/{SLOW}"

    def decide(self, view: View) -> list[Order]:
        orders: list[Order] = []
        share = view.cash * _CASH_USED / len(view.closes)
        for symbol, closes in view.closes.items():
            if len(closes) < SLOW:
                continue
            fast = sum(closes[-FAST:], Decimal(0)) / FAST
            slow = sum(closes[-SLOW:], Decimal(0)) / SLOW
            held = view.held.get(symbol, Decimal(0))
            if fast > slow and held <= 0 and share > 0:
                orders.append((symbol, "buy", share / closes[-1]))
            elif fast < slow and held > 0:
                orders.append((symbol, "sell", held))
        return orders


class RandomTrader:
    """``trips`` round trips at random closes, each of ``notional`` in the quote currency.

    Args:
        seed: Picks the closes and the symbols.
        trips: Round trips to make.
        notional: What each buy spends (capped by the cash).
        steps: The window's steps.
        symbols: The symbols to pick from.
    """

    def __init__(self, seed: int, trips: int, notional: Decimal, steps: int,
                 symbols: Sequence[str]) -> None:
        self.name = f"random trader {seed}"
        rng = random.Random(f"random trader {seed}")
        # The last close cannot open or close anything: its order would fill after the end.
        usable = max(0, steps - 1)
        count = min(2 * trips, usable - usable % 2)
        moments = sorted(rng.sample(range(usable), count)) if count else []
        self._actions: dict[int, tuple[str, Literal["buy", "sell"]]] = {}
        for pair in range(0, len(moments), 2):
            symbol = rng.choice(list(symbols))
            self._actions[moments[pair]] = (symbol, "buy")
            self._actions[moments[pair + 1]] = (symbol, "sell")
        self._notional = notional

    def decide(self, view: View) -> list[Order]:
        action = self._actions.get(view.index)
        if action is None:
            return []
        symbol, side = action
        closes = view.closes.get(symbol)
        if not closes or closes[-1] <= 0:
            return []
        if side == "buy":
            spend = min(self._notional, view.cash * _CASH_USED)
            return [(symbol, "buy", spend / closes[-1])] if spend > 0 else []
        held = view.held.get(symbol, Decimal(0))
        return [(symbol, "sell", held)] if held > 0 else []


def random_trader_for(desk: BacktestRecord, seed: int) -> RandomTrader:
    """A random trader making as many round trips as the desk did in its window, each of
    the desk's mean buy size (its whole cash when the desk bought nothing)."""
    buys = [fill.amount * fill.price for fill in desk.fills
            if fill.side == "buy" and fill.turn != "start"]
    notional = (sum(buys, Decimal(0)) / len(buys) if buys
                else desk.starting_equity)
    return RandomTrader(seed, len(desk.trades), notional, len(desk.equity), list(desk.candles))


async def run_baseline(strategy: Strategy, series: Mapping[str, Sequence[Candle]],
                       timeframe: str, start: datetime, exchange: ExchangeConfig,
                       quote_currency: str, *, scratch: str | None = None) -> BacktestRecord:
    """Runs a baseline over one window on the paper exchange.

    Args:
        strategy: The rule.
        series: Each symbol's candles, the warm-up included, up to the window's end.
        timeframe: Their timeframe.
        start: The window's start.
        exchange: The desk's exchange config, already paper on the replay with market
            orders filling at the next open (as the engine runs the desk).
        quote_currency: What equity is measured in.
        scratch: Where the run's throwaway store goes.

    Returns:
        The run's record: its equity per step and its round trips.
    """
    feed = ReplayFeed(dict(series), timeframe=timeframe, speed=0, start=start)
    async with AsyncExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="baseline-", dir=scratch)))
        database = folder / "baseline.sqlite3"
        venue = await stack.enter_async_context(open_exchange(
            exchange, state=TradingStateFile(database), account="baseline",
            symbols=list(series), feed=feed))
        starting = (await value_account(venue.exchange, quote_currency)).total
        record = BacktestRecord(desk=strategy.name, model="baseline", start=feed.now(),
                                end=feed.now(), timeframe=timeframe,
                                quote_currency=quote_currency, candles={},
                                starting_equity=starting)
        closes: dict[str, list[Decimal]] = {
            symbol: [c.close for c in candles if c.closes_at <= feed.now()]
            for symbol, candles in series.items()}
        span: dict[str, list[Candle]] = {symbol: [] for symbol in series}
        steps = feed.steps - 1 - feed.cursor
        for index in range(steps):
            for candle in feed.advance():
                span[candle.symbol].append(candle)
                closes[candle.symbol].append(candle.close)
            await venue.match_resting_orders()
            balances = await venue.exchange.fetch_balances()
            held = {symbol: balances[symbol.partition("/")[0]].total
                    for symbol in series if symbol.partition("/")[0] in balances}
            cash = balances[quote_currency].free if quote_currency in balances else Decimal(0)
            view = View(index, steps, closes, held, cash)
            for number, (symbol, side, amount) in enumerate(strategy.decide(view)):
                try:
                    await venue.exchange.create_order(OrderRequest(
                        symbol, side, "market", amount,
                        client_order_id=client_order_id_for(strategy.name, str(index),
                                                            str(number)),
                        turn=f"b{index:06d}"))
                except TradingAgentError:
                    continue  # too small, or no funds: a baseline skips it as a desk would
            valuation = await value_account(venue.exchange, quote_currency, balances)
            total = valuation.total
            cash_value = valuation.by_currency.get(quote_currency, Decimal(0))
            record.equity.append(EquityPoint(
                feed.now(), total, (total - cash_value) / total if total > 0 else Decimal(0)))
        record.end = feed.now()
        record.candles = span
        record.trades = list(await venue.books.trades())
        return record
