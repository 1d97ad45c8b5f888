"""A desk's books as a fleet's PostgreSQL store holds them, for the audit of
:mod:`tests.daemon.careful_trading` (the same tables as the SQLite file)."""

from __future__ import annotations

import json
from decimal import Decimal

import psycopg
from psycopg.rows import dict_row

from tests.daemon.careful_trading import Books


def read_fleet_books(store_url: str, desk: str) -> Books:
    """What the store holds of ``desk``, read in one transaction (the daemons may run)."""
    with psycopg.connect(store_url, row_factory=dict_row) as connection, \
            connection.transaction():
        def rows(sql: str, *params: object) -> list[dict[str, object]]:
            return connection.execute(sql, params).fetchall()

        messages = [(str(row["message_id"]), str(row["role"]), str(row["kind"]),
                     json.loads(_text(row["content"])))
                    for row in rows("SELECT message_id, role, kind, content FROM messages "
                                    "WHERE desk = %s AND subagent_id IS NULL ORDER BY seq", desk)]
        turns = {str(row["turn"]) for row in rows(
            "SELECT DISTINCT turn FROM events WHERE desk = %s AND turn IS NOT NULL", desk)}
        orders = {str(row["id"]): dict(row) for row in rows(
            "SELECT * FROM paper_orders WHERE account = %s ORDER BY seq", desk)}
        fills = [dict(row) for row in rows(
            "SELECT * FROM paper_fills WHERE account = %s ORDER BY seq", desk)]
        balances = {str(row["currency"]): Decimal(str(row["free"])) + Decimal(str(row["used"]))
                    for row in rows("SELECT * FROM paper_balances WHERE account = %s", desk)}
        journal = rows("SELECT to_regclass('order_intents') IS NOT NULL AS present")[0]
        journal_ids = [str(row["client_order_id"]) for row in rows(
            "SELECT client_order_id FROM order_intents")] if journal["present"] else []
        book_orders = {str(row["client_order_id"]): dict(row) for row in rows(
            "SELECT * FROM book_orders WHERE desk = %s", desk)}
        book_fills = [dict(row) for row in rows(
            "SELECT * FROM book_fills WHERE desk = %s ORDER BY seq", desk)]
        book_positions = {str(row["symbol"]): Decimal(str(row["amount"])) for row in rows(
            "SELECT symbol, amount FROM book_positions WHERE desk = %s", desk)}
    return Books(desk, messages, turns, orders, fills, balances, journal_ids, book_orders,
                 book_fills, book_positions)


def _text(content: object) -> str:
    return bytes(content).decode() if isinstance(content, bytes | memoryview) else str(content)
