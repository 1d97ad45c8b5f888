"""Keeping a desk's protective orders: placed where the venue can hold them, fired, and
one-cancels-other kept.

:class:`ProtectionKeeper` works on the desk's :class:`~trading_agent.trading.booked_exchange.
BookedExchange`, so every order it sends is noted in the desk's books before it is sent
(its turn is ``stop_loss`` or ``take_profit``, which becomes the round trip's exit reason)
and every fill is counted once. :meth:`ProtectionKeeper.step` runs on each new candle, after
the venue's matching (and once at start, where it finds what fired while the daemon was
down):

1. a pending protection whose entry filled becomes active, covering the desk's position;
   one whose entry will never fill is cancelled;
2. an active one on a position that closed otherwise, or turned, is cancelled;
3. ``simulated`` (paper, backtests): the candles completed since it was last checked fire
   it by :func:`~trading_agent.trading.protection.first_exit`; its exit is a market order
   the paper exchange fills at that price;
4. ``exchange``: placed if it is not yet (a stop-limit order with ccxt's unified
   ``stopLossPrice`` / ``takeProfitPrice``), replaced when the position's size changed, and
   looked at: filled, it is the trade's exit; cancelled by the exchange, the daemon watches
   it instead. An exchange that refuses the order (a spot venue whose coins the stop
   already holds refuses a second sell) leaves it to the daemon to watch;
5. ``daemon``: the last price crossing it sends a market order.

When one side fills, the other side is cancelled (on the exchange, or in the records).
Before any other order that reduces a position, the exchange-held protection of that
market is cancelled (a spot venue holds the coins for it), and placed again on the next
step for what is left.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Final, Literal

import structlog

from trading_agent.errors import ExchangeError, OrderRejectedError
from trading_agent.trading.booked_exchange import BookedExchange
from trading_agent.trading.books import PROTECTION_TURNS, BookPosition
from trading_agent.trading.exchange import (
    Order,
    OrderRequest,
    OrderSide,
    ProtectionKind,
    client_order_id_for,
    timeframe_delta,
)
from trading_agent.trading.feed import PriceFeed
from trading_agent.trading.formatting import format_amount, format_price
from trading_agent.trading.protection import (
    ProtectionHeld,
    ProtectionRecords,
    ProtectiveOrder,
    first_exit,
)

__all__ = ["KEEP", "STOP_LIMIT_ALLOWANCE", "ProtectionEvent", "ProtectionKeeper", "SimulatedFills",
           "fired_text", "simulated_how"]

_log = structlog.get_logger(__name__)

STOP_LIMIT_ALLOWANCE = Decimal("0.005")
"""How far past its trigger the limit price of an exchange-held stop goes (0.5%): a spot
venue such as Binance holds a stop only as a stop-limit order, and the allowance lets it
fill when the market moves fast. A gap past the limit leaves it resting unfilled."""

KEEP: Final = "keep"
"""For :meth:`ProtectionKeeper.set`: leave that side as it is."""


class SimulatedFills:
    """What a simulating venue (the paper exchange on its feed) offers the keeper: the
    candles that fire protection, and a fill at a price the candles decided.

    Args:
        fill_at: The paper exchange's ``execute_at``.
        feed: The paper exchange's feed; every candle since a protection was last checked
            is read (``since`` without a limit), however long the daemon was down.
    """

    def __init__(self, fill_at: Callable[[OrderRequest, Decimal, datetime], Awaitable[Order]],
                 feed: PriceFeed) -> None:
        self.fill_at = fill_at
        self.feed = feed
        self.step = timeframe_delta(feed.timeframe)


@dataclass(frozen=True)
class ProtectionEvent:
    """Something a desk and its operators are told about its protection.

    Attributes:
        what: ``fired`` (it closed the position), ``watched`` (the exchange cannot hold it:
            the daemon watches the price), ``lost`` (the exchange cancelled it).
        order: The protective order.
        text: One line saying it.
        profit: The round trip's profit, when ``fired`` closed it.
        while_down: Found at start: it fired while the daemon was not running.
        candle_at: The opening of the candle it fired on (simulated), so a view of the
            market in other terms (a masked backtest's) can say it again in its own.
    """

    what: Literal["fired", "watched", "lost"]
    order: ProtectiveOrder
    text: str
    profit: Decimal | None = None
    while_down: bool = False
    candle_at: datetime | None = None


def simulated_how(candle_at: datetime) -> str:
    """How a simulated stop or target fired: on which candle."""
    return f"fired on the candle of {candle_at:%Y-%m-%d %H:%M} UTC"


def fired_text(desk: str, done: ProtectiveOrder, profit: Decimal | None,
               while_down: bool) -> str:
    """The line a desk and its operators read when a stop or target closed its position
    (``done``: filled, its amount, exit price and how in its note)."""
    quote = done.symbol.partition("/")[2].partition(":")[0]
    base = done.symbol.partition("/")[0]
    price = done.exit_price
    text = (f"{desk}: the {done.title} closed {done.amount} {base} at "
            f"{format_price(price) if price is not None else '?'} ({done.note})")
    if profit is not None:
        text += f"; the trade's profit {'+' if profit >= 0 else ''}" \
                f"{format_amount(profit, quote)}"
    if while_down:
        text += "; it fired while the daemon was not running and is booked now"
    return text + "."


def _exit_side(amount: Decimal) -> OrderSide:
    return "sell" if amount > 0 else "buy"


class ProtectionKeeper:
    """One desk's protective orders on its venue.

    Args:
        exchange: The desk's exchange (its books kept on the way through).
        records: Its protective orders in the store.
        simulated: For a paper venue, how its exits fill; None on a live venue.
        can_hold: On a live venue, whether the exchange can hold a protective order of a
            kind (ccxt's ``has`` flags).
    """

    def __init__(self, exchange: BookedExchange, records: ProtectionRecords, *,
                 simulated: SimulatedFills | None = None,
                 can_hold: Callable[[ProtectionKind], bool] | None = None) -> None:
        self.exchange = exchange
        self.records = records
        self.simulated = simulated
        self.can_hold = can_hold or (lambda kind: False)
        self.on_event: Callable[[ProtectionEvent], object] | None = None
        """Called with each event as it happens (the daemon tells the desk and operators)."""
        self._started = False
        exchange.before_order = self.before_order

    @property
    def desk(self) -> str:
        """The desk."""
        return self.records.desk

    def _held_for(self, kind: ProtectionKind) -> ProtectionHeld:
        if self.simulated is not None:
            return "simulated"
        return "exchange" if self.can_hold(kind) else "daemon"

    # ------------------------------------------------------------------ setting

    async def attach(self, entry: OrderRequest, stop_loss: Decimal | None,
                     take_profit: Decimal | None) -> list[ProtectiveOrder]:
        """Stores the protection an entry comes with, before the entry is sent; it waits
        for the entry to fill.

        Returns:
            The stored protective orders (pending).
        """
        exit_side: OrderSide = "sell" if entry.side == "buy" else "buy"
        # The same call run again (a retried tool call) stores nothing twice.
        known = {o.client_order_id: o for o in await self.records.history(1000)}
        stored = []
        for kind, price in (("stop_loss", stop_loss), ("take_profit", take_profit)):
            if price is None:
                continue
            client_order_id = client_order_id_for(self.desk, entry.client_order_id, kind)
            if client_order_id in known:
                stored.append(known[client_order_id])
                continue
            stored.append(await self.records.add(ProtectiveOrder(
                0, entry.symbol, kind, exit_side, price,  # type: ignore[arg-type]
                client_order_id, self.exchange.now(),
                entry_client_order_id=entry.client_order_id)))
        return stored

    async def entry_refused(self, entry: OrderRequest) -> None:
        """The entry was refused (by the limits or the exchange): its protection goes."""
        for order in await self.records.live():
            if order.entry_client_order_id == entry.client_order_id and \
                    order.status == "pending":
                await self.records.update(replace(order, status="canceled",
                                                  note="its entry was not placed"))

    async def set(self, symbol: str, *, stop_loss: Decimal | Literal["keep"] | None = KEEP,
                  take_profit: Decimal | Literal["keep"] | None = KEEP,
                  ) -> list[ProtectiveOrder]:
        """Sets, moves or removes (None) the protection of the desk's position in
        ``symbol``; ``keep`` leaves a side as it is. The old order of a side that changes is
        cancelled (on the exchange too) before the new one is placed.

        Returns:
            The live protective orders of the market afterwards.

        Raises:
            OrderRejectedError: The desk holds nothing in ``symbol``.
            ExchangeError: An old order could not be cancelled on the exchange.
        """
        position = (await self.exchange.records.positions()).get(symbol)
        if position is None or position.amount == 0:
            raise OrderRejectedError(f"this desk holds no {symbol} position to protect")
        now = self.exchange.now()
        live = [o for o in await self.records.live() if o.symbol == symbol]
        for kind, price in (("stop_loss", stop_loss), ("take_profit", take_profit)):
            if price == KEEP:
                continue
            for old in [o for o in live if o.kind == kind]:
                await self._cancel(old, "moved" if price is not None else "removed")
            if price is None:
                continue
            assert isinstance(price, Decimal)
            number = len(await self.records.history(1000)) + 1
            added = await self.records.add(ProtectiveOrder(
                0, symbol, kind, _exit_side(position.amount), price,  # type: ignore[arg-type]
                client_order_id_for(self.desk, symbol, kind, str(number), now.isoformat()),
                now))
            await self._activate(added, position, now, since=now)
        await self.step()
        return [o for o in await self.records.live() if o.symbol == symbol]

    async def live(self, symbol: str | None = None) -> list[ProtectiveOrder]:
        """The pending and active protective orders (of one market)."""
        return [o for o in await self.records.live() if symbol is None or o.symbol == symbol]

    # ------------------------------------------------------------------ before other orders

    async def before_order(self, request: OrderRequest) -> None:
        """Another order reduces a position: the exchange-held protection of its market is
        cancelled first (a spot venue holds the coins for it); the next step places it
        again for what is left."""
        if request.turn in PROTECTION_TURNS:
            return
        for order in await self.records.live():
            if order.symbol == request.symbol and order.status == "active" and \
                    order.held == "exchange" and order.order_id is not None and \
                    order.side == request.side:
                await self._cancel_on_exchange(order)
                await self.records.update(self._renewed(order))

    def _renewed(self, order: ProtectiveOrder) -> ProtectiveOrder:
        """The order with no exchange order behind it and a new client id for the next."""
        return replace(order, order_id=None, client_order_id=client_order_id_for(
            self.desk, order.client_order_id, "renewed", self.exchange.now().isoformat()))

    # ------------------------------------------------------------------ each candle

    async def step(self) -> list[ProtectionEvent]:
        """Activates, places, checks and fires the desk's protective orders (see the
        module's text).

        Returns:
            What happened, in order (also handed to :attr:`on_event`).
        """
        while_down = not self._started
        self._started = True
        events: list[ProtectionEvent] = []
        live = await self.records.live()
        if not live:
            return events
        now = self.exchange.now()
        positions = await self.exchange.records.positions()
        entries = {o.client_order_id: o for o in await self.exchange.records.orders()}
        for order in live:
            position = positions.get(order.symbol, BookPosition(order.symbol))
            if order.status == "pending":
                entry = entries.get(order.entry_client_order_id or "")
                if entry is None or (entry.filled == 0 and not entry.is_open):
                    await self.records.update(replace(order, status="canceled",
                                                      note="its entry never filled"))
                elif entry.filled > 0 and position.amount != 0:
                    step = self.simulated.step if self.simulated else timedelta(0)
                    await self._activate(order, position, now,
                                         since=max(entry.noted_at, now - step))
        by_symbol: dict[str, list[ProtectiveOrder]] = {}
        for order in await self.records.live():
            if order.status == "active":
                by_symbol.setdefault(order.symbol, []).append(order)
        for symbol, orders in by_symbol.items():
            try:
                events.extend(await self._keep(symbol, orders, positions.get(
                    symbol, BookPosition(symbol)), now, while_down))
            except ExchangeError as exc:
                _log.warning("protection_not_kept", desk=self.desk, symbol=symbol,
                             error=str(exc))
        for event in events:
            _log.info("protection_" + event.what, desk=self.desk, text=event.text)
            if self.on_event is not None:
                self.on_event(event)
        return events

    async def _activate(self, order: ProtectiveOrder, position: BookPosition, now: datetime,
                        *, since: datetime) -> ProtectiveOrder:
        active = replace(order, status="active", held=self._held_for(order.kind),
                         amount=abs(position.amount), checked_until=since,
                         trade_id=position.trade_id)
        await self.records.update(active)
        return active

    async def _keep(self, symbol: str, orders: list[ProtectiveOrder], position: BookPosition,
                    now: datetime, while_down: bool) -> list[ProtectionEvent]:
        events: list[ProtectionEvent] = []
        # What the exchange holds is looked at first: a fill there (while nobody looked,
        # or just counted by the books' refresh) is the position's exit.
        for order in [o for o in orders if o.held == "exchange" and o.order_id is not None]:
            fired, event = await self._look_on_exchange(order, while_down)
            if event is not None:
                events.append(event)
            if fired:
                assert event is not None
                await self._cancel_siblings(event.order, orders)
                return events
        orders = [o for o in await self.records.live() if o.symbol == symbol
                  and o.status == "active"]
        wrong = [o for o in orders if position.amount == 0
                 or o.side != _exit_side(position.amount)]
        for order in wrong:
            await self._cancel(order, "the position was closed otherwise")
        orders = [o for o in orders if o not in wrong]
        for order in [o for o in orders if o.held == "exchange"]:
            event = await self._place_on_exchange(order, position)
            if event is not None:
                events.append(event)
        orders = [o for o in await self.records.live() if o.symbol == symbol
                  and o.status == "active"]
        simulated = [o for o in orders if o.held == "simulated"]
        if simulated:
            fired_event = await self._simulate(simulated, position, now, while_down)
            if fired_event is not None:
                await self._cancel_siblings(fired_event.order, orders)
                return [*events, fired_event]
        watched = [o for o in orders if o.held == "daemon"]
        if watched:
            fired_event = await self._watch(watched, position)
            if fired_event is not None:
                await self._cancel_siblings(fired_event.order, orders)
                return [*events, fired_event]
        return events

    # ------------------------------------------------------------------ simulated

    async def _simulate(self, orders: list[ProtectiveOrder], position: BookPosition,
                        now: datetime, while_down: bool) -> ProtectionEvent | None:
        assert self.simulated is not None
        since = min(o.checked_until or o.created_at for o in orders)
        candles = [c for c in await self.simulated.feed.candles(orders[0].symbol, since=since)
                   if c.closes_at <= now]
        for candle in candles:
            eligible = [o for o in orders if (o.checked_until or o.created_at) <= candle.opened_at]
            hit = first_exit(eligible, candle)
            if hit is None:
                continue
            order, price = hit
            amount = abs(position.amount)
            request = OrderRequest(order.symbol, order.side, "market", amount,
                                   client_order_id=order.client_order_id, turn=order.kind)
            await self.exchange.note(request)
            filled = await self.simulated.fill_at(request, price, candle.closes_at)
            await self.exchange.observe(filled)
            return await self._fired(order, filled, amount, price,
                                     simulated_how(candle.opened_at), while_down=while_down,
                                     candle_at=candle.opened_at)
        if candles:
            for order in orders:
                await self.records.update(replace(order, checked_until=candles[-1].closes_at))
        return None

    # ------------------------------------------------------------------ watched by the daemon

    async def _watch(self, orders: list[ProtectiveOrder], position: BookPosition
                     ) -> ProtectionEvent | None:
        last = (await self.exchange.fetch_ticker(orders[0].symbol)).last
        crossed = [o for o in orders if _crossed(o, last)]
        if not crossed:
            return None
        crossed.sort(key=lambda o: 0 if o.kind == "stop_loss" else 1)
        order = crossed[0]
        # One cancels the other, kept by the daemon: what the exchange holds goes first
        # (a spot venue holds the coins for it).
        for other in await self.records.live():
            if other.symbol == order.symbol and other.held == "exchange" and \
                    other.order_id is not None:
                seen = await self._cancel_on_exchange(other)
                if seen is not None and seen.filled > 0:
                    return None  # it filled first: the next look books it
                await self.records.update(self._renewed(other))
        amount = abs(position.amount)
        request = OrderRequest(order.symbol, order.side, "market", amount,
                               client_order_id=order.client_order_id, turn=order.kind)
        filled = await self.exchange.create_order(request)
        return await self._fired(order, filled, amount, filled.average or last,
                                 f"the price {format_price(last)} crossed it (watched by "
                                 "the daemon)", while_down=False)

    # ------------------------------------------------------------------ held by the exchange

    async def _look_on_exchange(self, order: ProtectiveOrder, while_down: bool
                                ) -> tuple[bool, ProtectionEvent | None]:
        """Looks at an order the exchange holds.

        Returns:
            Whether it fired, and the event to tell.
        """
        assert order.order_id is not None
        seen = await self.exchange.fetch_order(order.order_id, order.symbol)
        if seen.status == "closed" or (seen.filled > 0 and seen.status != "open"):
            event = await self._fired(order, seen, seen.filled, seen.average,
                                      "filled on the exchange", while_down=while_down)
            return True, event
        if seen.status == "open":
            return False, None
        watched = replace(self._renewed(order), held="daemon",
                          note=f"the exchange {seen.status} it")
        await self.records.update(watched)
        return False, ProtectionEvent(
            "lost", watched, f"{self.desk}: {self.exchange.name} {seen.status} the "
            f"{watched.title}; the daemon watches the price instead, and this protection "
            "stops when the daemon does.")

    async def _place_on_exchange(self, order: ProtectiveOrder, position: BookPosition
                                 ) -> ProtectionEvent | None:
        """Places an exchange-held order not yet placed, or places it again when the
        position's size changed; an exchange that refuses it leaves it to the daemon."""
        amount = abs(position.amount)
        if order.order_id is not None:
            if order.amount == amount:
                return None
            await self._cancel_on_exchange(order)  # the position's size changed
            order = self._renewed(order)
            await self.records.update(order)
        request = self._exchange_request(order, amount)
        try:
            placed = await self.exchange.create_order(request)
        except OrderRejectedError as exc:
            # Its client order id is spent: the daemon's exit gets a new one.
            watched = replace(self._renewed(order), held="daemon",
                              note=f"the exchange refused it: {exc}")
            await self.records.update(watched)
            return ProtectionEvent(
                "watched", watched, f"{self.desk}: {self.exchange.name} did not take the "
                f"{watched.title} ({exc}); the daemon watches the price instead, and this "
                "protection stops when the daemon does.")
        await self.records.update(replace(order, order_id=placed.id, amount=amount))
        return None

    def _exchange_request(self, order: ProtectiveOrder, amount: Decimal) -> OrderRequest:
        trigger = order.trigger_price
        if order.kind == "stop_loss":
            allowance = 1 - STOP_LIMIT_ALLOWANCE if order.side == "sell" \
                else 1 + STOP_LIMIT_ALLOWANCE
            limit = trigger * allowance
        else:
            limit = trigger
        return OrderRequest(order.symbol, order.side, "limit", amount, limit,
                            client_order_id=order.client_order_id, turn=order.kind,
                            trigger=order.kind, trigger_price=trigger)

    async def _cancel_on_exchange(self, order: ProtectiveOrder) -> Order | None:
        if order.order_id is None:
            return None
        try:
            return await self.exchange.cancel_order(order.order_id, order.symbol)
        except OrderRejectedError:
            # No longer open: look at what became of it (a fill is counted by the look).
            return await self.exchange.fetch_order(order.order_id, order.symbol)

    # ------------------------------------------------------------------ endings

    async def _cancel(self, order: ProtectiveOrder, why: str) -> None:
        if order.held == "exchange" and order.order_id is not None:
            await self._cancel_on_exchange(order)
        await self.records.update(replace(order, status="canceled", note=why))

    async def _cancel_siblings(self, fired: ProtectiveOrder,
                               orders: Sequence[ProtectiveOrder]) -> None:
        for other in orders:
            if other.id != fired.id and other.status == "active":
                current = next((o for o in await self.records.live() if o.id == other.id), None)
                if current is not None:
                    await self._cancel(current, f"its {fired.kind.replace('_', '-')} filled "
                                                "(one cancels the other)")

    async def _fired(self, order: ProtectiveOrder, filled: Order, amount: Decimal,
                     price: Decimal | None, how: str, *, while_down: bool,
                     candle_at: datetime | None = None) -> ProtectionEvent:
        done = replace(order, status="filled", order_id=filled.id, amount=amount,
                       exit_price=price, note=how)
        await self.records.update(done)
        profit = None
        if order.trade_id is not None:
            trade = next((t for t in await self.exchange.records.trades()
                          if t.id == order.trade_id), None)
            profit = trade.profit if trade is not None and not trade.is_open else None
        return ProtectionEvent("fired", done, fired_text(self.desk, done, profit, while_down),
                               profit, while_down, candle_at)


def _crossed(order: ProtectiveOrder, last: Decimal) -> bool:
    falls = (order.kind == "stop_loss") == (order.side == "sell")
    return last <= order.trigger_price if falls else last >= order.trigger_price
