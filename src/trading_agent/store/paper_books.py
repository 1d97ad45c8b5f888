"""The paper exchange's books in the store
(:class:`~trading_agent.trading.ledger.PaperBooks`): orders, fills, balances, positions.

Every change the paper exchange makes is one
:class:`~trading_agent.trading.ledger.LedgerChanges`, written in one transaction (a savepoint
of the store's group commit, durable before it returns): order rows inserted or updated,
fills and balance changes appended, current balances and positions updated row by row.
Reopening the store gives back exactly the open orders, balances and positions that were last
committed. Amounts are stored as decimal text, so nothing is rounded on the way through.
Several accounts (desks) share the store.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any, cast

from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration
from trading_agent.store.fencing import Fence
from trading_agent.store.targets import StoreTarget
from trading_agent.trading.exchange import Fill, Order, OrderSide, OrderStatus, OrderType
from trading_agent.trading.ledger import LedgerChanges, LedgerSnapshot, PaperOrder

__all__ = ["COMPONENT", "MIGRATIONS", "SqlitePaperBooks"]

COMPONENT = "paper_books"
"""Its schema's name in ``schema_migrations``."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
    """CREATE TABLE IF NOT EXISTS paper_accounts (
    account TEXT PRIMARY KEY,
    created_at TEXT NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS paper_orders (
    seq INTEGER PRIMARY KEY,
    account TEXT NOT NULL,
    id TEXT NOT NULL,
    client_order_id TEXT NOT NULL,
    symbol TEXT NOT NULL,
    side TEXT NOT NULL,
    type TEXT NOT NULL,
    amount TEXT NOT NULL,
    price TEXT,
    status TEXT NOT NULL,
    filled TEXT NOT NULL,
    average TEXT,
    fee TEXT NOT NULL,
    fee_currency TEXT,
    reserved TEXT NOT NULL,
    reserved_currency TEXT NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    UNIQUE (account, id),
    UNIQUE (account, client_order_id)
)""",
    "CREATE INDEX IF NOT EXISTS paper_orders_open ON paper_orders (account, status)",
    """CREATE TABLE IF NOT EXISTS paper_fills (
    seq INTEGER PRIMARY KEY,
    account TEXT NOT NULL,
    order_id TEXT NOT NULL,
    symbol TEXT NOT NULL,
    side TEXT NOT NULL,
    amount TEXT NOT NULL,
    price TEXT NOT NULL,
    fee TEXT NOT NULL,
    fee_currency TEXT NOT NULL,
    liquidity TEXT NOT NULL,
    at TEXT NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS paper_balance_changes (
    seq INTEGER PRIMARY KEY,
    account TEXT NOT NULL,
    currency TEXT NOT NULL,
    free_delta TEXT NOT NULL,
    used_delta TEXT NOT NULL,
    reason TEXT NOT NULL,
    order_id TEXT,
    at TEXT NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS paper_balances (
    account TEXT NOT NULL,
    currency TEXT NOT NULL,
    free TEXT NOT NULL,
    used TEXT NOT NULL,
    PRIMARY KEY (account, currency)
)""",
    """CREATE TABLE IF NOT EXISTS paper_positions (
    account TEXT NOT NULL,
    symbol TEXT NOT NULL,
    amount TEXT NOT NULL,
    cost TEXT,
    PRIMARY KEY (account, symbol)
)""",
)),)
"""Numbered migrations: a released one is never edited. The first is written with
``IF NOT EXISTS``: a file made before migrations were numbered already has them."""


def _text(value: Decimal | None) -> str | None:
    return None if value is None else str(value)


def _decimal(value: str | None) -> Decimal | None:
    return None if value is None else Decimal(value)


def _order_from_row(row: tuple[Any, ...]) -> PaperOrder:
    (order_id, client_order_id, symbol, side, type_, amount, price, status, filled,
     average, fee, fee_currency, reserved, reserved_currency, created_at) = row
    order = Order(
        id=order_id,
        client_order_id=client_order_id,
        symbol=symbol,
        side=cast(OrderSide, side),
        type=cast(OrderType, type_),
        amount=Decimal(amount),
        price=_decimal(price),
        status=cast(OrderStatus, status),
        filled=Decimal(filled),
        average=_decimal(average),
        fee=Decimal(fee),
        fee_currency=fee_currency,
        created_at=datetime.fromisoformat(created_at),
    )
    return PaperOrder(order, Decimal(reserved), reserved_currency)


_ORDER_COLUMNS = ("id, client_order_id, symbol, side, type, amount, price, status, filled, "
                  "average, fee, fee_currency, reserved, reserved_currency, created_at")


class SqlitePaperBooks:
    """One paper account's books in the store.

    Use :meth:`open`.

    Args:
        database: The open database (its schema applied).
        account: The account's name (the desk's), so desks can share a store.
        desk: The desk whose books these are, when its writes are fenced.
    """

    def __init__(self, database: Database, account: str, desk: str | None = None) -> None:
        self._database = database
        self.account = account
        self._desk = desk

    @classmethod
    async def open(cls, target: StoreTarget, account: str = "default", *,
                   fence: Fence | None = None, desk: str | None = None) -> SqlitePaperBooks:
        """Opens (or creates) the books in the state file, or the PostgreSQL store.

        Args:
            target: The store.
            account: The account's name.
            fence: With ``desk``: checks before each write that this daemon still holds
                the desk.
            desk: The desk whose books these are.

        Raises:
            StoreError: The store cannot be opened.
        """
        return cls(await Database.open(target, MIGRATIONS, COMPONENT, fence=fence), account,
                   desk)

    async def load(self) -> LedgerSnapshot:
        """The account as last committed."""
        return await self._database.read(self._load)

    def _load(self, connection: Connection) -> LedgerSnapshot:
        account = self.account
        exists = connection.execute("SELECT 1 FROM paper_accounts WHERE account = ?",
                                    (account,)).fetchone() is not None
        balances = {
            currency: (Decimal(free), Decimal(used))
            for currency, free, used in connection.execute(
                "SELECT currency, free, used FROM paper_balances WHERE account = ?", (account,))
        }
        positions = {
            symbol: (Decimal(amount), _decimal(cost))
            for symbol, amount, cost in connection.execute(
                "SELECT symbol, amount, cost FROM paper_positions WHERE account = ?", (account,))
        }
        open_orders = [
            _order_from_row(row) for row in connection.execute(
                f"SELECT {_ORDER_COLUMNS} FROM paper_orders "
                "WHERE account = ? AND status = 'open' ORDER BY seq", (account,))
        ]
        count = connection.execute("SELECT COUNT(*) FROM paper_orders WHERE account = ?",
                                   (account,)).fetchone()
        return LedgerSnapshot(exists, balances, positions, open_orders, int(count[0]))

    async def create_account(self, changes: LedgerChanges) -> None:
        """Marks the account opened and commits its starting balances and positions."""

        def write(connection: Connection) -> None:
            connection.execute("INSERT INTO paper_accounts (account, created_at) "
                               "VALUES (?, ?)", (self.account, changes.at.isoformat()))
            self._write(connection, changes)

        await self._database.write(write, desk=self._desk)

    async def commit(self, changes: LedgerChanges, *,
                     new_client_order_id: str | None = None) -> bool:
        """Writes ``changes`` in one transaction (a savepoint of the group commit): see
        :meth:`PaperBooks.commit <trading_agent.trading.ledger.PaperBooks.commit>`."""

        def write(connection: Connection) -> bool:
            if new_client_order_id is not None and connection.execute(
                    "SELECT 1 FROM paper_orders WHERE account = ? AND client_order_id = ?",
                    (self.account, new_client_order_id)).fetchone() is not None:
                return False
            self._write(connection, changes)
            return True

        return await self._database.write(write, desk=self._desk)

    def _write(self, connection: Connection, changes: LedgerChanges) -> None:
        account, at = self.account, changes.at.isoformat()
        for paper in changes.orders:
            order = paper.order
            connection.execute(
                "INSERT INTO paper_orders (account, id, client_order_id, symbol, side, "
                "type, amount, price, status, filled, average, fee, fee_currency, reserved, "
                "reserved_currency, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (account, id) DO UPDATE SET status = excluded.status, "
                "filled = excluded.filled, average = excluded.average, fee = excluded.fee, "
                "fee_currency = excluded.fee_currency, reserved = excluded.reserved, "
                "updated_at = excluded.updated_at",
                (account, order.id, order.client_order_id, order.symbol, order.side,
                 order.type, str(order.amount), _text(order.price), order.status,
                 str(order.filled), _text(order.average), str(order.fee), order.fee_currency,
                 str(paper.reserved), paper.reserved_currency, order.created_at.isoformat(),
                 at),
            )
        connection.executemany(
            "INSERT INTO paper_fills (account, order_id, symbol, side, amount, price, fee, "
            "fee_currency, liquidity, at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [(account, f.order_id, f.symbol, f.side, str(f.amount), str(f.price), str(f.fee),
              f.fee_currency, f.liquidity, f.at.isoformat()) for f in changes.fills],
        )
        connection.executemany(
            "INSERT INTO paper_balance_changes (account, currency, free_delta, used_delta, "
            "reason, order_id, at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(account, c.currency, str(c.free_delta), str(c.used_delta), c.reason, c.order_id,
              at) for c in changes.balance_changes],
        )
        connection.executemany(
            "INSERT INTO paper_balances (account, currency, free, used) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (account, currency) DO UPDATE SET free = excluded.free, "
            "used = excluded.used",
            [(account, currency, str(free), str(used))
             for currency, (free, used) in changes.balances.items()],
        )
        connection.executemany(
            "INSERT INTO paper_positions (account, symbol, amount, cost) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (account, symbol) DO UPDATE SET amount = excluded.amount, "
            "cost = excluded.cost",
            [(account, symbol, str(amount), _text(cost))
             for symbol, (amount, cost) in changes.positions.items()],
        )

    async def find_order(self, *, order_id: str | None = None,
                         client_order_id: str | None = None) -> PaperOrder | None:
        """An order of this account by its id or its client order id, or None."""
        column, value = ("id", order_id) if order_id is not None else (
            "client_order_id", client_order_id)

        def read(connection: Connection) -> PaperOrder | None:
            row = connection.execute(
                f"SELECT {_ORDER_COLUMNS} FROM paper_orders WHERE account = ? AND {column} = ?",
                (self.account, value)).fetchone()
            return None if row is None else _order_from_row(row)

        return await self._database.read(read)

    async def fills(self, order_id: str | None = None) -> list[Fill]:
        """The account's fills (of one order if given), oldest first."""

        def read(connection: Connection) -> list[Fill]:
            query = ("SELECT order_id, symbol, side, amount, price, fee, fee_currency, "
                     "liquidity, at FROM paper_fills WHERE account = ?")
            arguments: tuple[str, ...] = (self.account,)
            if order_id is not None:
                query += " AND order_id = ?"
                arguments += (order_id,)
            return [
                Fill(oid, symbol, cast(OrderSide, side), Decimal(amount), Decimal(price),
                     Decimal(fee), fee_currency, liquidity, datetime.fromisoformat(at))
                for oid, symbol, side, amount, price, fee, fee_currency, liquidity, at
                in connection.execute(query + " ORDER BY seq", arguments)
            ]

        return await self._database.read(read)

    async def close(self) -> None:
        """Lets go of the store."""
        await self._database.close()
