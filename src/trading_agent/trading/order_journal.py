"""Every live order's client order id, written down before the order is sent.

The journal is how an order is never sent twice. The intent is committed (``synchronous =
FULL``) before the request leaves; when the answer is lost (a timeout, a dropped connection,
a crash), the order is looked up at the exchange by that id instead of being sent again.

States: ``sending`` (committed, request in flight or its answer lost), ``placed`` (the
exchange has it), ``rejected`` (the exchange refused it), ``unknown`` (no answer, and a lookup
did not find it yet), ``lost`` (still not found at the exchange long after it was sent:
taken as never placed, so it no longer holds up new orders).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Literal, cast

from trading_agent.errors import StoreError
from trading_agent.trading.exchange import OrderRequest, OrderSide, OrderType
from trading_agent.trading.sqlite import SqliteDatabase

__all__ = ["IntentState", "OrderIntent", "OrderJournal"]

IntentState = Literal["sending", "placed", "rejected", "unknown", "lost"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS order_intents (
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
);
CREATE INDEX IF NOT EXISTS order_intents_state ON order_intents (state);
"""

_COLUMNS = ("client_order_id, exchange, symbol, side, type, amount, price, state, "
            "exchange_order_id, error, created_at")


@dataclass(frozen=True)
class OrderIntent:
    """An order as the journal knows it.

    Attributes:
        request: What was (to be) sent.
        exchange: The exchange's name.
        state: Where it stands.
        exchange_order_id: The exchange's id, once known.
        error: Why it was rejected or is unknown.
        created_at: When the intent was written.
    """

    request: OrderRequest
    exchange: str
    state: IntentState
    exchange_order_id: str | None
    error: str | None
    created_at: datetime


def _intent(row: tuple[str, ...]) -> OrderIntent:
    (client_order_id, exchange, symbol, side, type_, amount, price, state, exchange_order_id,
     error, created_at) = row
    request = OrderRequest(symbol, cast(OrderSide, side), cast(OrderType, type_),
                           Decimal(amount), None if price is None else Decimal(price),
                           client_order_id)
    return OrderIntent(request, exchange, cast(IntentState, state), exchange_order_id, error,
                       datetime.fromisoformat(created_at))


class OrderJournal:
    """Client order ids in SQLite. Use :meth:`open`.

    Args:
        database: The open database, its schema applied.
    """

    def __init__(self, database: SqliteDatabase) -> None:
        self._database = database

    @classmethod
    async def open(cls, path: Path | str) -> OrderJournal:
        """Opens (or creates) the journal file; every commit waits for the disk.

        Raises:
            StoreError: The file cannot be opened.
        """
        return cls(await SqliteDatabase.open(path, _SCHEMA, synchronous="FULL"))

    async def record(self, request: OrderRequest, exchange: str, at: datetime) -> None:
        """Commits the intent to send ``request``; call it before sending.

        Raises:
            StoreError: The id is already in the journal, or SQLite failed.
        """
        price = None if request.price is None else str(request.price)
        row = (request.client_order_id, exchange, request.symbol, request.side, request.type,
               str(request.amount), price, "sending", at.isoformat(), at.isoformat())

        def write(connection: sqlite3.Connection) -> None:
            with connection:
                connection.execute(
                    "INSERT INTO order_intents (client_order_id, exchange, symbol, side, type, "
                    "amount, price, state, created_at, updated_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)

        try:
            await self._database.run(write)
        except StoreError as exc:
            raise StoreError(f"the order journal refused client order id "
                             f"{request.client_order_id}: {exc}") from exc

    async def mark(self, client_order_id: str, state: IntentState, at: datetime, *,
                   exchange_order_id: str | None = None, error: str | None = None) -> None:
        """Records where an order stands now."""

        def write(connection: sqlite3.Connection) -> None:
            with connection:
                connection.execute(
                    "UPDATE order_intents SET state = ?, "
                    "exchange_order_id = COALESCE(?, exchange_order_id), error = ?, "
                    "updated_at = ? WHERE client_order_id = ?",
                    (state, exchange_order_id, error, at.isoformat(), client_order_id))

        await self._database.run(write)

    async def get(self, client_order_id: str) -> OrderIntent | None:
        """The intent with that id, or None."""

        def read(connection: sqlite3.Connection) -> OrderIntent | None:
            row = connection.execute(f"SELECT {_COLUMNS} FROM order_intents "
                                     "WHERE client_order_id = ?", (client_order_id,)).fetchone()
            return None if row is None else _intent(row)

        return await self._database.run(read)

    async def unresolved(self, exchange: str) -> list[OrderIntent]:
        """Intents of ``exchange`` whose fate is not known (``sending`` or ``unknown``)."""

        def read(connection: sqlite3.Connection) -> list[OrderIntent]:
            return [_intent(row) for row in connection.execute(
                f"SELECT {_COLUMNS} FROM order_intents WHERE exchange = ? "
                "AND state IN ('sending', 'unknown') ORDER BY created_at", (exchange,))]

        return await self._database.run(read)

    async def close(self) -> None:
        """Closes the file."""
        await self._database.close()
