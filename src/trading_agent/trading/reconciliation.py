"""Reconciliation on start: what a live exchange holds, compared with what the journal says.

While the daemon was away the account may have changed: an order filled or was cancelled on
the exchange's site, a person placed one by hand, funds were moved, an earlier run died with
an order in flight. Before a desk trades on a ccxt exchange, :func:`reconcile` compares:

- the exchange's open orders with the order journal. An order the journal does not know is
  reported; if its client order id has our shape (an earlier run's order whose journal entry
  is gone) it is *adopted*: recorded in the journal as placed, so the risk policy and the
  next reconciliation count it. Someone else's order is reported and left alone.
- the journal's orders that may still be on the book (unresolved, or last seen open) with
  the open orders. One missing is looked up by its client order id and reported as what it
  is now (filled, cancelled...); one the exchange does not know is reported as unknown,
  **never assumed cancelled** (as nautilus_trader reconciles at start).
- the balances with those last seen (the exchange notes them in the journal as it reads
  them), less what the desks' own fills counted since then moved (``explained``: every
  desk's on the account, those made while the daemon was down included, counted on start
  by client order id before this runs). Only the rest is reported, as a change no desk
  made and assigned to no desk (a deposit, a withdrawal, a trade by hand); a change the
  desks' fills explain in full is no difference.

The :class:`ReconciliationReport` lists every difference as one readable line; its
:meth:`~ReconciliationReport.notice` is what the desk reads in its next turn, and the
operator gets it as an event (``operator.events.ReconciliationReported``).

Run it once the exchange is open, after every desk on the account counted its fills
(:meth:`~trading_agent.trading.factory.TradingVenue.count_fills_while_away`), and before
the desk's first turn (a balance read by the desk first would already count as seen)::

    report = await reconcile(exchange, exchange.order_journal, explained=fills_since)

A fill counted after the balances were last read is taken to have moved them after that
read. So a desk looks at its own orders that may have filled before it reads the balances
(:meth:`~trading_agent.trading.booked_exchange.BookedExchange.fetch_balances`); another
desk's order on the same account that filled just before that read but was counted by its
desk only after it is still subtracted once too often, and its amount reported as a change
no desk made.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from trading_agent.errors import ExchangeError, OrderRejectedError
from trading_agent.trading.books import BookFill
from trading_agent.trading.ccxt_exchange import CcxtExchange
from trading_agent.trading.exchange import (
    CLIENT_ORDER_ID_PREFIX,
    Balance,
    Order,
    OrderRequest,
    is_own_client_order_id,
)
from trading_agent.trading.formatting import format_price
from trading_agent.trading.order_journal import OrderJournal

__all__ = ["MAX_LOOKUPS", "ReconciliationReport", "reconcile"]

MAX_LOOKUPS = 50
"""The most journal orders looked up one by one in one reconciliation (a rate-limit bound;
the rest are looked up on the next start and reported as not checked)."""

_JOURNAL_SAYS = {
    "sending": "which the journal has as sent with its answer lost",
    "unknown": "which the journal has as of unknown fate",
    "lost": "which the journal has as never placed",
    "placed": "which the journal has as open",
    "rejected": "which the journal has as rejected",
}


@dataclass(frozen=True)
class ReconciliationReport:
    """What differed between the exchange and the journal on start.

    Attributes:
        exchange: The exchange's name.
        checked_at: When it was compared.
        differences: Each difference as one readable line; empty when everything agrees.
        adopted: Orders with our client order id prefix the journal did not know, now
            recorded in it.
    """

    exchange: str
    checked_at: datetime
    differences: list[str] = field(default_factory=list)
    adopted: list[Order] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        """True when nothing differed."""
        return not self.differences

    def notice(self) -> str | None:
        """The notice the desk reads in its next turn, or None when everything agrees."""
        if self.agrees:
            return None
        lines = "\n".join(f"- {line}" for line in self.differences)
        return (f"[Notice from the daemon] On start, the orders and balances on "
                f"{self.exchange} were compared with what the daemon last knew "
                f"({self.checked_at:%Y-%m-%d %H:%M} UTC). What differs:\n{lines}\n"
                "Take this into account before trading: an order of unknown fate is not "
                "assumed cancelled, so check it with get_order or list_open_orders before "
                "placing anything that repeats it.")


async def reconcile(exchange: CcxtExchange, journal: OrderJournal | None = None, *,
                    client_id_prefix: str = CLIENT_ORDER_ID_PREFIX,
                    max_lookups: int = MAX_LOOKUPS,
                    explained: Callable[[datetime], Awaitable[Sequence[BookFill]]] | None
                    = None) -> ReconciliationReport:
    """Compares the exchange's open orders and balances with the journal (see the module).

    An exchange that cannot be read is itself a difference (the rest is still compared);
    nothing here raises for the exchange.

    Args:
        exchange: The live exchange, open.
        journal: Its order journal; the exchange's own by default.
        client_id_prefix: The prefix of the client order ids this daemon makes: an unknown
            order carrying it is adopted.
        max_lookups: The most journal orders looked up one by one.
        explained: The fills every desk on the account counted at or after a time (their
            books'); the balance changes they made are not reported. None: every change is.

    Returns:
        The report.

    Raises:
        ValueError: The exchange has no journal (it was opened for market data only).
        StoreError: The journal could not be read or written.
    """
    journal = journal if journal is not None else exchange.order_journal
    if journal is None:
        raise ValueError(f"{exchange.name} has no order journal to reconcile with")
    report = ReconciliationReport(exchange.name, exchange.now())
    seen = await _open_orders(exchange, journal, report, client_id_prefix)
    if seen is not None:
        await _missing_orders(exchange, journal, report, seen, max_lookups)
    await _balances(exchange, journal, report, explained)
    return report


async def _open_orders(exchange: CcxtExchange, journal: OrderJournal,
                       report: ReconciliationReport, prefix: str) -> set[str] | None:
    """Compares the open orders with the journal; returns the client ids of the journal's
    orders found open (None when the open orders could not be read)."""
    name = exchange.name
    try:
        orders = await exchange.fetch_open_orders()
    except ExchangeError as exc:
        report.differences.append(f"The open orders on {name} could not be read ({exc}); "
                                  "they were not compared with the journal.")
        return None
    seen: set[str] = set()
    for order in orders:
        intent = await journal.get(order.client_order_id) if order.client_order_id else None
        if intent is None:
            intent = await journal.get_by_exchange_order_id(name, order.id)
        if intent is not None:
            seen.add(intent.request.client_order_id)
            if intent.state != "placed":
                await journal.mark(intent.request.client_order_id, "placed", report.checked_at,
                                   exchange_order_id=order.id)
                report.differences.append(
                    f"Order {order.id} (client id {intent.request.client_order_id}), "
                    f"{_JOURNAL_SAYS[intent.state]}, is open on {name}: "
                    f"{_describe(order)}. It is now recorded as placed.")
            await journal.note_status(order, report.checked_at)
            continue
        if order.client_order_id and is_own_client_order_id(order.client_order_id, prefix):
            await journal.adopt(order, name, report.checked_at)
            seen.add(order.client_order_id)
            report.adopted.append(order)
            report.differences.append(
                f"Order {order.id} (client id {order.client_order_id}) is open on {name} but "
                f"was not in the journal; its client id is ours, so it was adopted: "
                f"{_describe(order)}.")
        else:
            who = (f"client id {order.client_order_id}" if order.client_order_id
                   else "no client id")
            report.differences.append(
                f"Order {order.id} ({who}) is open on {name} but was not placed by this "
                f"daemon: {_describe(order)}. It was left alone.")
    return seen


async def _missing_orders(exchange: CcxtExchange, journal: OrderJournal,
                          report: ReconciliationReport, seen: set[str],
                          max_lookups: int) -> None:
    """Looks up the journal's orders that may be open but are not on the book."""
    name = exchange.name
    missing = [intent for intent in await journal.believed_open(name)
               if intent.request.client_order_id not in seen]
    for intent in missing[max_lookups:]:
        report.differences.append(
            f"Order with client id {intent.request.client_order_id} "
            f"({_describe_request(intent.request)}), {_JOURNAL_SAYS[intent.state]}, is not "
            f"among the open orders on {name} and was not looked up this time (more than "
            f"{max_lookups} to check); its fate is unknown.")
    for intent in missing[:max_lookups]:
        client_id = intent.request.client_order_id
        what = (f"Order with client id {client_id} ({_describe_request(intent.request)}), "
                f"{_JOURNAL_SAYS[intent.state]},")
        try:
            order = await exchange.fetch_order_by_client_id(client_id, intent.request.symbol)
        except OrderRejectedError:
            if intent.state == "sending":
                await journal.mark(client_id, "unknown", report.checked_at,
                                   error=f"not found at {name} on start")
            report.differences.append(
                f"{what} is not among the open orders on {name}, and {name} does not know "
                "it: its fate is unknown. It is NOT assumed cancelled.")
            continue
        except ExchangeError as exc:
            report.differences.append(
                f"{what} is not among the open orders on {name}, and looking it up failed "
                f"({exc}): its fate is unknown. It is NOT assumed cancelled.")
            continue
        if intent.state != "placed":
            await journal.mark(client_id, "placed", report.checked_at,
                               exchange_order_id=order.id)
        report.differences.append(f"{what} is {_status_words(order)} on {name}: "
                                  f"{_describe(order)}.")


async def _balances(exchange: CcxtExchange, journal: OrderJournal,
                    report: ReconciliationReport,
                    explained: Callable[[datetime], Awaitable[Sequence[BookFill]]] | None
                    ) -> None:
    """Compares the balances with those last seen, less what the desks' fills since then
    moved, then notes them as seen."""
    name = exchange.name
    last = await journal.last_balances(name)  # before the read below notes the new ones
    try:
        balances = await exchange.fetch_balances()
    except ExchangeError as exc:
        report.differences.append(f"The balances on {name} could not be read ({exc}); they "
                                  "were not compared with those last seen.")
        return
    if last is not None:
        fills = await explained(last.seen_at) if explained is not None else ()
        report.differences.extend(_balance_changes(last.balances, balances, last.seen_at,
                                                   _moved_by(fills)))
    await journal.record_balances(name, balances, report.checked_at)


_EXPLAINED_TOLERANCE = Decimal("1e-9")
"""What of a currency's change the fills explain up to this share of what they moved is
rounding (a fill's price is its cost over its amount, to twelve places), not a change."""


def _moved_by(fills: Sequence[BookFill]) -> dict[str, tuple[Decimal, Decimal]]:
    """What the fills moved on a spot account, by currency: the net change and the sum of
    the moves (for the rounding tolerance). A contract's fills move margin, not coins: they
    explain nothing here."""
    moved: dict[str, tuple[Decimal, Decimal]] = {}

    def move(currency: str, amount: Decimal) -> None:
        net, gross = moved.get(currency, (Decimal(0), Decimal(0)))
        moved[currency] = (net + amount, gross + abs(amount))

    for fill in fills:
        if ":" in fill.symbol:
            continue
        base, _, quote = fill.symbol.partition("/")
        sign = 1 if fill.side == "buy" else -1
        move(base, sign * fill.amount)
        move(quote, -sign * fill.amount * fill.price)
        if fill.fee and fill.fee_currency:
            move(fill.fee_currency, -fill.fee)
    return moved


def _balance_changes(before: Mapping[str, Balance], now: Mapping[str, Balance],
                     seen_at: datetime,
                     moved: Mapping[str, tuple[Decimal, Decimal]]) -> list[str]:
    changes = []
    for currency in sorted(set(before) | set(now) | set(moved)):
        old = before[currency].total if currency in before else Decimal(0)
        new = now[currency].total if currency in now else Decimal(0)
        by_desks, gross = moved.get(currency, (Decimal(0), Decimal(0)))
        rest = new - old - by_desks
        if abs(rest) <= gross * _EXPLAINED_TOLERANCE:
            continue
        line = (f"The {currency} balance is {_plain(new)} ({_signed(new - old)}); it was "
                f"{_plain(old)} when last seen at {seen_at:%Y-%m-%d %H:%M} UTC.")
        if by_desks:
            line += (f" The desks' own fills since then explain {_signed(by_desks)}; "
                     f"{_signed(rest)} {currency} was moved by no desk")
        else:
            line += " No desk's fill made this change"
        changes.append(line + " (a deposit, a withdrawal or a trade by hand?), and it is "
                       "assigned to no desk.")
    return changes


def _status_words(order: Order) -> str:
    return {"closed": "FILLED", "open": "OPEN", "canceled": "CANCELED",
            "rejected": "REJECTED", "expired": "EXPIRED"}[order.status]


def _describe(order: Order) -> str:
    base = order.symbol.partition("/")[0]
    price = f" @ {format_price(order.price)}" if order.price is not None else ""
    line = (f"{order.side} {order.type} {_plain(order.amount)} {base} on {order.symbol}"
            f"{price}, {order.status}")
    if order.filled:
        average = f" at {format_price(order.average)}" if order.average is not None else ""
        line += f", filled {_plain(order.filled)}{average}"
    return line


def _describe_request(request: OrderRequest) -> str:
    base = request.symbol.partition("/")[0]
    price = f" @ {format_price(request.price)}" if request.price is not None else ""
    return f"{request.side} {request.type} {_plain(request.amount)} {base} on " \
           f"{request.symbol}{price}"


def _plain(value: Decimal) -> str:
    text = f"{value:f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _signed(value: Decimal) -> str:
    return f"+{_plain(value)}" if value > 0 else _plain(value)
