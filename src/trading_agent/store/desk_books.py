"""A desk's own books in the store
(:class:`~trading_agent.trading.books.DeskBookRecords`): its orders, fills, positions and
round trips, kept by desk so that desks sharing an account (and a store) never count one
another's trades.

Every observation of an order is one write (a savepoint of the store's group commit,
durable before it returns): the order's counted part is read inside it, the new fill is
inserted under its unique id, and the position, the round trips and the order's counted part
are updated with it. A crash before the commit leaves nothing of it; one after counts
nothing twice, because the next observation finds the part already counted (and the fill id
taken). Two observations of one order racing each other (two processes, on PostgreSQL)
are kept apart by the order row: the write updates it first, which locks it, and only then
reads what was counted.

Amounts are decimal text, never rounded; times are ISO UTC with microseconds, so that they
sort as text. Each fill row keeps the profit it realized and its fee in the quote currency,
so a day's profit is a sum of rows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any, Literal, cast

from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration
from trading_agent.store.fencing import Fence
from trading_agent.store.targets import StoreTarget
from trading_agent.trading.books import (
    ZERO,
    BookFill,
    BookOrder,
    BookPosition,
    DayProfit,
    RoundTrip,
    apply_fill,
    fill_from_order,
)
from trading_agent.trading.exchange import Order, OrderSide

__all__ = ["COMPONENT", "MIGRATIONS", "SqliteDeskBooks"]

COMPONENT = "desk_books"
"""Its schema's name in ``schema_migrations``."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
    """CREATE TABLE book_orders (
    desk TEXT NOT NULL,
    client_order_id TEXT NOT NULL,
    symbol TEXT NOT NULL,
    side TEXT NOT NULL,
    type TEXT NOT NULL,
    amount TEXT NOT NULL,
    price TEXT,
    turn TEXT,
    noted_at TEXT NOT NULL,
    order_id TEXT,
    status TEXT NOT NULL,
    filled TEXT NOT NULL,
    cost TEXT NOT NULL,
    fee TEXT NOT NULL,
    fee_currency TEXT,
    PRIMARY KEY (desk, client_order_id)
)""",
    "CREATE INDEX book_orders_status ON book_orders (desk, status)",
    """CREATE TABLE book_fills (
    seq INTEGER PRIMARY KEY,
    desk TEXT NOT NULL,
    fill_id TEXT NOT NULL,
    order_id TEXT NOT NULL,
    client_order_id TEXT NOT NULL,
    symbol TEXT NOT NULL,
    side TEXT NOT NULL,
    amount TEXT NOT NULL,
    price TEXT NOT NULL,
    fee TEXT NOT NULL,
    fee_currency TEXT,
    at TEXT NOT NULL,
    turn TEXT,
    realized TEXT NOT NULL,
    quote_fee TEXT NOT NULL,
    UNIQUE (desk, fill_id)
)""",
    "CREATE INDEX book_fills_at ON book_fills (desk, at)",
    """CREATE TABLE book_positions (
    desk TEXT NOT NULL,
    symbol TEXT NOT NULL,
    amount TEXT NOT NULL,
    entry_price TEXT,
    realized TEXT NOT NULL,
    fees TEXT NOT NULL,
    other_fees TEXT NOT NULL,
    opened_at TEXT,
    trade_id INTEGER,
    PRIMARY KEY (desk, symbol)
)""",
    """CREATE TABLE book_trades (
    id INTEGER PRIMARY KEY,
    desk TEXT NOT NULL,
    symbol TEXT NOT NULL,
    side TEXT NOT NULL,
    opened_at TEXT NOT NULL,
    amount TEXT NOT NULL,
    entry_price TEXT NOT NULL,
    closed_at TEXT,
    exit_price TEXT,
    exited TEXT NOT NULL,
    profit TEXT NOT NULL,
    fees TEXT NOT NULL,
    exit_reason TEXT,
    opened_turn TEXT,
    closed_turn TEXT
)""",
    "CREATE INDEX book_trades_closed ON book_trades (desk, closed_at)",
)),)
"""Numbered migrations: a released one is never edited."""

_TERMINAL = ("closed", "canceled", "rejected", "expired")

_ORDER_COLUMNS = ("client_order_id, symbol, side, type, amount, price, turn, noted_at, "
                  "order_id, status, filled, cost, fee, fee_currency")
_FILL_COLUMNS = ("fill_id, order_id, client_order_id, symbol, side, amount, price, fee, "
                 "fee_currency, at, turn")
_POSITION_COLUMNS = ("symbol, amount, entry_price, realized, fees, other_fees, opened_at, "
                     "trade_id")
_TRADE_COLUMNS = ("id, symbol, side, opened_at, amount, entry_price, closed_at, exit_price, "
                  "exited, profit, fees, exit_reason, opened_turn, closed_turn")


def _iso(at: datetime) -> str:
    """``at`` in UTC, always with microseconds: such texts sort as the times do."""
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return at.astimezone(UTC).isoformat(timespec="microseconds")


def _time(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def _text(value: Decimal | None) -> str | None:
    return None if value is None else str(value)


def _decimal(text: str | None) -> Decimal | None:
    return None if text is None else Decimal(text)


def _order(row: tuple[Any, ...]) -> BookOrder:
    (client_order_id, symbol, side, type_, amount, price, turn, noted_at, order_id, status,
     filled, cost, fee, fee_currency) = row
    return BookOrder(client_order_id, symbol, cast(OrderSide, side), type_, Decimal(amount),
                     _decimal(price), turn, datetime.fromisoformat(noted_at), order_id,
                     status, Decimal(filled), Decimal(cost), Decimal(fee), fee_currency)


def _fill(row: tuple[Any, ...]) -> BookFill:
    (fill_id, order_id, client_order_id, symbol, side, amount, price, fee, fee_currency, at,
     turn) = row
    return BookFill(fill_id, order_id, client_order_id, symbol, cast(OrderSide, side),
                    Decimal(amount), Decimal(price), Decimal(fee), fee_currency,
                    datetime.fromisoformat(at), turn)


def _position(row: tuple[Any, ...]) -> BookPosition:
    symbol, amount, entry_price, realized, fees, other_fees, opened_at, trade_id = row
    other = {currency: Decimal(value) for currency, value in json.loads(other_fees).items()}
    return BookPosition(symbol, Decimal(amount), _decimal(entry_price), Decimal(realized),
                        Decimal(fees), other, _time(opened_at),
                        None if trade_id is None else int(trade_id))


def _trade(row: tuple[Any, ...]) -> RoundTrip:
    (id_, symbol, side, opened_at, amount, entry_price, closed_at, exit_price, exited, profit,
     fees, exit_reason, opened_turn, closed_turn) = row
    return RoundTrip(int(id_), symbol, cast(Literal["long", "short"], side),
                     datetime.fromisoformat(opened_at), Decimal(amount), Decimal(entry_price),
                     _time(closed_at), _decimal(exit_price), Decimal(exited), Decimal(profit),
                     Decimal(fees), exit_reason, opened_turn, closed_turn)


def _other_fees(fees: Mapping[str, Decimal]) -> str:
    return json.dumps({currency: str(value) for currency, value in sorted(fees.items())})


class SqliteDeskBooks:
    """One desk's books in the store. Use :meth:`open`.

    Args:
        database: The open database, its schema applied.
        desk: The desk; every row is its, and every write is fenced on it.
    """

    def __init__(self, database: Database, desk: str) -> None:
        self._database = database
        self.desk = desk

    @classmethod
    async def open(cls, target: StoreTarget, desk: str, *,
                   fence: Fence | None = None) -> SqliteDeskBooks:
        """Opens (or creates) the books in the state file, or the PostgreSQL store.

        Args:
            target: The store.
            desk: The desk whose books these are.
            fence: Checks before each write that this daemon still holds the desk.

        Raises:
            StoreError: The store cannot be opened.
        """
        return cls(await Database.open(target, MIGRATIONS, COMPONENT, fence=fence), desk)

    async def note_order(self, order: BookOrder) -> None:
        """Notes an order before it is sent; the same client order id again changes
        nothing.

        Raises:
            FencedError: This daemon no longer holds the desk: nothing was noted.
            StoreError: The database failed.
        """
        row = (self.desk, order.client_order_id, order.symbol, order.side, order.type,
               str(order.amount), _text(order.price), order.turn, _iso(order.noted_at),
               order.order_id, order.status, str(order.filled), str(order.cost),
               str(order.fee), order.fee_currency)
        await self._database.write(lambda connection: connection.execute(
            f"INSERT INTO book_orders (desk, {_ORDER_COLUMNS}) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            row), desk=self.desk)

    async def observe(self, order: Order, at: datetime) -> list[BookFill]:
        """Counts what of ``order`` filled since the books last looked, once, in one write.

        Returns:
            The fill newly counted, or nothing (nothing new, or not the desk's order).

        Raises:
            FencedError: This daemon no longer holds the desk: nothing was counted.
            StoreError: The database failed: nothing was counted.
        """
        return await self._database.write(lambda connection: self._observe(
            connection, order, at), desk=self.desk)

    def _observe(self, connection: Connection, order: Order, at: datetime) -> list[BookFill]:
        desk = self.desk
        # Updating the row first locks it (PostgreSQL): an observation racing this one
        # waits, then reads what this one counted. A terminal status is not taken back by
        # a report older than it.
        updated = connection.execute(
            "UPDATE book_orders SET order_id = ?, status = CASE WHEN status IN "
            f"({', '.join('?' * len(_TERMINAL))}) AND ? = 'open' THEN status ELSE ? END "
            "WHERE desk = ? AND client_order_id = ?",
            (order.id, *_TERMINAL, order.status, order.status, desk,
             order.client_order_id)).rowcount
        if not updated:
            return []  # never noted: not this desk's order
        row = connection.execute(
            f"SELECT {_ORDER_COLUMNS} FROM book_orders WHERE desk = ? AND client_order_id = ?",
            (desk, order.client_order_id)).fetchone()
        counted = _order(row)
        fill = fill_from_order(counted, order, at)
        if fill is None:
            return []
        inserted = connection.execute(
            f"INSERT INTO book_fills (desk, {_FILL_COLUMNS}, realized, quote_fee) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, '0', '0') ON CONFLICT DO NOTHING",
            (desk, fill.fill_id, fill.order_id, fill.client_order_id, fill.symbol, fill.side,
             str(fill.amount), str(fill.price), str(fill.fee), fill.fee_currency,
             _iso(fill.at), fill.turn)).rowcount
        if not inserted:
            return []  # counted already
        position, trade = self._holding(connection, fill.symbol)
        effect = apply_fill(position, trade, fill)
        new = effect.position
        if effect.updated is not None:
            self._save_trade(connection, effect.updated)
        if effect.closed is not None:
            self._save_trade(connection, effect.closed)
        if effect.opened is not None:
            new = replace(new, trade_id=self._insert_trade(connection, effect.opened))
        connection.execute(
            "UPDATE book_positions SET amount = ?, entry_price = ?, realized = ?, fees = ?, "
            "other_fees = ?, opened_at = ?, trade_id = ? WHERE desk = ? AND symbol = ?",
            (str(new.amount), _text(new.entry_price), str(new.realized), str(new.fees),
             _other_fees(new.other_fees), None if new.opened_at is None else _iso(
                 new.opened_at), new.trade_id, desk, new.symbol))
        connection.execute(
            "UPDATE book_fills SET realized = ?, quote_fee = ? WHERE desk = ? AND fill_id = ?",
            (str(effect.realized), str(new.fees - position.fees), desk, fill.fill_id))
        connection.execute(
            "UPDATE book_orders SET filled = ?, cost = ?, fee = ?, fee_currency = ? "
            "WHERE desk = ? AND client_order_id = ?",
            (str(order.filled), str(order.filled * (order.average or fill.price)),
             str(counted.fee + fill.fee), fill.fee_currency or counted.fee_currency, desk,
             counted.client_order_id))
        return [fill]

    def _holding(self, connection: Connection, symbol: str
                 ) -> tuple[BookPosition, RoundTrip | None]:
        """The desk's position in ``symbol`` (a flat one made if new), locked for this
        write, and its open round trip."""
        connection.execute(
            "INSERT INTO book_positions (desk, symbol, amount, realized, fees, other_fees) "
            "VALUES (?, ?, '0', '0', '0', '{}') ON CONFLICT (desk, symbol) "
            "DO UPDATE SET amount = book_positions.amount", (self.desk, symbol))
        position = _position(connection.execute(
            f"SELECT {_POSITION_COLUMNS} FROM book_positions WHERE desk = ? AND symbol = ?",
            (self.desk, symbol)).fetchone())
        if position.trade_id is None:
            return position, None
        row = connection.execute(f"SELECT {_TRADE_COLUMNS} FROM book_trades "
                                 "WHERE desk = ? AND id = ?",
                                 (self.desk, position.trade_id)).fetchone()
        return position, None if row is None else _trade(row)

    def _insert_trade(self, connection: Connection, trade: RoundTrip) -> int:
        row = connection.execute(
            "INSERT INTO book_trades (desk, symbol, side, opened_at, amount, entry_price, "
            "closed_at, exit_price, exited, profit, fees, exit_reason, opened_turn, "
            "closed_turn) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
            (self.desk, *_trade_values(trade))).fetchone()
        return int(row[0])

    def _save_trade(self, connection: Connection, trade: RoundTrip) -> None:
        connection.execute(
            "UPDATE book_trades SET symbol = ?, side = ?, opened_at = ?, amount = ?, "
            "entry_price = ?, closed_at = ?, exit_price = ?, exited = ?, profit = ?, "
            "fees = ?, exit_reason = ?, opened_turn = ?, closed_turn = ? "
            "WHERE desk = ? AND id = ?", (*_trade_values(trade), self.desk, trade.id))

    async def orders(self, *, open_only: bool = False) -> list[BookOrder]:
        """The desk's orders, oldest first (those that may still fill, with
        ``open_only``)."""
        query = f"SELECT {_ORDER_COLUMNS} FROM book_orders WHERE desk = ?"
        if open_only:
            query += " AND status IN ('new', 'open')"

        def read(connection: Connection) -> list[BookOrder]:
            return [_order(row) for row in connection.execute(
                query + " ORDER BY noted_at, rowid", (self.desk,))]

        return await self._database.read(read)

    async def positions(self) -> dict[str, BookPosition]:
        """Every market the desk ever traded, flat ones included, by symbol."""

        def read(connection: Connection) -> dict[str, BookPosition]:
            return {row[0]: _position(row) for row in connection.execute(
                f"SELECT {_POSITION_COLUMNS} FROM book_positions WHERE desk = ? "
                "ORDER BY symbol", (self.desk,))}

        return await self._database.read(read)

    async def fills(self, since: datetime | None = None) -> list[BookFill]:
        """The desk's fills (at or after ``since``), oldest first."""
        query = f"SELECT {_FILL_COLUMNS} FROM book_fills WHERE desk = ?"
        arguments: tuple[str, ...] = (self.desk,)
        if since is not None:
            query += " AND at >= ?"
            arguments += (_iso(since),)

        def read(connection: Connection) -> list[BookFill]:
            return [_fill(row) for row in connection.execute(query + " ORDER BY seq",
                                                             arguments)]

        return await self._database.read(read)

    async def trades(self, since: datetime | None = None, *,
                     open_only: bool = False) -> list[RoundTrip]:
        """The desk's round trips, oldest first: the open ones, and (unless ``open_only``)
        the closed ones, those closed at or after ``since`` when it is given."""
        query = f"SELECT {_TRADE_COLUMNS} FROM book_trades WHERE desk = ?"
        arguments: tuple[str, ...] = (self.desk,)
        if open_only:
            query += " AND closed_at IS NULL"
        elif since is not None:
            query += " AND (closed_at IS NULL OR closed_at >= ?)"
            arguments += (_iso(since),)

        def read(connection: Connection) -> list[RoundTrip]:
            return [_trade(row) for row in connection.execute(query + " ORDER BY id",
                                                              arguments)]

        return await self._database.read(read)

    async def daily(self, since: date | None = None) -> list[DayProfit]:
        """Realized profit by UTC day (of the fills' times), oldest first; days without
        fills are left out."""
        start = None if since is None else _iso(datetime(since.year, since.month, since.day,
                                                         tzinfo=UTC))
        after = "" if start is None else " AND at >= ?"
        closed_after = "" if start is None else " AND closed_at >= ?"
        arguments = (self.desk,) if start is None else (self.desk, start)

        def read(connection: Connection) -> tuple[list[tuple[str, str, str]], list[str]]:
            fills = connection.execute(
                f"SELECT at, realized, quote_fee FROM book_fills WHERE desk = ?{after}",
                arguments).fetchall()
            closed = [row[0] for row in connection.execute(
                "SELECT closed_at FROM book_trades WHERE desk = ? AND closed_at IS NOT NULL"
                f"{closed_after}", arguments)]
            return fills, closed

        fills, closed = await self._database.read(read)
        days: dict[date, list[Any]] = {}
        for at, realized, fee in fills:
            day = days.setdefault(datetime.fromisoformat(at).date(), [ZERO, ZERO, 0, 0])
            day[0] += Decimal(realized)
            day[1] += Decimal(fee)
            day[2] += 1
        for closed_at in closed:
            found = days.get(datetime.fromisoformat(closed_at).date())
            if found is not None:  # a trade closes on a fill: its day has one
                found[3] += 1
        return [DayProfit(day, *days[day]) for day in sorted(days)]

    async def close(self) -> None:
        """Lets go of the store."""
        await self._database.close()


def _trade_values(trade: RoundTrip) -> tuple[Any, ...]:
    return (trade.symbol, trade.side, _iso(trade.opened_at), str(trade.amount),
            str(trade.entry_price), None if trade.closed_at is None else _iso(trade.closed_at),
            _text(trade.exit_price), str(trade.exited), str(trade.profit), str(trade.fees),
            trade.exit_reason, trade.opened_turn, trade.closed_turn)

