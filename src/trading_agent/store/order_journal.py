"""The order journal in the store
(:class:`~trading_agent.trading.order_journal.OrderJournal`): each live order's intent,
committed with full durability before the order is sent, its status as last seen, and the
account's balances as last seen."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import cast

from trading_agent.errors import StoreError
from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration
from trading_agent.store.fencing import Fence, FencedError
from trading_agent.store.targets import StoreTarget
from trading_agent.trading.exchange import (
    Balance,
    Order,
    OrderRequest,
    OrderSide,
    OrderStatus,
    OrderType,
)
from trading_agent.trading.order_journal import IntentState, OrderIntent, SeenBalances

__all__ = ["COMPONENT", "MIGRATIONS", "SqliteOrderJournal"]

COMPONENT = "order_journal"
"""Its schema's name in ``schema_migrations``."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
    """CREATE TABLE IF NOT EXISTS order_intents (
    client_order_id TEXT PRIMARY KEY,
    exchange TEXT NOT NULL,
    symbol TEXT NOT NULL,
    side TEXT NOT NULL,
    type TEXT NOT NULL,
    amount TEXT NOT NULL,
    price TEXT,
    state TEXT NOT NULL,
    exchange_order_id TEXT,
    error TEXT,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS order_intents_state ON order_intents (state)",
    """CREATE TABLE IF NOT EXISTS order_status (
    client_order_id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    filled TEXT NOT NULL,
    updated_at TEXT NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS balances_seen (
    exchange TEXT PRIMARY KEY,
    balances TEXT NOT NULL,
    seen_at TEXT NOT NULL
)""",
)), (2, (
    # Whose order each intent is: desks on one account keep one journal, and a desk's
    # unresolved and open-believed orders are its own (an intent written before this has
    # none: it is every desk's, as before).
    "ALTER TABLE order_intents ADD COLUMN desk TEXT",
)))
"""Numbered migrations: a released one is never edited. The first is written with
``IF NOT EXISTS``: a file made before migrations were numbered already has them."""

_COLUMNS = ("client_order_id, exchange, symbol, side, type, amount, price, state, "
            "exchange_order_id, error, created_at")


def _intent(row: tuple[str, ...]) -> OrderIntent:
    (client_order_id, exchange, symbol, side, type_, amount, price, state, exchange_order_id,
     error, created_at) = row
    request = OrderRequest(symbol, cast(OrderSide, side), cast(OrderType, type_),
                           Decimal(amount), None if price is None else Decimal(price),
                           client_order_id)
    return OrderIntent(request, exchange, cast(IntentState, state), exchange_order_id, error,
                       datetime.fromisoformat(created_at))


class SqliteOrderJournal:
    """Client order ids in the store. Use :meth:`open`.

    Args:
        database: The open database, its schema applied.
        desk: The desk whose orders these are, when its writes are fenced.
    """

    def __init__(self, database: Database, desk: str | None = None) -> None:
        self._database = database
        self._desk = desk

    @classmethod
    async def open(cls, target: StoreTarget, *, fence: Fence | None = None,
                   desk: str | None = None) -> SqliteOrderJournal:
        """Opens (or creates) the journal in the state file, or the PostgreSQL store; every
        commit waits for the disk.

        Args:
            target: The store.
            fence: With ``desk``: checks before each write that this daemon still holds
                the desk.
            desk: The desk whose orders these are.

        Raises:
            StoreError: The store cannot be opened.
        """
        return cls(await Database.open(target, MIGRATIONS, COMPONENT, fence=fence), desk)

    def _own(self, column: str) -> str:
        """The condition that keeps a desk's journal to its own intents (and those of no
        desk, written before intents named theirs); nothing without a desk."""
        return "" if self._desk is None else f" AND ({column} IS NULL OR {column} = ?)"

    def _desks(self) -> tuple[str, ...]:
        return () if self._desk is None else (self._desk,)

    async def record(self, request: OrderRequest, exchange: str, at: datetime) -> None:
        """Commits the intent to send ``request``; call it before sending.

        Raises:
            FencedError: This daemon no longer holds the desk: nothing was recorded.
            StoreError: The id is already in the journal, or the database failed.
        """
        price = None if request.price is None else str(request.price)
        row = (request.client_order_id, exchange, request.symbol, request.side, request.type,
               str(request.amount), price, "sending", at.isoformat(), at.isoformat(),
               self._desk)

        def write(connection: Connection) -> None:
            connection.execute(
                "INSERT INTO order_intents (client_order_id, exchange, symbol, side, type, "
                "amount, price, state, created_at, updated_at, desk) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)

        try:
            await self._database.write(write, desk=self._desk)
        except FencedError:
            raise
        except StoreError as exc:
            raise StoreError(f"the order journal refused client order id "
                             f"{request.client_order_id}: {exc}") from exc

    async def mark(self, client_order_id: str, state: IntentState, at: datetime, *,
                   exchange_order_id: str | None = None, error: str | None = None) -> None:
        """Records where an order stands now."""

        def write(connection: Connection) -> None:
            connection.execute(
                "UPDATE order_intents SET state = ?, "
                "exchange_order_id = COALESCE(?, exchange_order_id), error = ?, "
                "updated_at = ? WHERE client_order_id = ?",
                (state, exchange_order_id, error, at.isoformat(), client_order_id))

        await self._database.write(write, desk=self._desk)

    async def get(self, client_order_id: str) -> OrderIntent | None:
        """The intent with that id, or None."""

        def read(connection: Connection) -> OrderIntent | None:
            row = connection.execute(f"SELECT {_COLUMNS} FROM order_intents "
                                     "WHERE client_order_id = ?", (client_order_id,)).fetchone()
            return None if row is None else _intent(row)

        return await self._database.read(read)

    async def unresolved(self, exchange: str) -> list[OrderIntent]:
        """Intents of ``exchange`` whose fate is not known (``sending`` or ``unknown``)."""

        def read(connection: Connection) -> list[OrderIntent]:
            return [_intent(row) for row in connection.execute(
                f"SELECT {_COLUMNS} FROM order_intents WHERE exchange = ? "
                f"AND state IN ('sending', 'unknown'){self._own('desk')} ORDER BY created_at",
                (exchange, *self._desks()))]

        return await self._database.read(read)

    async def get_by_exchange_order_id(self, exchange: str,
                                       exchange_order_id: str) -> OrderIntent | None:
        """The intent of ``exchange`` the exchange knows by ``exchange_order_id``, or None."""

        def read(connection: Connection) -> OrderIntent | None:
            row = connection.execute(
                f"SELECT {_COLUMNS} FROM order_intents WHERE exchange = ? "
                "AND exchange_order_id = ?", (exchange, exchange_order_id)).fetchone()
            return None if row is None else _intent(row)

        return await self._database.read(read)

    async def note_status(self, order: Order, at: datetime) -> None:
        """Remembers an order's status as just seen; ignored for an order not in the
        journal (someone else's)."""
        row = (order.client_order_id, order.status, str(order.filled), at.isoformat(),
               order.client_order_id)

        def write(connection: Connection) -> None:
            connection.execute(
                "INSERT INTO order_status (client_order_id, status, filled, updated_at) "
                "SELECT ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM order_intents "
                "WHERE client_order_id = ?) ON CONFLICT (client_order_id) DO UPDATE SET "
                "status = excluded.status, filled = excluded.filled, "
                "updated_at = excluded.updated_at", row)

        await self._database.write(write, desk=self._desk)

    async def last_status(self, client_order_id: str) -> OrderStatus | None:
        """The order's status when last seen, or None when never noted."""

        def read(connection: Connection) -> OrderStatus | None:
            row = connection.execute("SELECT status FROM order_status WHERE client_order_id = ?",
                                     (client_order_id,)).fetchone()
            return None if row is None else cast(OrderStatus, row[0])

        return await self._database.read(read)

    async def believed_open(self, exchange: str) -> list[OrderIntent]:
        """Intents of ``exchange`` that may still be on the book: unresolved ones
        (``sending``, ``unknown``) and placed ones last seen open or never seen since,
        oldest first."""

        def read(connection: Connection) -> list[OrderIntent]:
            columns = ", ".join(f"i.{name.strip()}" for name in _COLUMNS.split(","))
            return [_intent(row) for row in connection.execute(
                f"SELECT {columns} FROM order_intents AS i LEFT JOIN order_status AS s "
                "ON s.client_order_id = i.client_order_id WHERE i.exchange = ? AND ("
                "i.state IN ('sending', 'unknown') OR (i.state = 'placed' AND "
                f"COALESCE(s.status, 'open') = 'open')){self._own('i.desk')} "
                "ORDER BY i.created_at", (exchange, *self._desks()))]

        return await self._database.read(read)

    async def adopt(self, order: Order, exchange: str, at: datetime) -> bool:
        """Records an order found on the exchange that the journal did not know (placed with
        our client id by an earlier run whose journal entry is gone) as placed.

        Returns:
            False when the journal already had its client order id.
        """
        price = None if order.price is None else str(order.price)
        intent = (order.client_order_id, exchange, order.symbol, order.side, order.type,
                  str(order.amount), price, "placed", order.id, at.isoformat(), at.isoformat(),
                  self._desk)
        status = (order.client_order_id, order.status, str(order.filled), at.isoformat())

        def write(connection: Connection) -> bool:
            added = connection.execute(
                "INSERT INTO order_intents (client_order_id, exchange, symbol, side, type, "
                "amount, price, state, exchange_order_id, created_at, updated_at, desk) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                intent).rowcount
            if added:
                connection.execute(
                    "INSERT INTO order_status (client_order_id, status, filled, updated_at) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (client_order_id) DO UPDATE SET "
                    "status = excluded.status, filled = excluded.filled, "
                    "updated_at = excluded.updated_at", status)
            return bool(added)

        return await self._database.write(write, desk=self._desk)

    async def record_balances(self, exchange: str, balances: Mapping[str, Balance],
                              at: datetime) -> None:
        """Remembers the account's balances on ``exchange`` as seen at ``at``."""
        data = json.dumps({currency: [str(b.free), str(b.used)]
                           for currency, b in sorted(balances.items())})

        def write(connection: Connection) -> None:
            connection.execute(
                "INSERT INTO balances_seen (exchange, balances, seen_at) VALUES (?, ?, ?) "
                "ON CONFLICT (exchange) DO UPDATE SET balances = excluded.balances, "
                "seen_at = excluded.seen_at", (exchange, data, at.isoformat()))

        await self._database.write(write, desk=self._desk)

    async def last_balances(self, exchange: str) -> SeenBalances | None:
        """The balances last recorded for ``exchange``, or None when never."""

        def read(connection: Connection) -> SeenBalances | None:
            row = connection.execute("SELECT balances, seen_at FROM balances_seen "
                                     "WHERE exchange = ?", (exchange,)).fetchone()
            if row is None:
                return None
            balances = {currency: Balance(currency, Decimal(free), Decimal(used))
                        for currency, (free, used) in json.loads(row[0]).items()}
            return SeenBalances(balances, datetime.fromisoformat(row[1]))

        return await self._database.read(read)

    async def close(self) -> None:
        """Lets go of the store."""
        await self._database.close()
