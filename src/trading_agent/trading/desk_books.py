"""A desk's books as operators and the model read them: positions marked at the market, the
record of round trips, profit today and all time.

:class:`DeskBooks` joins the desk's records in the store
(:class:`~trading_agent.trading.books.DeskBookRecords`) to the exchange's prices. Every
figure is the desk's own: on an account shared with other desks (or holding the user's own
coins) nothing here counts what the desk did not trade itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from trading_agent.errors import ExchangeError
from trading_agent.trading.books import (
    ZERO,
    BookFill,
    BookOrder,
    BookPosition,
    DayProfit,
    DeskBookRecords,
    RoundTrip,
)
from trading_agent.trading.exchange import Exchange
from trading_agent.trading.valuation import Valuation, convert

__all__ = ["DeskBooks", "MarkedPosition", "ProfitSummary"]


@dataclass(frozen=True, slots=True)
class MarkedPosition:
    """A desk's open position, valued at the market.

    Attributes:
        position: The position as the books hold it.
        mark: The last price (None when the exchange could not be asked).
        unrealized: Profit at ``mark`` (None without a mark).
    """

    position: BookPosition
    mark: Decimal | None
    unrealized: Decimal | None

    @property
    def notional(self) -> Decimal | None:
        """The position's value at the mark, in the quote currency."""
        return None if self.mark is None else abs(self.position.amount) * self.mark


@dataclass(frozen=True, slots=True)
class ProfitSummary:
    """A desk's profit, today (UTC) and all time, in the quote currency.

    Attributes:
        realized_today: Realized today, quote fees subtracted.
        realized_total: Realized all time.
        unrealized: Of what is held now, at the marks (None when a mark is missing).
        fees_total: Quote fees paid all time.
        trades_closed: Round trips closed, all time.
        wins: Of those, how many made a profit.
        open_trades: Round trips open now.
    """

    realized_today: Decimal
    realized_total: Decimal
    unrealized: Decimal | None
    fees_total: Decimal
    trades_closed: int
    wins: int
    open_trades: int

    @property
    def win_rate(self) -> float | None:
        """Wins over closed round trips (None before any closed)."""
        return self.wins / self.trades_closed if self.trades_closed else None


class DeskBooks:
    """A desk's books, read with the exchange's marks.

    Args:
        records: The desk's records in the store.
        exchange: Where marks come from (the desk's own exchange).
        clock: The exchange clock (replayed time in a backtest).
    """

    def __init__(self, records: DeskBookRecords, exchange: Exchange,
                 clock: Callable[[], datetime] | None = None) -> None:
        self.records = records
        self._exchange = exchange
        self._clock = clock or exchange.now

    @property
    def desk(self) -> str:
        """The desk."""
        return self.records.desk

    async def positions(self) -> list[MarkedPosition]:
        """The open positions, by symbol, each marked at its last price."""
        held = [p for p in (await self.records.positions()).values() if p.amount != 0]
        marked = []
        for position in sorted(held, key=lambda p: p.symbol):
            mark = await self._mark(position.symbol)
            marked.append(MarkedPosition(
                position, mark, None if mark is None else position.unrealized(mark)))
        return marked

    async def held(self, symbol: str) -> Decimal:
        """The desk's signed amount of ``symbol`` (0 when it holds none)."""
        position = (await self.records.positions()).get(symbol)
        return position.amount if position is not None else ZERO

    async def holdings(self) -> dict[str, Decimal]:
        """The desk's signed amount of each symbol it holds (flat ones left out)."""
        return {symbol: position.amount
                for symbol, position in (await self.records.positions()).items()
                if position.amount != 0}

    async def orders(self, *, open_only: bool = True) -> list[BookOrder]:
        """The desk's orders (those that may still fill, by default)."""
        return await self.records.orders(open_only=open_only)

    async def fills(self, since: datetime | None = None) -> list[BookFill]:
        """The desk's fills, oldest first."""
        return await self.records.fills(since)

    async def trades(self, since: datetime | None = None, *,
                     open_only: bool = False) -> list[RoundTrip]:
        """The desk's round trips, oldest first."""
        return await self.records.trades(since, open_only=open_only)

    async def daily(self, since: date | None = None) -> list[DayProfit]:
        """Realized profit by UTC day."""
        return await self.records.daily(since)

    async def weekly(self, since: date | None = None) -> list[DayProfit]:
        """Realized profit by ISO week, each dated by its Monday."""
        weeks: dict[date, DayProfit] = {}
        for day in await self.records.daily(since):
            monday = day.day - timedelta(days=day.day.weekday())
            seen = weeks.get(monday) or DayProfit(monday, ZERO, ZERO, 0, 0)
            weeks[monday] = DayProfit(monday, seen.realized + day.realized,
                                      seen.fees + day.fees, seen.fills + day.fills,
                                      seen.trades_closed + day.trades_closed)
        return [weeks[key] for key in sorted(weeks)]

    async def summary(self) -> ProfitSummary:
        """Profit today and all time, and what is held now at the marks."""
        today = self._clock().astimezone(UTC).date()
        positions = await self.records.positions()
        days = await self.records.daily(today)
        trades = await self.records.trades()
        closed = [t for t in trades if not t.is_open]
        unrealized: Decimal | None = ZERO
        for marked in await self.positions():
            if marked.unrealized is None or unrealized is None:
                unrealized = None
            else:
                unrealized += marked.unrealized
        return ProfitSummary(
            realized_today=sum((d.realized for d in days if d.day == today), ZERO),
            realized_total=sum((p.realized for p in positions.values()), ZERO),
            unrealized=unrealized,
            fees_total=sum((p.fees for p in positions.values()), ZERO),
            trades_closed=len(closed),
            wins=sum(1 for t in closed if t.profit > 0),
            open_trades=len(trades) - len(closed))

    async def equity(self, currency: str) -> Valuation:
        """The desk's own equity by its books, in ``currency``: every market's realized
        profit (fees subtracted) plus what is held now at its mark, less fees paid in other
        currencies at their price now. It starts at 0 with the desk's first fill and moves
        only with the desk's own fills and the marks of what it holds: another desk's trades
        and the price of coins no desk bought (the user's own) never move it.

        Returns:
            A valuation on the ``books`` basis; a market without a mark, or whose quote (or
            fee currency) cannot be valued in ``currency``, is listed in ``unpriced`` and left
            out of the total.
        """
        by_market: dict[str, Decimal] = {}
        unpriced: list[str] = []
        for symbol, position in sorted((await self.records.positions()).items()):
            value: Decimal | None = position.realized
            if position.amount != 0:
                mark = await self._mark(symbol)
                value = None if mark is None else position.realized + position.unrealized(mark)
            if value is not None:
                value = await convert(self._exchange, value,
                                      symbol.partition("/")[2].partition(":")[0], currency)
            for fee_currency, fee in sorted(position.other_fees.items()):
                fee_value = await convert(self._exchange, fee, fee_currency, currency)
                value = None if value is None or fee_value is None else value - fee_value
            if value is None:
                unpriced.append(symbol)
            else:
                by_market[symbol] = value
        return Valuation(currency, sum(by_market.values(), ZERO), by_market, tuple(unpriced),
                         basis="books")

    async def _mark(self, symbol: str) -> Decimal | None:
        try:
            return (await self._exchange.fetch_ticker(symbol)).last
        except ExchangeError:
            return None
