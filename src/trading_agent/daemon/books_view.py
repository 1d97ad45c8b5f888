"""A desk's books as operators read them: JSON-ready answers for the API, the CLI, the web
page and the metrics, and the one order an operator cancels.

Every :class:`~trading_agent.daemon.control.DeskControl` (the supervisor, a fleet's holder,
the tests' daemon) answers through these functions, so the shapes are the same wherever a
desk runs. Decimals are strings (no float rounds a price), times ISO 8601 in UTC. A desk
without books (one that does not trade, or whose books are not open) answers empty lists
and a zero summary, with ``"books": false``: an operator sees that nothing is kept rather
than an error.

Shapes (every answer also has ``desk`` and ``books``):

- ``positions``: ``positions`` (open ones, by symbol): ``symbol, side, amount, entry_price,
  mark, unrealized, notional, realized, fees, opened_at, trade_id``; ``markets`` (every
  market ever traded, flat ones too): ``symbol, amount, realized, fees``.
- ``orders``: ``orders``: ``client_order_id, order_id, symbol, side, type, amount, price,
  filled, status, turn, noted_at, open``.
- ``trades``: ``trades`` (round trips, oldest first): ``id, symbol, side, opened_at,
  closed_at, amount, entry_price, exit_price, exited, profit, profit_percent, fees,
  duration_seconds, exit_reason, opened_turn, closed_turn, open``.
- ``profit``: ``period`` (``daily`` or ``weekly``), ``summary``: ``realized_today,
  realized_total, unrealized, fees_total, trades_closed, wins, open_trades, win_rate``, and
  ``rows`` (oldest first; a week is dated by its Monday): ``day, realized, fees, fills,
  trades_closed``.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Literal, get_args

import structlog

from trading_agent.daemon.control import CancelRefusedError, UnknownOrderError
from trading_agent.errors import TradingAgentError
from trading_agent.trading.books import BookOrder, DayProfit, RoundTrip

if TYPE_CHECKING:
    from trading_agent.trading.desk_books import DeskBooks, MarkedPosition, ProfitSummary
    from trading_agent.trading.exchange import Exchange, Order

__all__ = ["BOOKS_VIEWS", "BooksView", "ProfitPeriod", "cancel_desk_order", "decimal_text",
           "read_books", "time_text"]

BooksView = Literal["positions", "orders", "trades", "profit"]
ProfitPeriod = Literal["daily", "weekly"]
BOOKS_VIEWS: tuple[str, ...] = get_args(BooksView)

_log = structlog.get_logger(__name__)

_PERCENT = Decimal("0.01")


def decimal_text(value: Decimal | None) -> str | None:
    """A decimal as plain digits (``64000.5``, never ``6.40005E+4``); None stays None."""
    if value is None:
        return None
    if value == 0:
        return "0"
    return format(value.normalize(), "f")


def time_text(value: datetime | None) -> str | None:
    """A time as ISO 8601 in UTC (``2024-05-01T12:00:00+00:00``)."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat()


def _position(marked: MarkedPosition) -> dict[str, Any]:
    p = marked.position
    return {"symbol": p.symbol, "side": p.side, "amount": decimal_text(p.amount),
            "entry_price": decimal_text(p.entry_price), "mark": decimal_text(marked.mark),
            "unrealized": decimal_text(marked.unrealized),
            "notional": decimal_text(marked.notional), "realized": decimal_text(p.realized),
            "fees": decimal_text(p.fees), "opened_at": time_text(p.opened_at),
            "trade_id": p.trade_id}


def _order(o: BookOrder) -> dict[str, Any]:
    return {"client_order_id": o.client_order_id, "order_id": o.order_id, "symbol": o.symbol,
            "side": o.side, "type": o.type, "amount": decimal_text(o.amount),
            "price": decimal_text(o.price), "filled": decimal_text(o.filled),
            "status": o.status, "turn": o.turn, "noted_at": time_text(o.noted_at),
            "open": o.is_open}


def _trade(t: RoundTrip) -> dict[str, Any]:
    return {"id": t.id, "symbol": t.symbol, "side": t.side,
            "opened_at": time_text(t.opened_at), "closed_at": time_text(t.closed_at),
            "amount": decimal_text(t.amount), "entry_price": decimal_text(t.entry_price),
            "exit_price": decimal_text(t.exit_price), "exited": decimal_text(t.exited),
            "profit": decimal_text(t.profit),
            "profit_percent": decimal_text(t.profit_percent.quantize(_PERCENT)),
            "fees": decimal_text(t.fees), "duration_seconds": t.duration_seconds,
            "exit_reason": t.exit_reason, "opened_turn": t.opened_turn,
            "closed_turn": t.closed_turn, "open": t.is_open}


def _day(d: DayProfit) -> dict[str, Any]:
    return {"day": d.day.isoformat(), "realized": decimal_text(d.realized),
            "fees": decimal_text(d.fees), "fills": d.fills, "trades_closed": d.trades_closed}


def summary_data(summary: ProfitSummary | None) -> dict[str, Any]:
    """A desk's profit summary (all zero for a desk without books)."""
    if summary is None:
        return {"realized_today": "0", "realized_total": "0", "unrealized": "0",
                "fees_total": "0", "trades_closed": 0, "wins": 0, "open_trades": 0,
                "win_rate": None}
    return {"realized_today": decimal_text(summary.realized_today),
            "realized_total": decimal_text(summary.realized_total),
            "unrealized": decimal_text(summary.unrealized),
            "fees_total": decimal_text(summary.fees_total),
            "trades_closed": summary.trades_closed, "wins": summary.wins,
            "open_trades": summary.open_trades, "win_rate": summary.win_rate}


def _midnight(day: date | None) -> datetime | None:
    return None if day is None else datetime.combine(day, time(), UTC)


async def read_books(books: DeskBooks | None, desk: str, view: BooksView | str, *,
                     since: date | None = None, open_only: bool = False,
                     period: ProfitPeriod | str = "daily") -> dict[str, Any]:
    """One view of a desk's books, JSON-ready (see the module's docstring for the shapes).

    Args:
        books: The desk's books (None when it keeps none).
        desk: The desk.
        view: ``positions``, ``orders``, ``trades`` or ``profit``.
        since: Trades closed on or after this UTC day (open ones always), profit rows from
            it.
        open_only: Only open orders, only open trades.
        period: Profit by ``daily`` or ``weekly`` rows.

    Raises:
        ValueError: An unknown view or period.
    """
    if view not in BOOKS_VIEWS:
        raise ValueError(f"unknown books view {view!r}; one of {', '.join(BOOKS_VIEWS)}")
    if period not in ("daily", "weekly"):
        raise ValueError(f"unknown period {period!r}; daily or weekly")
    answer: dict[str, Any] = {"desk": desk, "books": books is not None}
    if view == "positions":
        answer["positions"] = [] if books is None else [
            _position(p) for p in await books.positions()]
        markets = {} if books is None else await books.records.positions()
        answer["markets"] = [{"symbol": p.symbol, "amount": decimal_text(p.amount),
                              "realized": decimal_text(p.realized), "fees": decimal_text(p.fees)}
                             for p in sorted(markets.values(), key=lambda p: p.symbol)]
    elif view == "orders":
        answer["orders"] = [] if books is None else [
            _order(o) for o in await books.orders(open_only=open_only)]
    elif view == "trades":
        answer["trades"] = [] if books is None else [
            _trade(t) for t in await books.trades(_midnight(since), open_only=open_only)]
    else:
        answer["period"] = period
        answer["summary"] = summary_data(None if books is None else await books.summary())
        if books is None:
            answer["rows"] = []
        else:
            rows = await (books.weekly(since) if period == "weekly" else books.daily(since))
            answer["rows"] = [_day(d) for d in rows]
    return answer


def _exchange_order(order: Order) -> dict[str, Any]:
    return {"order_id": order.id, "client_order_id": order.client_order_id,
            "symbol": order.symbol, "side": order.side, "type": order.type,
            "amount": decimal_text(order.amount), "price": decimal_text(order.price),
            "filled": decimal_text(order.filled), "status": order.status}


async def cancel_desk_order(books: DeskBooks | None, exchange: Exchange | None, desk: str,
                            order_id: str) -> dict[str, Any]:
    """Cancels one of the desk's open orders on its exchange (the web page's cancel button).

    Only an order in the desk's own books may be cancelled: on an account several desks (or
    a person) trade, an order of the account is not the desk's to touch. The exchange's
    answer is counted in the books (a part filled before the cancel is the desk's, once).

    Args:
        books: The desk's books.
        exchange: The desk's exchange.
        desk: The desk.
        order_id: The exchange's order id, or the desk's client order id.

    Returns:
        ``desk`` and ``order`` (the exchange's answer: ``order_id, client_order_id, symbol,
        side, type, amount, price, filled, status``).

    Raises:
        CancelRefusedError: The desk keeps no books or does not trade, or the exchange has
            not answered for the order yet.
        UnknownOrderError: No open order of the desk has that id.
        ExchangeError: The exchange could not cancel it.
    """
    if books is None or exchange is None:
        raise CancelRefusedError(
            f"desk {desk} keeps no books here, so its own orders cannot be told from the "
            "account's; nothing was cancelled (the kill switch's --cancel-orders cancels "
            "every open order of its exchange)")
    open_orders = await books.orders(open_only=True)
    found = next((o for o in open_orders
                  if order_id in (o.order_id, o.client_order_id)), None)
    if found is None:
        ids = ", ".join(o.order_id or o.client_order_id for o in open_orders) or "none"
        raise UnknownOrderError(f"desk {desk} has no open order {order_id!r}; its open "
                                f"orders: {ids}")
    if found.order_id is None:
        raise CancelRefusedError(
            f"order {found.client_order_id} of desk {desk} was sent but the exchange has not "
            "answered for it yet; look again in a moment")
    cancelled = await exchange.cancel_order(found.order_id, found.symbol)
    try:
        await books.records.observe(cancelled, exchange.now())
    except TradingAgentError as exc:  # cancelled all the same: the next look counts it
        _log.warning("books_observe_failed", desk=desk, order_id=found.order_id,
                     error=str(exc))
    return {"desk": desk, "order": _exchange_order(cancelled)}

