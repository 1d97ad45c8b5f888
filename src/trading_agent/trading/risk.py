"""A desk's risk policy: every order is checked against the limits before an exchange sees it.

First the kill switch (:mod:`.kill_switch`): while it is on for the desk, or for every desk,
each new order is refused with "halted by NAME at TIME: REASON". Then the limits
(:class:`~trading_agent.trading.config.RiskLimits`), in the order they are checked:

1. ``allowed_symbols``: the only markets the desk may trade.
2. ``max_daily_loss``: once the desk's equity has fallen this far below what it was when
   the UTC day (of the exchange clock) was first seen, every new order is refused until the
   next UTC day, even if prices recover; and the desk's kill switch goes on, so the next day
   trades only once an operator has looked and switched it off. The equity is the desk's
   own (``equity``): a live desk's by its books (another desk's loss on the same account, or
   the price of the user's own coins, is not its loss), a paper desk's its account's value
   (the account is its alone). A day started on another basis (the account's value, kept
   before an upgrade) is started again from the equity now, never compared with it.
3. ``max_order_notional``: amount × price: a buy at its limit price (or the ask for a market
   buy), a sell at the higher of its limit price and the bid (a sell limit below the market
   fills at the market, so its own price would undervalue it).
4. ``max_position_notional``: the position the order could leave, counting every open order
   on the same side, valued at that same price. An order that shrinks the position is
   always allowed.
5. ``max_open_orders``: a limit order could rest, so it needs a free slot.
6. ``max_orders_per_hour``: orders placed in the rolling hour before now.

Fail safe: no order while the account cannot be valued in full (a holding without a price
would hide a loss), and none on a symbol while an earlier order of the exchange's order
journal is unresolved (sent, answer lost): it is looked up first, and if it is still unknown
the model is told to check it rather than place another.

A refusal raises :class:`~trading_agent.errors.RiskLimitError` naming the limit and the
numbers, which the model reads. :meth:`RiskPolicy.place_order` runs the check and the order
under one lock, so two concurrent tool calls cannot both squeeze under a limit. Once sent,
an order is shielded from cancellation (a tool timeout, a cancelled turn) for at most
``order_seconds``, so its answer and its journal entries are never abandoned half way.

For the kill switch's ``--cancel-orders`` and ``--flatten``, :meth:`RiskPolicy.cancel_open_orders`
cancels every open order and :meth:`RiskPolicy.flatten` closes every position at market. A
closing order only takes risk off, so neither the kill switch nor the limits stop it; it is
still sent under the desk's order lock with a client order id, journaled, and never twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Literal, Protocol, runtime_checkable

import anyio

from trading_agent.errors import (
    ExchangeUnavailableError,
    OrderRejectedError,
    RiskLimitError,
    TradingAgentError,
)
from trading_agent.trading.books import FLATTEN_TURN
from trading_agent.trading.config import RiskLimits
from trading_agent.trading.exchange import Exchange, Order, OrderRequest, client_order_id_for
from trading_agent.trading.formatting import format_amount
from trading_agent.trading.kill_switch import KillSwitch
from trading_agent.trading.protections import REDUCE_ONLY_LIMIT, ProtectionGuard
from trading_agent.trading.risk_journal import DayState, RiskJournal
from trading_agent.trading.valuation import Valuation, convert, value_account

__all__ = ["AccountCap", "PeerHoldings", "RiskCheck", "RiskPolicy"]

_ZERO = Decimal(0)


@runtime_checkable
class _Journaled(Protocol):
    """An exchange with an order journal (the ccxt exchange): orders can be lost in flight."""

    async def unresolved_orders(self) -> Sequence[OrderRequest]:
        """Orders sent whose fate is not known yet."""
        ...

    async def reconcile(self) -> Sequence[Order]:
        """Looks the unresolved orders up at the exchange."""
        ...


@dataclass(frozen=True)
class RiskCheck:
    """The numbers an accepted order was checked with.

    Attributes:
        price: The price the order was valued at.
        notional: Its value in the quote currency.
        projected_position: The signed position it could leave (open orders included).
        position_notional: That position's value in the quote currency.
        open_orders: Orders resting before it.
        orders_last_hour: Orders placed in the hour before it.
        daily_loss: The desk's loss since the start of the UTC day.
    """

    price: Decimal
    notional: Decimal
    projected_position: Decimal
    position_notional: Decimal
    open_orders: int
    orders_last_hour: int
    daily_loss: Decimal


class PeerHoldings(Protocol):
    """Another desk on the same account, as the account-wide cap reads it (its books)."""

    @property
    def desk(self) -> str:
        """The desk."""
        ...

    async def holdings(self) -> dict[str, Decimal]:
        """Its signed amount by symbol, by its own fills."""
        ...


@dataclass(frozen=True)
class AccountCap:
    """What all desks on one account may hold together (``[exchange]
    max_account_notional``).

    Attributes:
        limit: The cap, in the desk's quote currency.
        peers: The other desks on the account.
    """

    limit: Decimal
    peers: Sequence[PeerHoldings] = ()


def _quote_of(symbol: str) -> str:
    return symbol.partition("/")[2].split(":")[0]


class RiskPolicy:
    """A desk's limits, enforced on one exchange.

    Args:
        limits: The limits.
        exchange: The exchange the desk trades on.
        journal: Where recent orders, day starts and halts are remembered (in memory by
            default; pass a file-backed one so a restart keeps them).
        check_seconds: How long waiting for the desk's order lock and the checks may take
            before the order is refused unsent.
        order_seconds: How long sending one order (and looking it up when its answer is
            lost) may take; it cannot be cancelled meanwhile. Longer than the exchange's
            own worst case (its request timeout plus its lookups).
        kill_switch: The daemon's kill switch (the desk is the journal's); None for one of
            its own, in memory.
        account_cap: What all desks on the desk's account may hold together; None for no
            such cap.
        equity: Values the desk's own equity in a currency, for the daily loss (a live
            desk's books:
            :meth:`~trading_agent.trading.desk_books.DeskBooks.equity`); None for the
            account's value (a paper account, the desk's alone).
        protections: The desk's protections and reduce-only state: while it is in
            reduce-only, an order that would open, grow or reverse a position is refused;
            None for no reduce-only.
    """

    def __init__(self, limits: RiskLimits, exchange: Exchange, *,
                 journal: RiskJournal | None = None, check_seconds: float = 60.0,
                 order_seconds: float = 60.0, kill_switch: KillSwitch | None = None,
                 account_cap: AccountCap | None = None,
                 equity: Callable[[str], Awaitable[Valuation]] | None = None,
                 protections: ProtectionGuard | None = None) -> None:
        self.limits = limits
        self.exchange = exchange
        self.journal = journal or RiskJournal.in_memory()
        self.check_seconds = check_seconds
        self.order_seconds = order_seconds
        self.kill_switch = kill_switch or KillSwitch.in_memory()
        self.account_cap = account_cap
        self._equity = equity
        self.protections = protections
        self._lock = anyio.Lock()

    @property
    def desk(self) -> str:
        """The desk whose limits these are."""
        return self.journal.desk

    @property
    def max_place_seconds(self) -> float:
        """The longest :meth:`place_order` can take: a tool's timeout must exceed it."""
        return self.check_seconds + self.order_seconds

    async def place_order(self, request: OrderRequest) -> Order:
        """Checks ``request`` and, if every limit allows it, places it; atomically per desk.

        Returns:
            The order as the exchange accepted it.

        Raises:
            RiskLimitError: A limit refuses the order; the exchange never saw it.
            OrderRejectedError: The exchange refused it.
            ExchangeUnavailableError: The exchange could not be reached; the order may or may
                not exist (it is counted against the hourly limit either way).
        """
        checked = False
        with anyio.move_on_after(self.check_seconds):
            await self._lock.acquire()
            try:
                await self.check(request)
                checked = True
            finally:
                if not checked:
                    self._lock.release()
        if not checked:
            raise ExchangeUnavailableError(
                f"the risk checks did not finish within {self.check_seconds:g} s; the order "
                "was NOT sent")
        try:
            return await self._send(request)
        finally:
            self._lock.release()

    async def _send(self, request: OrderRequest) -> Order:
        """Sends the checked order, shielded from cancellation for at most ``order_seconds``."""
        at = self.exchange.now()
        sent = True
        try:
            # A cancellation mid-request would abandon an order the exchange may have taken
            # (and leave its journal entry "sending"); the model would then place it again.
            with anyio.CancelScope(shield=True), anyio.fail_after(self.order_seconds):
                order = await self.exchange.create_order(request)
        except TimeoutError:
            raise ExchangeUnavailableError(
                f"no answer to the order (client id {request.client_order_id}) within "
                f"{self.order_seconds:g} s; it may or may not exist. Check it with "
                "list_open_orders or get_order before placing anything else.") from None
        except OrderRejectedError:
            sent = False  # the exchange refused it: nothing to count
            raise
        finally:
            if sent:
                # Counted whether it was placed or may have been.
                with anyio.CancelScope(shield=True):
                    await self.journal.record_order(request.client_order_id, at)
        return order

    async def observe(self) -> DayState | None:
        """Records the start of the current UTC day if it is new, and halts on a loss.

        Returns None while the day cannot start (a holding has no price yet).

        The daemon calls this on every tick so the day's starting value is taken at the start
        of the day, not at the first order. It takes the order lock, so the day's start is
        never recorded twice at once (by the candle watcher and by an order).
        """
        async with self._lock:
            state, loss, valuation = await self._day()
            if state is not None and not valuation.unpriced and state.halted is None \
                    and loss >= self.limits.max_daily_loss:
                state = await self._halt_day(state, loss)
            return state

    async def check(self, request: OrderRequest) -> RiskCheck:
        """Checks ``request`` against every limit without placing it.

        Returns:
            The numbers the order passed with.

        Raises:
            RiskLimitError: A limit refuses it.
        """
        limits = self.limits
        quote = limits.quote_currency
        halt = self.kill_switch.halt_for(self.desk)
        if halt is not None:
            raise RiskLimitError("kill_switch", f"Refused (kill_switch): {halt.describe()}. No new "
                                 "order is sent until an operator switches the kill switch off.")
        if request.symbol not in limits.allowed_symbols:
            allowed = ", ".join(limits.allowed_symbols) or "nothing (none configured)"
            raise RiskLimitError("allowed_symbols", f"Refused: {request.symbol} is not in "
                                 f"allowed_symbols; this desk may trade {allowed}.")
        await self._refuse_unresolved(request)
        state, loss, valuation = await self._day()
        if valuation.unpriced or state is None:
            what = ", ".join(valuation.unpriced)
            raise RiskLimitError("max_daily_loss", f"Refused: {what} cannot be priced in "
                                 f"{quote} right now, so the daily loss cannot be checked; "
                                 "try again in a few minutes.")
        if state.halted is None and loss >= limits.max_daily_loss:
            state = await self._halt_day(state, loss)
        if state.halted is not None:
            resume = state.day + timedelta(days=1)
            raise RiskLimitError("max_daily_loss", f"Refused: {state.halted}; new orders are "
                                 f"halted until 00:00 UTC on {resume.isoformat()}.")

        ticker = await self.exchange.fetch_ticker(request.symbol)
        if request.side == "buy":
            # A buy limit above the market fills at the market: its own price is the worst.
            price = request.price or ticker.ask or ticker.last
        else:
            # A sell limit below the market fills at the market, so never value it lower.
            market = ticker.bid or ticker.last
            price = market if request.price is None else max(request.price, market)
        market_quote = request.symbol.partition("/")[2].split(":")[0]
        notional = await self._in_quote(request.amount * price, market_quote)
        if notional > limits.max_order_notional:
            raise RiskLimitError("max_order_notional", f"Refused: order notional "
                                 f"{format_amount(notional, quote)} exceeds max_order_notional "
                                 f"{format_amount(limits.max_order_notional, quote)}.")

        open_orders = await self.exchange.fetch_open_orders()
        held = sum((p.signed_amount for p in await self.exchange.fetch_positions([request.symbol])
                    if p.symbol == request.symbol), _ZERO)
        same_side = sum((o.remaining for o in open_orders
                         if o.symbol == request.symbol and o.side == request.side), _ZERO)
        direction = 1 if request.side == "buy" else -1
        projected = held + direction * (same_side + request.amount)
        if request.side == "sell" and ":" not in request.symbol and projected < 0:
            await self._refuse_selling_more_than_held(request, held, same_side)
        await self._refuse_new_exposure(request, held, projected)
        position_notional = await self._in_quote(abs(projected) * price, market_quote)
        if abs(projected) > abs(held) and position_notional > limits.max_position_notional:
            base = request.symbol.partition("/")[0]
            raise RiskLimitError(
                "max_position_notional",
                f"Refused: the {request.symbol} position could reach {abs(projected)} {base} = "
                f"{format_amount(position_notional, quote)} (held {held}, open {request.side} "
                f"orders {same_side}, this order {request.amount}), exceeding "
                f"max_position_notional {format_amount(limits.max_position_notional, quote)}.")

        if self.account_cap is not None and abs(projected) > abs(held):
            await self._check_account_cap(request, projected, price, market_quote)

        if request.type == "limit" and len(open_orders) >= limits.max_open_orders:
            raise RiskLimitError("max_open_orders", f"Refused: {len(open_orders)} orders are "
                                 f"open and max_open_orders is {limits.max_open_orders}; cancel "
                                 "one first.")

        now = self.exchange.now()
        recent = self.journal.orders_in_hour_before(now)
        if len(recent) >= limits.max_orders_per_hour:
            next_slot = recent[len(recent) - limits.max_orders_per_hour] + timedelta(hours=1) \
                if limits.max_orders_per_hour else now + timedelta(hours=1)
            raise RiskLimitError("max_orders_per_hour", f"Refused: {len(recent)} orders placed "
                                 f"in the last hour and max_orders_per_hour is "
                                 f"{limits.max_orders_per_hour}; the next slot opens at "
                                 f"{next_slot:%H:%M} UTC.")
        return RiskCheck(price, notional, projected, position_notional, len(open_orders),
                         len(recent), loss)

    async def _check_account_cap(self, request: OrderRequest, projected: Decimal,
                                 price: Decimal, market_quote: str) -> None:
        """The account-wide cap: this desk's positions (this market's as it could become)
        and every other desk's on the account, at the marks, together."""
        cap = self.account_cap
        assert cap is not None
        quote = self.limits.quote_currency
        own = await self._in_quote(abs(projected) * price, market_quote)
        for position in await self.exchange.fetch_positions():
            if position.symbol != request.symbol:
                own += await self._in_quote(position.notional, _quote_of(position.symbol))
        others = _ZERO
        for peer in cap.peers:
            for symbol, amount in (await peer.holdings()).items():
                if amount:
                    mark = (await self.exchange.fetch_ticker(symbol)).last
                    others += await self._in_quote(abs(amount) * mark, _quote_of(symbol))
        total = own + others
        if total > cap.limit:
            names = ", ".join([self.desk, *(peer.desk for peer in cap.peers)])
            raise RiskLimitError(
                "max_account_notional",
                f"Refused (max_account_notional): the desks on this account ({names}) could "
                f"hold {format_amount(total, quote)} together (this desk "
                f"{format_amount(own, quote)} with this order, the others "
                f"{format_amount(others, quote)}), exceeding max_account_notional "
                f"{format_amount(cap.limit, quote)}.")

    async def _refuse_new_exposure(self, request: OrderRequest, held: Decimal,
                                   projected: Decimal) -> None:
        """Reduce-only (an operator's, a protection's, a spend cap's): only an order that
        leaves the position smaller on the same side passes (open orders counted)."""
        if self.protections is None:
            return
        state = await self.protections.current()
        if state is None:
            return
        shrinks = held != 0 and abs(projected) < abs(held) and (projected == 0 or (
            projected > 0) == (held > 0))
        if shrinks:
            return
        base = request.symbol.partition("/")[0]
        why = f"protection {state.protection}" if state.protection else f"set by {state.by}"
        can = (f"a {'sell' if held > 0 else 'buy'} of at most {abs(held)} {base} still passes"
               if held != 0 else "it holds no position to reduce")
        raise RiskLimitError(
            REDUCE_ONLY_LIMIT,
            f"Refused (reduce_only, {why}): {state.reason}. This desk may only reduce its "
            f"positions {state.lifts()}: this {request.side} of {request.amount} {base} "
            f"would take the {request.symbol} position from {held} to {projected} "
            f"(open orders counted); {can}.")

    async def _refuse_selling_more_than_held(self, request: OrderRequest, held: Decimal,
                                             selling: Decimal) -> None:
        """A spot desk sells only what it bought itself: the account may hold more (the
        user's own coins, another desk's), which is not this desk's to sell."""
        base = request.symbol.partition("/")[0]
        try:
            balance = (await self.exchange.fetch_balances()).get(base)
            account = f"{balance.total if balance else _ZERO} {base}"
        except TradingAgentError:
            account = "unknown (the balances could not be read)"
        pending = f", {selling} {base} of it already in open sell orders" if selling else ""
        can = max(_ZERO, held - selling)
        raise RiskLimitError(
            "own_position",
            f"Refused (own_position): this desk holds {max(held, _ZERO)} {base} of "
            f"{request.symbol} itself"
            f"{pending}, and may sell at most {can} {base}; the account holds {account}, "
            "but what this desk did not buy is not its to sell.")

    async def describe(self) -> str:
        """The limits and how much of each is used, in a few lines the model reads."""
        limits, quote = self.limits, self.limits.quote_currency
        state, loss, valuation = await self._day()
        now = self.exchange.now()
        open_orders = len(await self.exchange.fetch_open_orders())
        recent = len(self.journal.orders_in_hour_before(now))
        lines = [
            f"Risk limits ({quote}): symbols {', '.join(limits.allowed_symbols) or 'none'}; "
            f"max order {format_amount(limits.max_order_notional)}; max position "
            f"{format_amount(limits.max_position_notional)} per symbol.",
            f"Open orders {open_orders}/{limits.max_open_orders}; orders in the last hour "
            f"{recent}/{limits.max_orders_per_hour}; loss today "
            f"{format_amount(max(loss, _ZERO))}/{format_amount(limits.max_daily_loss)}.",
        ]
        if valuation.unpriced:
            lines.append(f"No new orders until {', '.join(valuation.unpriced)} can be priced "
                         "(the daily loss cannot be checked).")
        if state is not None and state.halted:
            lines.append(f"HALTED for the rest of {state.day.isoformat()} UTC: {state.halted}.")
        return "\n".join(lines)

    async def _day(self) -> tuple[DayState | None, Decimal, Valuation]:
        """Today's state (started now if new), the loss since its start, and the valuation.

        The day does not start while a holding cannot be priced: a start value that leaves
        it out would be too low, and every loss after it would go unnoticed. The loss is
        zero while the day has not started, and meaningless while anything is unpriced.
        """
        now: datetime = self.exchange.now()
        quote = self.limits.quote_currency
        valuation = await (self._equity(quote) if self._equity is not None
                           else value_account(self.exchange, quote))
        state = self.journal.day(now.date())
        if state is None and not valuation.unpriced:
            state = await self.journal.start_day(now.date(), valuation.total, valuation.basis)
        elif state is not None and state.basis != valuation.basis and not valuation.unpriced:
            state = await self.journal.rebase_day(now.date(), valuation.total, valuation.basis)
        if state is None or valuation.unpriced:
            return state, _ZERO, valuation
        return state, state.start_equity - valuation.total, valuation

    async def _refuse_unresolved(self, request: OrderRequest) -> None:
        """Refuses an order on a symbol where an earlier order's fate is unknown.

        Such an order (sent, answer lost) is invisible to the limits until it is found, and
        the model may be about to place it again: look it up first; refuse if still unknown.
        """
        exchange = self.exchange
        if not isinstance(exchange, _Journaled) or not await exchange.unresolved_orders():
            return
        found: Sequence[Order] = ()
        with contextlib.suppress(ExchangeUnavailableError):
            found = await exchange.reconcile()
        found = [o for o in found if o.symbol == request.symbol]
        if found:
            # The model was told the earlier order's fate was unknown; it may be retrying it.
            placed = "; ".join(f"order {o.id} ({o.side} {o.type} {o.amount} {o.symbol}, "
                               f"{o.status}, filled {o.filled})" for o in found)
            raise RiskLimitError(
                "unresolved_orders",
                f"Refused: an earlier order whose answer was lost turned out to be placed: "
                f"{placed}. If you still want this new order as well, place it again.")
        lost = [r for r in await exchange.unresolved_orders() if r.symbol == request.symbol]
        if lost:
            ids = ", ".join(r.client_order_id for r in lost)
            raise RiskLimitError(
                "unresolved_orders",
                f"Refused: an earlier {request.symbol} order (client id {ids}) was sent but "
                "its outcome is still unknown. Check it with list_open_orders or get_order "
                "(and get_balance) before placing another; it was not sent twice.")

    async def cancel_open_orders(self) -> tuple[list[Order], list[str]]:
        """Cancels every open order of the desk (the kill switch's ``--cancel-orders``).

        Returns:
            The orders cancelled, and one line per order that could not be (or per failed
            listing).
        """
        try:
            orders = list(await self.exchange.fetch_open_orders())
        except TradingAgentError as exc:
            return [], [f"could not list the open orders: {exc}"]
        cancelled: list[Order] = []
        failed: list[str] = []
        for order in orders:
            try:
                cancelled.append(await self.exchange.cancel_order(order.id, order.symbol))
            except TradingAgentError as exc:
                failed.append(f"order {order.id} ({order.symbol}) not cancelled: {exc}")
        return cancelled, failed

    async def flatten(self) -> tuple[list[Order], list[str]]:
        """Closes every position of the desk's symbols with a market order (the kill switch's
        ``--flatten``). The kill switch and the limits do not apply to a closing order; it is
        sent under the order lock, journaled, and once.

        Returns:
            The closing orders, and one line per position that could not be closed.
        """
        try:
            positions = [p for p in await self.exchange.fetch_positions(
                list(self.limits.allowed_symbols)) if p.amount > 0]
        except TradingAgentError as exc:
            return [], [f"could not read the positions: {exc}"]
        placed: list[Order] = []
        failed: list[str] = []
        stamp = f"{self.exchange.now():%Y%m%dT%H%M%S%f}"
        async with self._lock:
            for position in positions:
                side: Literal["buy", "sell"] = "sell" if position.side == "long" else "buy"
                request = OrderRequest(position.symbol, side, "market", position.amount, None,
                                       client_order_id_for(self.desk, "flatten", stamp,
                                                           position.symbol), FLATTEN_TURN)
                try:
                    placed.append(await self._send(request))
                except TradingAgentError as exc:
                    failed.append(f"{position.symbol} position ({position.side} "
                                  f"{position.amount}) not closed: {exc}")
        return placed, failed

    async def _halt_day(self, state: DayState, loss: Decimal) -> DayState:
        """The daily loss limit is reached: no more orders today, and the kill switch on."""
        text = self._loss_text(loss)
        state = await self.journal.halt(state.day, text)
        # Stamped with the desk's clock (a backtest's is simulated: no later time may leak
        # into what its model reads).
        await self.kill_switch.switch_on(self.desk, "risk limit max_daily_loss", text,
                                         self.exchange.now())
        return state

    def _loss_text(self, loss: Decimal) -> str:
        quote = self.limits.quote_currency
        return (f"daily loss {format_amount(loss, quote)} since 00:00 UTC reached "
                f"max_daily_loss {format_amount(self.limits.max_daily_loss, quote)}")

    async def _in_quote(self, amount: Decimal, currency: str) -> Decimal:
        value = await convert(self.exchange, amount, currency, self.limits.quote_currency)
        if value is None:
            raise RiskLimitError("quote_currency", f"Refused: cannot value {currency} in "
                                 f"{self.limits.quote_currency} to check the limits.")
        return value

    def __repr__(self) -> str:
        return f"RiskPolicy(desk={self.journal.desk!r}, exchange={self.exchange.name!r})"
