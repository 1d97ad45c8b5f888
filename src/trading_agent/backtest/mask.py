"""The mask: a backtest's market seen through a fictitious but consistent world.

A model that reads "BTC/USDT, 2023-01-10, 17,200" may remember what came next. With
``--mask`` the desk reads its market through a view that moves everything it could
recognise:

- **Times** are shifted by a fixed offset, a whole number of weeks (some twenty years on):
  weekdays, times of day and candle boundaries stay as they were, so schedules fire at the
  same moments and a 1d or 1w candle is built from the same 5m ones.
- **Prices** are multiplied by one factor and **base amounts** divided by it, so every value
  in the quote currency (a balance, an order's notional, a fee, a risk limit, the equity)
  reads the same. The factor is a product of powers of 2 and 5 (``6.4``, ``0.032``...): a
  masked amount the model sends back is turned into the real one exactly.
- **Names** are replaced: the symbol becomes ``ASSET/USD`` (``ASSET1/USD``,
  ``ASSET2/USD``... for several), its currencies ``ASSET`` and ``USD``, in the desk's
  prompt, schedules, symbols, tool results, trigger texts, order results, errors and
  operator messages. A real symbol named by the model is refused as unknown.

The view sits between the desk and its venue (:class:`MaskedExchange`, :class:`MaskedFeed`,
:class:`MaskedRisk`, :class:`MaskedBooks`, :class:`MaskedProtection`): the desk is built by
:func:`~trading_agent.desks.building.build_desk` on the masked venue, while the paper
exchange, the risk policy and the books underneath stay real. Orders are turned back into
real terms before any check, so fills, fees, the books and the report are real; only the
decisions' transcripts show what the model read, masked.

What the view does not reach: a cron schedule in a time zone with daylight saving fires at
the same UTC moments, which near a change may read an hour off in the masked year; numbers
inside a free-text error that are neither a name nor
a time (a paper exchange's "insufficient funds" naming a real base amount) and what the
model writes in its own notes (already masked, since it read only masked values).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from decimal import Decimal
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, cast

from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec
from trading_agent.errors import OrderRejectedError, TradingAgentError
from trading_agent.trading.books import BookFill, RoundTrip
from trading_agent.trading.exchange import (
    Balance,
    Candle,
    Fill,
    Market,
    Order,
    OrderBook,
    OrderRequest,
    Position,
    Ticker,
)
from trading_agent.trading.protection import ProtectiveOrder
from trading_agent.trading.protection_keeper import (
    KEEP,
    ProtectionEvent,
    ProtectionKeeper,
    fired_text,
    simulated_how,
)

if TYPE_CHECKING:
    from trading_agent.settings import DeskSettings
    from trading_agent.trading.booked_exchange import BookedExchange
    from trading_agent.trading.config import RiskLimits
    from trading_agent.trading.desk_books import DeskBooks, MarkedPosition, ProfitSummary
    from trading_agent.trading.factory import TradingVenue
    from trading_agent.trading.feed import CandleSubscription, PriceFeed
    from trading_agent.trading.risk import RiskCheck, RiskPolicy

__all__ = ["FACTORS", "Mask", "MaskedBooks", "MaskedExchange", "MaskedFeed", "MaskedModel",
           "MaskedProtection", "MaskedRisk", "choose_mask"]

FACTORS = tuple(Decimal(text) for text in (
    "0.032", "0.064", "0.128", "0.256", "0.32", "3.2", "6.4", "12.8", "25.6", "64"))
"""The price factors a mask picks from: powers of 2 and 5 (exact both ways in decimal), none
a power of ten (a shifted decimal point is no disguise), none near 1 (masked prices never
fall in the real range)."""

_WEEK = timedelta(days=7)
_YEARS_AHEAD = (18, 26)
"""How far the masked world lies ahead, in years (rounded to whole weeks): dates no model
has read about."""
_MASKED_QUOTE = "USD"
_MASKED_BASE = "ASSET"


@dataclass(frozen=True)
class Mask:
    """One masked world: a time offset, a price factor and the names.

    Attributes:
        offset: Added to every real time; a whole number of weeks.
        factor: Prices are multiplied by it, base amounts divided by it.
        symbols: Each real symbol's masked name (``BTC/USDT`` → ``ASSET/USD``).
        currencies: Each real currency's masked name (``BTC`` → ``ASSET``, ``USDT`` →
            ``USD``).
    """

    offset: timedelta
    factor: Decimal
    symbols: Mapping[str, str]
    currencies: Mapping[str, str]

    def __post_init__(self) -> None:
        if self.offset % _WEEK:
            raise ValueError("a mask's time offset must be a whole number of weeks")
        if self.factor <= 0:
            raise ValueError("a mask's price factor must be positive")
        real = {**self.symbols, **self.currencies}
        names = sorted(real, key=len, reverse=True)
        object.__setattr__(self, "_names", re.compile(
            r"(?<![A-Za-z0-9])(" + "|".join(re.escape(n) for n in names) + r")(?![A-Za-z0-9])")
            if names else None)
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_unmasked",
                           {masked: name for name, masked in self.symbols.items()})

    # ------------------------------------------------------------------ values

    def time(self, moment: datetime) -> datetime:
        """A real time, masked."""
        return moment + self.offset

    def real_time(self, moment: datetime) -> datetime:
        """A masked time, real."""
        return moment - self.offset

    def price(self, value: Decimal) -> Decimal:
        """A real price, masked."""
        return value * self.factor

    def real_price(self, value: Decimal) -> Decimal:
        """A masked price, real."""
        return value / self.factor

    def amount(self, value: Decimal) -> Decimal:
        """A real base amount, masked."""
        return value / self.factor

    def real_amount(self, value: Decimal) -> Decimal:
        """A masked base amount, real."""
        return value * self.factor

    def symbol(self, name: str) -> str:
        """A real symbol's masked name (an unknown one as it is)."""
        return self.symbols.get(name, name)

    def real_symbol(self, name: str) -> str:
        """A masked symbol's real name.

        Raises:
            OrderRejectedError: ``name`` is a real symbol: in the masked world no such
                market exists.
        """
        unmasked: dict[str, str] = self.__dict__["_unmasked"]
        if name in unmasked:
            return unmasked[name]
        if name in self.symbols:
            # Not named back: the message goes through the mask, which would rename it.
            raise OrderRejectedError("no such market; the markets are "
                                     f"{', '.join(self.symbols.values())}")
        return name

    def currency(self, code: str) -> str:
        """A real currency's masked code."""
        return self.currencies.get(code, code)

    def is_base(self, code: str) -> bool:
        """Whether a real currency is some symbol's base (its amounts are scaled)."""
        return any(symbol.partition("/")[0] == code for symbol in self.symbols)

    def money(self, value: Decimal, currency: str | None) -> Decimal:
        """A real amount of ``currency`` (a fee, a balance), masked."""
        return self.amount(value) if currency is not None and self.is_base(currency) else value

    def text(self, text: str) -> str:
        """Free text with every real symbol and currency name replaced."""
        pattern: re.Pattern[str] | None = self.__dict__["_names"]
        if pattern is None:
            return text
        real: dict[str, str] = self.__dict__["_real"]
        return pattern.sub(lambda match: real[match.group(1)], text)

    # ------------------------------------------------------------------ records

    def candle(self, candle: Candle) -> Candle:
        """A real candle, masked."""
        return replace(candle, symbol=self.symbol(candle.symbol),
                       opened_at=self.time(candle.opened_at), open=self.price(candle.open),
                       high=self.price(candle.high), low=self.price(candle.low),
                       close=self.price(candle.close), volume=self.amount(candle.volume))

    def ticker(self, ticker: Ticker) -> Ticker:
        """A real ticker, masked."""
        return replace(ticker, symbol=self.symbol(ticker.symbol), last=self.price(ticker.last),
                       at=self.time(ticker.at), bid=_maybe(self.price, ticker.bid),
                       ask=_maybe(self.price, ticker.ask),
                       volume_24h=_maybe(self.amount, ticker.volume_24h))

    def order_book(self, book: OrderBook) -> OrderBook:
        """A real order book, masked."""
        def side(levels: tuple[tuple[Decimal, Decimal], ...]
                 ) -> tuple[tuple[Decimal, Decimal], ...]:
            return tuple((self.price(price), self.amount(amount)) for price, amount in levels)

        return replace(book, symbol=self.symbol(book.symbol), bids=side(book.bids),
                       asks=side(book.asks), at=self.time(book.at))

    def market(self, market: Market) -> Market:
        """A real market, masked."""
        return replace(market, symbol=self.symbol(market.symbol),
                       base=self.currency(market.base), quote=self.currency(market.quote),
                       amount_step=_maybe(self.amount, market.amount_step),
                       price_step=_maybe(self.price, market.price_step),
                       min_amount=_maybe(self.amount, market.min_amount))

    def balance(self, balance: Balance) -> Balance:
        """A real balance, masked."""
        return Balance(self.currency(balance.currency),
                       self.money(balance.free, balance.currency),
                       self.money(balance.used, balance.currency))

    def position(self, position: Position) -> Position:
        """A real position, masked."""
        return replace(position, symbol=self.symbol(position.symbol),
                       amount=self.amount(position.amount),
                       mark_price=self.price(position.mark_price),
                       entry_price=_maybe(self.price, position.entry_price))

    def order(self, order: Order) -> Order:
        """A real order, masked."""
        return replace(order, symbol=self.symbol(order.symbol), amount=self.amount(order.amount),
                       price=_maybe(self.price, order.price), filled=self.amount(order.filled),
                       average=_maybe(self.price, order.average),
                       fee=self.money(order.fee, order.fee_currency),
                       fee_currency=_maybe(self.currency, order.fee_currency),
                       created_at=self.time(order.created_at))

    def fill(self, fill: Fill) -> Fill:
        """A real fill, masked."""
        return replace(fill, symbol=self.symbol(fill.symbol), amount=self.amount(fill.amount),
                       price=self.price(fill.price), fee=self.money(fill.fee, fill.fee_currency),
                       fee_currency=self.currency(fill.fee_currency), at=self.time(fill.at))

    def book_fill(self, fill: BookFill) -> BookFill:
        """A fill of the books, masked (its quote fee stays)."""
        return replace(fill, symbol=self.symbol(fill.symbol), amount=self.amount(fill.amount),
                       price=self.price(fill.price), at=self.time(fill.at))

    def round_trip(self, trip: RoundTrip) -> RoundTrip:
        """A round trip of the books, masked (its profit and fees, in the quote currency,
        stay)."""
        return replace(trip, symbol=self.symbol(trip.symbol), opened_at=self.time(trip.opened_at),
                       amount=self.amount(trip.amount), entry_price=self.price(trip.entry_price),
                       closed_at=_maybe(self.time, trip.closed_at),
                       exit_price=_maybe(self.price, trip.exit_price),
                       exited=self.amount(trip.exited))

    def protective_order(self, order: ProtectiveOrder, note: str | None = None
                         ) -> ProtectiveOrder:
        """A stop or target of the desk, masked (``note``, when given, replaces its note:
        a text the caller has said again in masked terms)."""
        return replace(order, symbol=self.symbol(order.symbol),
                       trigger_price=self.price(order.trigger_price),
                       created_at=self.time(order.created_at), amount=self.amount(order.amount),
                       checked_until=_maybe(self.time, order.checked_until),
                       exit_price=_maybe(self.price, order.exit_price),
                       note=note if note is not None else _maybe(self.text, order.note))

    def protection_event(self, event: ProtectionEvent, desk: str) -> ProtectionEvent:
        """What the desk is told of its protection, masked: a simulated fill is said again
        from its masked order and candle; any other text has its names masked."""
        if event.what == "fired" and event.candle_at is not None:
            candle_at = self.time(event.candle_at)
            order = self.protective_order(event.order, note=simulated_how(candle_at))
            return replace(event, order=order, candle_at=candle_at,
                           text=fired_text(desk, order, event.profit, event.while_down))
        return replace(event, order=self.protective_order(event.order),
                       text=self.text(event.text))

    def real_request(self, request: OrderRequest) -> OrderRequest:
        """An order the desk asks for in masked terms, in real ones (exactly: the factor is
        a product of powers of 2 and 5)."""
        return replace(request, symbol=self.real_symbol(request.symbol),
                       amount=self.real_amount(request.amount),
                       price=_maybe(self.real_price, request.price))

    def limits(self, limits: RiskLimits) -> RiskLimits:
        """Risk limits as the desk reads them: the same numbers (they are in the quote
        currency), masked names."""
        return limits.model_copy(update={
            "allowed_symbols": [self.symbol(s) for s in limits.allowed_symbols],
            "quote_currency": self.currency(limits.quote_currency)})

    def desk_settings(self, config: DeskSettings) -> DeskSettings:
        """A desk's settings as its masked self is built from: its symbols, prompt, pinned
        instructions, schedule messages and subagents' prompts in masked names (its
        exchange, risk limits and model unchanged: the venue is built from the real ones)."""
        triggers = config.triggers.model_copy(update={"schedules": [
            schedule.model_copy(update={"message": self.text(schedule.message)})
            for schedule in config.triggers.schedules]})
        subagents = config.subagents.model_copy(update={
            "system_prompt": self.text(config.subagents.system_prompt)})
        return config.model_copy(update={
            "symbols": [self.symbol(s) for s in config.symbols],
            "system_prompt": self.text(config.system_prompt),
            "pinned": [self.text(text) for text in config.pinned],
            "triggers": triggers, "subagents": subagents})

    def venue(self, venue: TradingVenue) -> TradingVenue:
        """The desk's venue seen through the mask: its exchange, feed, risk policy and books
        masked; what matches paper orders (and the books under it) real."""
        exchange = MaskedExchange(venue.exchange, self)
        risk = None if venue.risk is None else MaskedRisk(venue.risk, exchange, self)
        # The desk is built on these views: build_desk and the tools read them through the
        # Exchange protocol and the few methods the views carry, never the classes' insides.
        protection = None if venue.protection is None else MaskedProtection(
            venue.protection, self)
        return replace(venue, exchange=cast("BookedExchange", exchange),
                       feed=MaskedFeed(venue.feed, self),
                       risk=cast("RiskPolicy | None", risk),
                       books=cast("DeskBooks", MaskedBooks(venue.books, self)),
                       protection=cast("ProtectionKeeper | None", protection))

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Masks the names in the message of an error raised inside."""
        try:
            yield
        except TradingAgentError as exc:
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (self.text(exc.args[0]), *exc.args[1:])
            raise


def _maybe(function: Callable[[Any], Any], value: Any) -> Any:
    return None if value is None else function(value)


def choose_mask(symbols: Sequence[str], start: datetime, seed: int = 0,
                factor: Decimal | None = None) -> Mask:
    """A mask for a desk's symbols, from a seed.

    Args:
        symbols: The desk's real symbols (``BTC/USDT``).
        start: The span's start: the masked world lies 18 to 26 years after it.
        seed: Picks the offset and the factor.
        factor: A price factor to use instead of a picked one.

    Returns:
        The mask.
    """
    rng = random.Random(f"mask {seed}")
    years = rng.randint(*_YEARS_AHEAD)
    weeks = round(years * 365.25 / 7)
    chosen = factor if factor is not None else rng.choice(FACTORS)
    many = len(symbols) > 1
    bases: dict[str, str] = {}
    quotes: dict[str, str] = {}
    names: dict[str, str] = {}
    for symbol in symbols:
        base, _, quote = symbol.partition("/")
        if base not in bases:
            bases[base] = f"{_MASKED_BASE}{len(bases) + 1}" if many else _MASKED_BASE
        if quote not in quotes:
            quotes[quote] = (_MASKED_QUOTE if not quotes
                             else f"{_MASKED_QUOTE}{len(quotes) + 1}")
        names[symbol] = f"{bases[base]}/{quotes[quote]}"
    del start  # the offset is relative: the same seed masks any span alike
    return Mask(weeks * _WEEK, chosen, names, {**bases, **quotes})


class MaskedExchange:
    """The desk's exchange seen through a :class:`Mask`: what it reads masked, what it
    sends turned real first."""

    def __init__(self, inner: BookedExchange, mask: Mask) -> None:
        self.inner = inner
        self.mask = mask

    @property
    def name(self) -> str:
        """The exchange's name."""
        return self.inner.name

    @property
    def on_fill(self) -> Callable[[BookFill], object] | None:
        """What each fill the books count is announced to (masked)."""
        return self.inner.on_fill

    @on_fill.setter
    def on_fill(self, callback: Callable[[BookFill], object] | None) -> None:
        mask = self.mask
        self.inner.on_fill = None if callback is None else (
            lambda fill: callback(mask.book_fill(fill)))

    def now(self) -> datetime:
        """The masked clock."""
        return self.mask.time(self.inner.now())

    async def markets(self) -> Mapping[str, Market]:
        """The tradable markets, masked."""
        with self.mask.errors():
            markets = await self.inner.markets()
        return {self.mask.symbol(symbol): self.mask.market(market)
                for symbol, market in markets.items()}

    async def fetch_ticker(self, symbol: str) -> Ticker:
        """The latest price, masked."""
        with self.mask.errors():
            return self.mask.ticker(await self.inner.fetch_ticker(self.mask.real_symbol(symbol)))

    async def fetch_order_book(self, symbol: str, limit: int = 10) -> OrderBook:
        """The best levels, masked."""
        with self.mask.errors():
            return self.mask.order_book(await self.inner.fetch_order_book(
                self.mask.real_symbol(symbol), limit))

    async def fetch_candles(self, symbol: str, timeframe: str = "5m", limit: int = 100,
                            since: datetime | None = None) -> Sequence[Candle]:
        """Candles, masked."""
        with self.mask.errors():
            candles = await self.inner.fetch_candles(
                self.mask.real_symbol(symbol), timeframe, limit,
                _maybe(self.mask.real_time, since))
        return [self.mask.candle(candle) for candle in candles]

    async def fetch_balances(self) -> Mapping[str, Balance]:
        """The balances, masked."""
        with self.mask.errors():
            balances = await self.inner.fetch_balances()
        return {self.mask.currency(code): self.mask.balance(balance)
                for code, balance in balances.items()}

    async def fetch_positions(self, symbols: Sequence[str] | None = None) -> Sequence[Position]:
        """The desk's positions, masked."""
        with self.mask.errors():
            real = None if symbols is None else [self.mask.real_symbol(s) for s in symbols]
            return [self.mask.position(p) for p in await self.inner.fetch_positions(real)]

    async def fetch_open_orders(self, symbol: str | None = None) -> Sequence[Order]:
        """Resting orders, masked."""
        with self.mask.errors():
            orders = await self.inner.fetch_open_orders(_maybe(self.mask.real_symbol, symbol))
        return [self.mask.order(order) for order in orders]

    async def create_order(self, request: OrderRequest) -> Order:
        """Places a masked order, in real terms."""
        with self.mask.errors():
            return self.mask.order(await self.inner.create_order(
                self.mask.real_request(request)))

    async def cancel_order(self, order_id: str, symbol: str) -> Order:
        """Cancels an order."""
        with self.mask.errors():
            return self.mask.order(await self.inner.cancel_order(
                order_id, self.mask.real_symbol(symbol)))

    async def fetch_order(self, order_id: str, symbol: str) -> Order:
        """An order, masked."""
        with self.mask.errors():
            return self.mask.order(await self.inner.fetch_order(
                order_id, self.mask.real_symbol(symbol)))

    async def fetch_order_by_client_id(self, client_order_id: str, symbol: str) -> Order:
        """An order by client order id, masked."""
        with self.mask.errors():
            return self.mask.order(await self.inner.fetch_order_by_client_id(
                client_order_id, self.mask.real_symbol(symbol)))

    async def refresh(self) -> list[BookFill]:
        """The books' look at the desk's orders (on each candle), masked."""
        return [self.mask.book_fill(fill) for fill in await self.inner.refresh()]

    def take_fresh(self) -> list[BookFill]:
        """The fills counted since the last refresh, masked."""
        return [self.mask.book_fill(fill) for fill in self.inner.take_fresh()]

    async def close(self) -> None:
        """Nothing: the real exchange is closed by whoever opened it."""


class MaskedRisk:
    """The desk's risk policy seen through a :class:`Mask`: orders are checked, and placed,
    in real terms by the real policy."""

    def __init__(self, inner: RiskPolicy, exchange: MaskedExchange, mask: Mask) -> None:
        self.inner = inner
        self.exchange = exchange
        self.mask = mask
        self.limits = mask.limits(inner.limits)
        self.kill_switch = inner.kill_switch
        # The desk's protections count its tool errors through the real policy's guard.
        self.protections = inner.protections

    @property
    def desk(self) -> str:
        """The desk's name."""
        return self.inner.desk

    @property
    def max_place_seconds(self) -> float:
        """The longest placing an order may take."""
        return self.inner.max_place_seconds

    async def check(self, request: OrderRequest) -> RiskCheck:
        """Checks a masked order against the real limits."""
        with self.mask.errors():
            return await self.inner.check(self.mask.real_request(request))

    async def place_order(self, request: OrderRequest) -> Order:
        """Checks and places a masked order, in real terms."""
        with self.mask.errors():
            return self.mask.order(await self.inner.place_order(
                self.mask.real_request(request)))

    async def observe(self) -> object:
        """The real policy records the day."""
        return await self.inner.observe()

    async def describe(self) -> str:
        """The limits and the day, masked names."""
        return self.mask.text(await self.inner.describe())

    async def cancel_open_orders(self) -> tuple[list[Order], list[str]]:
        """Cancels the desk's open orders."""
        orders, problems = await self.inner.cancel_open_orders()
        return [self.mask.order(o) for o in orders], [self.mask.text(p) for p in problems]

    async def flatten(self) -> tuple[list[Order], list[str]]:
        """Closes the desk's positions."""
        orders, problems = await self.inner.flatten()
        return [self.mask.order(o) for o in orders], [self.mask.text(p) for p in problems]


class MaskedProtection:
    """The desk's protection keeper seen through a :class:`Mask`: the stops and targets the
    desk sets are turned into real terms, kept and fired by the real keeper on the real
    candles; what the desk reads of them and is told when one fires, masked."""

    def __init__(self, inner: ProtectionKeeper, mask: Mask) -> None:
        self.inner = inner
        self.mask = mask
        self._on_event: Callable[[ProtectionEvent], object] | None = None

    @property
    def on_event(self) -> Callable[[ProtectionEvent], object] | None:
        """Called with each event, masked."""
        return self._on_event

    @on_event.setter
    def on_event(self, callback: Callable[[ProtectionEvent], object] | None) -> None:
        self._on_event = callback
        self.inner.on_event = None if callback is None else (
            lambda event: callback(self.mask.protection_event(event, self.inner.desk)))

    def _real(self, price: Decimal | Literal["keep"] | None) -> Decimal | Literal["keep"] | None:
        return self.mask.real_price(price) if isinstance(price, Decimal) else price

    async def attach(self, entry: OrderRequest, stop_loss: Decimal | None,
                     take_profit: Decimal | None) -> list[ProtectiveOrder]:
        """Stores a masked entry's protection, in real terms."""
        with self.mask.errors():
            stored = await self.inner.attach(self.mask.real_request(entry),
                                             _maybe(self.mask.real_price, stop_loss),
                                             _maybe(self.mask.real_price, take_profit))
        return [self.mask.protective_order(order) for order in stored]

    async def entry_refused(self, entry: OrderRequest) -> None:
        """A masked entry was refused: its protection goes."""
        await self.inner.entry_refused(self.mask.real_request(entry))

    async def set(self, symbol: str, *, stop_loss: Decimal | Literal["keep"] | None = KEEP,
                  take_profit: Decimal | Literal["keep"] | None = KEEP,
                  ) -> list[ProtectiveOrder]:
        """Sets, moves or removes a masked market's protection, in real terms."""
        with self.mask.errors():
            live = await self.inner.set(self.mask.real_symbol(symbol),
                                        stop_loss=self._real(stop_loss),
                                        take_profit=self._real(take_profit))
        return [self.mask.protective_order(order) for order in live]

    async def live(self, symbol: str | None = None) -> list[ProtectiveOrder]:
        """The live stops and targets (of a masked market), masked."""
        real = None if symbol is None else self.mask.real_symbol(symbol)
        return [self.mask.protective_order(order) for order in await self.inner.live(real)]

    async def step(self) -> list[ProtectionEvent]:
        """The real keeper's step; what happened, masked."""
        with self.mask.errors():
            events = await self.inner.step()
        return [self.mask.protection_event(event, self.inner.desk) for event in events]


class MaskedBooks:
    """The desk's books as it reads them through a :class:`Mask` (its trade record)."""

    def __init__(self, inner: DeskBooks, mask: Mask) -> None:
        self.inner = inner
        self.mask = mask

    @property
    def desk(self) -> str:
        """The desk's name."""
        return self.inner.desk

    async def trades(self, since: datetime | None = None, *,
                     open_only: bool = False) -> list[RoundTrip]:
        """Its round trips, masked."""
        trips = await self.inner.trades(_maybe(self.mask.real_time, since), open_only=open_only)
        return [self.mask.round_trip(trip) for trip in trips]

    async def fills(self, since: datetime | None = None) -> list[BookFill]:
        """Its fills, masked."""
        fills = await self.inner.fills(_maybe(self.mask.real_time, since))
        return [self.mask.book_fill(fill) for fill in fills]

    async def positions(self) -> list[MarkedPosition]:
        """Its positions, masked."""
        mask = self.mask
        return [replace(p, mark=_maybe(mask.price, p.mark), position=replace(
            p.position, symbol=mask.symbol(p.position.symbol),
            amount=mask.amount(p.position.amount),
            entry_price=_maybe(mask.price, p.position.entry_price),
            opened_at=_maybe(mask.time, p.position.opened_at)))
            for p in await self.inner.positions()]

    async def summary(self) -> ProfitSummary:
        """Its profit (in the quote currency: unchanged)."""
        return await self.inner.summary()


class MaskedFeed:
    """The desk's price feed seen through a :class:`Mask`, for its market watcher."""

    def __init__(self, inner: PriceFeed, mask: Mask) -> None:
        self.inner = inner
        self.mask = mask

    @property
    def timeframe(self) -> str:
        """The feed's own timeframe."""
        return self.inner.timeframe

    @property
    def symbols(self) -> Sequence[str]:
        """The masked symbols."""
        return [self.mask.symbol(symbol) for symbol in self.inner.symbols]

    def now(self) -> datetime:
        """The masked clock."""
        return self.mask.time(self.inner.now())

    async def ticker(self, symbol: str) -> Ticker:
        """The latest price, masked."""
        with self.mask.errors():
            return self.mask.ticker(await self.inner.ticker(self.mask.real_symbol(symbol)))

    async def candles(self, symbol: str, timeframe: str | None = None, limit: int | None = None,
                      since: datetime | None = None) -> Sequence[Candle]:
        """Candles, masked."""
        with self.mask.errors():
            candles = await self.inner.candles(self.mask.real_symbol(symbol), timeframe, limit,
                                               _maybe(self.mask.real_time, since))
        return [self.mask.candle(candle) for candle in candles]

    async def order_book(self, symbol: str, limit: int) -> OrderBook | None:
        """The real order book, masked (None on a replay)."""
        book = await self.inner.order_book(self.mask.real_symbol(symbol), limit)
        return None if book is None else self.mask.order_book(book)

    def subscribe(self) -> CandleSubscription:
        """New candles, masked."""
        return _MaskedSubscription(self.inner.subscribe(), self.mask)

    async def close(self) -> None:
        """Nothing: the real feed is closed by whoever opened it."""


class _MaskedSubscription:
    def __init__(self, inner: CandleSubscription, mask: Mask) -> None:
        self._inner = inner
        self._mask = mask

    def __aiter__(self) -> _MaskedSubscription:
        return self

    async def __anext__(self) -> Candle:
        return self._mask.candle(await self._inner.__anext__())

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> _MaskedSubscription:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._inner.close()


class MaskedModel:
    """The desk's model, asked with the tool definitions' own words masked too (a
    parameter's description names an example market, ``BTC/USDT``): everything else a
    request holds is already masked by the venue's view.

    Args:
        inner: The model (the response cache over it).
        mask: The mask.
    """

    def __init__(self, inner: ModelBackend, mask: Mask) -> None:
        self.inner = inner
        self.mask = mask
        self.model = inner.model
        self.context_window = inner.context_window
        self._definitions: dict[str, list[dict[str, Any]]] = {}

    def __getattr__(self, name: str) -> Any:
        # What a backend may offer beyond the protocol (count_tokens, config).
        return getattr(self.inner, name)

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        """Asks the model with masked tool definitions."""
        return await self.inner.complete(replace(request, tools=self._tools(request.tools)),
                                         on_text, on_thinking)

    def _tools(self, tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        text = json.dumps(list(tools))
        masked = self._definitions.get(text)
        if masked is None:
            masked = self._definitions[text] = json.loads(self.mask.text(text))
        return masked
