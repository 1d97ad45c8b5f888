"""A desk's protective orders in the store
(:class:`~trading_agent.trading.protection.ProtectionRecords`): the stops and targets of its
positions, each stored (with its client order id) before anything of it is sent, so that a
restart finds what was held where and books what fired meanwhile once.

Amounts are decimal text; times ISO UTC with microseconds.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, cast

from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration
from trading_agent.store.fencing import Fence
from trading_agent.store.targets import StoreTarget
from trading_agent.trading.exchange import OrderSide, ProtectionKind
from trading_agent.trading.protection import (
    ProtectionHeld,
    ProtectionStatus,
    ProtectiveOrder,
)

__all__ = ["COMPONENT", "MIGRATIONS", "SqliteProtectiveOrders"]

COMPONENT = "protective_orders"
"""Its schema's name in ``schema_migrations``."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
    """CREATE TABLE protective_orders (
    id INTEGER PRIMARY KEY,
    desk TEXT NOT NULL,
    symbol TEXT NOT NULL,
    kind TEXT NOT NULL,
    side TEXT NOT NULL,
    trigger_price TEXT NOT NULL,
    client_order_id TEXT NOT NULL,
    created_at TEXT NOT NULL,
    entry_client_order_id TEXT,
    status TEXT NOT NULL,
    held TEXT,
    amount TEXT NOT NULL,
    order_id TEXT,
    checked_until TEXT,
    exit_price TEXT,
    trade_id INTEGER,
    note TEXT,
    UNIQUE (desk, client_order_id)
)""",
    "CREATE INDEX protective_orders_live ON protective_orders (desk, status)",
)),)
"""Numbered migrations: a released one is never edited."""

_COLUMNS = ("id, symbol, kind, side, trigger_price, client_order_id, created_at, "
            "entry_client_order_id, status, held, amount, order_id, checked_until, "
            "exit_price, trade_id, note")


def _iso(at: datetime | None) -> str | None:
    if at is None:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return at.astimezone(UTC).isoformat(timespec="microseconds")


def _row(row: tuple[Any, ...]) -> ProtectiveOrder:
    (id_, symbol, kind, side, trigger, client_order_id, created_at, entry, status, held,
     amount, order_id, checked_until, exit_price, trade_id, note) = row
    return ProtectiveOrder(
        int(id_), symbol, cast(ProtectionKind, kind), cast(OrderSide, side), Decimal(trigger),
        client_order_id, datetime.fromisoformat(created_at), entry,
        cast(ProtectionStatus, status), cast(ProtectionHeld | None, held), Decimal(amount),
        order_id, None if checked_until is None else datetime.fromisoformat(checked_until),
        None if exit_price is None else Decimal(exit_price),
        None if trade_id is None else int(trade_id), note)


class SqliteProtectiveOrders:
    """One desk's protective orders in the store. Use :meth:`open`.

    Args:
        database: The open database, its schema applied.
        desk: The desk; every row is its, and every write is fenced on it.
    """

    def __init__(self, database: Database, desk: str) -> None:
        self._database = database
        self.desk = desk

    @classmethod
    async def open(cls, target: StoreTarget, desk: str, *,
                   fence: Fence | None = None) -> SqliteProtectiveOrders:
        """Opens (or creates) the table in the state file, or the PostgreSQL store.

        Raises:
            StoreError: The store cannot be opened.
        """
        return cls(await Database.open(target, MIGRATIONS, COMPONENT, fence=fence), desk)

    async def add(self, order: ProtectiveOrder) -> ProtectiveOrder:
        """Stores a new protective order before anything of it is sent.

        Returns:
            It with its id.

        Raises:
            FencedError: This daemon no longer holds the desk.
            StoreError: The database failed.
        """

        def write(connection: Connection) -> int:
            row = connection.execute(
                "INSERT INTO protective_orders (desk, symbol, kind, side, trigger_price, "
                "client_order_id, created_at, entry_client_order_id, status, held, amount, "
                "order_id, checked_until, exit_price, trade_id, note) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (self.desk, order.symbol, order.kind, order.side, str(order.trigger_price),
                 order.client_order_id, _iso(order.created_at), order.entry_client_order_id,
                 order.status, order.held, str(order.amount), order.order_id,
                 _iso(order.checked_until), _text(order.exit_price), order.trade_id,
                 order.note)).fetchone()
            return int(row[0])

        new_id = await self._database.write(write, desk=self.desk)
        return ProtectiveOrder(new_id, *(getattr(order, name) for name in _FIELDS[1:]))

    async def update(self, order: ProtectiveOrder) -> None:
        """Writes the changing parts of a stored protective order.

        Raises:
            FencedError: This daemon no longer holds the desk.
            StoreError: The database failed.
        """
        await self._database.write(lambda connection: connection.execute(
            "UPDATE protective_orders SET client_order_id = ?, status = ?, held = ?, "
            "amount = ?, order_id = ?, checked_until = ?, exit_price = ?, trade_id = ?, "
            "note = ? WHERE desk = ? AND id = ?",
            (order.client_order_id, order.status, order.held, str(order.amount),
             order.order_id, _iso(order.checked_until), _text(order.exit_price),
             order.trade_id, order.note, self.desk, order.id)), desk=self.desk)

    async def live(self) -> list[ProtectiveOrder]:
        """The pending and active ones, oldest first."""

        def read(connection: Connection) -> list[ProtectiveOrder]:
            return [_row(row) for row in connection.execute(
                f"SELECT {_COLUMNS} FROM protective_orders WHERE desk = ? AND status IN "
                "('pending', 'active') ORDER BY id", (self.desk,))]

        return await self._database.read(read)

    async def history(self, limit: int = 50) -> list[ProtectiveOrder]:
        """The latest ``limit`` ones, whatever their status, oldest first."""

        def read(connection: Connection) -> list[ProtectiveOrder]:
            rows = connection.execute(
                f"SELECT {_COLUMNS} FROM protective_orders WHERE desk = ? ORDER BY id DESC "
                "LIMIT ?", (self.desk, limit)).fetchall()
            return [_row(row) for row in reversed(rows)]

        return await self._database.read(read)

    async def close(self) -> None:
        """Lets go of the store."""
        await self._database.close()

    def __repr__(self) -> str:
        return f"SqliteProtectiveOrders(desk={self.desk!r})"


_FIELDS = tuple(ProtectiveOrder.__dataclass_fields__)


def _text(value: Decimal | None) -> str | None:
    return None if value is None else str(value)
