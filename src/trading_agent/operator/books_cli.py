"""What each desk's own books hold, as commands: ``positions``, ``orders``, ``trades``,
``profit`` and ``cancel-order``.

Every figure is the desk's own (its orders and their fills), never the account's: several
desks may trade one account. Without DESK a command shows every desk, one table with a DESK
column. They talk to the running daemon as ``desks`` does (``--socket``, ``--url``,
``--config``...). Exit codes: 0 done; 1 the daemon cannot be reached; 2 refused (an unknown
desk, which names the desks there are; a ``--since`` that is not a date as YYYY-MM-DD; an
order the desk has not open).

``--json`` prints a list with one object per desk, exactly as the API answers it (keys in
:mod:`trading_agent.daemon.books_view`): decimals are strings, times ISO 8601 in UTC, and
``books`` says whether the desk keeps books at all.
"""

from __future__ import annotations

import argparse
import getpass
import json
import re
import sys
from collections.abc import Awaitable, Callable
from datetime import date
from typing import Any

from trading_agent.operator.cli import (
    OPERATOR_IGNORED_HELP,
    add_connection_options,
    run_with_client,
)
from trading_agent.operator.client import OperatorClient, OperatorRequestError
from trading_agent.operator.render import Style, format_money, format_table, printable

__all__ = ["EXIT_REFUSED", "add_books_subcommands"]

EXIT_REFUSED = 2
"""A bad argument, an unknown desk or order."""

_Body = Callable[[OperatorClient, argparse.Namespace], Awaitable[int]]

_POSITIONS_KEYS = ("symbol, side, amount, entry_price, mark, unrealized, notional, realized, "
                   "fees, opened_at, trade_id")
_ORDERS_KEYS = ("client_order_id, order_id, symbol, side, type, amount, price, filled, "
                "status, turn, noted_at, open")
_TRADES_KEYS = ("id, symbol, side, opened_at, closed_at, amount, entry_price, exit_price, "
                "exited, profit, profit_percent, fees, duration_seconds, exit_reason, "
                "opened_turn, closed_turn, open")
_PROFIT_KEYS = ("period, summary {realized_today, realized_total, unrealized, fees_total, "
                "trades_closed, wins, open_trades, win_rate}, rows [{day, realized, fees, "
                "fills, trades_closed}]")

_JSON_HELP = ("print a JSON list, one object per desk: {desk, books (whether it keeps any), "
              "%s}; decimals as strings, times ISO 8601 UTC")


def add_books_subcommands(subparsers: Any) -> None:
    """Adds ``positions``, ``orders``, ``trades``, ``profit`` and ``cancel-order``.

    Args:
        subparsers: What ``ArgumentParser.add_subparsers()`` returned.
    """
    positions = subparsers.add_parser(
        "positions", help="each desk's own open positions, at the market",
        description="The positions a desk's own orders built (never the account's), each "
                    "with its average entry price, the last price, the profit at that price "
                    "and what it realized so far.")
    _desk_argument(positions)
    positions.add_argument("--json", action="store_true",
                           help=_JSON_HELP % f"positions [{{{_POSITIONS_KEYS}}}], markets "
                                             "[{symbol, amount, realized, fees}]")
    _talks_to_the_daemon(positions, _positions)

    orders = subparsers.add_parser(
        "orders", help="each desk's own open orders",
        description="The orders a desk placed that may still fill, as its books hold them.")
    _desk_argument(orders)
    orders.add_argument("--all", action="store_true", help="every order, not only open ones")
    orders.add_argument("--json", action="store_true",
                        help=_JSON_HELP % f"orders [{{{_ORDERS_KEYS}}}]")
    _talks_to_the_daemon(orders, _orders)

    trades = subparsers.add_parser(
        "trades", help="each desk's round trips and the profit of each",
        description="A round trip opens when a position leaves zero and closes when it "
                    "comes back; its profit is what it realized less every fee of its fills.")
    _desk_argument(trades)
    trades.add_argument("--since", metavar="YYYY-MM-DD",
                        help="only trades closed on or after this UTC day (open ones always)")
    trades.add_argument("--open", action="store_true", help="only the open ones")
    trades.add_argument("--json", action="store_true",
                        help=_JSON_HELP % f"trades [{{{_TRADES_KEYS}}}]")
    _talks_to_the_daemon(trades, _trades)

    profit = subparsers.add_parser(
        "profit", help="each desk's profit: today, all time, by day or week",
        description="Realized profit (fees subtracted) today and all time, unrealized at "
                    "the marks, trades closed and won, then one row per UTC day (or ISO "
                    "week, dated by its Monday) with fills.")
    _desk_argument(profit)
    period = profit.add_mutually_exclusive_group()
    period.add_argument("--daily", dest="period", action="store_const", const="daily",
                        help="one row per UTC day (the default)")
    period.add_argument("--weekly", dest="period", action="store_const", const="weekly",
                        help="one row per ISO week")
    profit.set_defaults(period="daily")
    profit.add_argument("--since", metavar="YYYY-MM-DD", help="rows from this UTC day")
    profit.add_argument("--json", action="store_true", help=_JSON_HELP % _PROFIT_KEYS)
    _talks_to_the_daemon(profit, _profit)

    cancel = subparsers.add_parser(
        "cancel-order", help="cancel one open order of a desk",
        description="Cancels the order (its exchange id or client id, as `orders` shows it) "
                    "on the desk's exchange; only an open order of the desk's own books.")
    cancel.add_argument("desk", metavar="DESK")
    cancel.add_argument("order_id", metavar="ORDER_ID")
    cancel.add_argument("--operator", default=None, metavar="NAME",
                        help=OPERATOR_IGNORED_HELP)
    cancel.add_argument("--json", action="store_true",
                        help="print {desk, order {order_id, client_order_id, symbol, side, "
                             "type, amount, price, filled, status}}")
    _talks_to_the_daemon(cancel, _cancel_order)


def _desk_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("desk", metavar="DESK", nargs="?", help="one desk (default: every desk)")


def _talks_to_the_daemon(parser: argparse.ArgumentParser, body: _Body) -> None:
    add_connection_options(parser)
    parser.set_defaults(handler=lambda args: _checked(args, body))


_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def _checked(args: argparse.Namespace, body: _Body) -> int:
    """Refuses a bad ``--since`` before asking the daemon anything."""
    since = getattr(args, "since", None)
    if since is not None:
        try:
            if not _DAY.match(since):
                raise ValueError(since)
            date.fromisoformat(since)
        except ValueError:
            print(printable(f"trading-agent: --since must be a date as YYYY-MM-DD (a UTC "
                            f"day), not {since!r}"), file=sys.stderr)
            return EXIT_REFUSED
    return run_with_client(args, body)


async def _each_desk(client: OperatorClient, args: argparse.Namespace,
                     read: Callable[[str], Awaitable[dict[str, Any]]]
                     ) -> list[dict[str, Any]] | None:
    """The view of DESK, or of every desk; None (said on stderr) when refused."""
    names = [args.desk] if args.desk else list((await client.health()).get("desks", []))
    answers = []
    for name in names:
        try:
            answers.append(await read(name))
        except OperatorRequestError as exc:
            print(printable(f"trading-agent: {exc.message}"), file=sys.stderr)
            return None
    return answers


def _no_books(answers: list[dict[str, Any]]) -> None:
    for answer in answers:
        if not answer.get("books"):
            print(f"{answer['desk']} keeps no books.")


def _text(value: Any) -> str:
    return "-" if value is None or value == "" else printable(str(value))


def _show(answers: list[dict[str, Any]], key: str, header: list[str],
          row: Callable[[dict[str, Any]], list[str]], empty: str) -> None:
    rows = [[printable(str(answer["desk"])), *row(item)]
            for answer in answers for item in answer.get(key, [])]
    if rows:
        print(format_table(rows, ["DESK", *header], Style(False)))
    else:
        print(empty)
    _no_books(answers)


async def _answers(client: OperatorClient, args: argparse.Namespace,
                   read: Callable[[str], Awaitable[dict[str, Any]]]
                   ) -> list[dict[str, Any]] | int:
    """Each desk's answer to show as a table, or the exit code when there is nothing more to
    show: a refusal (already said), or ``--json`` (printed)."""
    answers = await _each_desk(client, args, read)
    if answers is None:
        return EXIT_REFUSED
    if args.json:
        print(json.dumps(answers, indent=2))
        return 0
    return answers


async def _positions(client: OperatorClient, args: argparse.Namespace) -> int:
    answers = await _answers(client, args, client.positions)
    if isinstance(answers, int):
        return answers
    _show(answers, "positions",
          ["SYMBOL", "SIDE", "AMOUNT", "ENTRY", "MARK", "UNREALIZED", "REALIZED"],
          lambda p: [_text(p["symbol"]), _text(p["side"]), _text(p["amount"]),
                     _text(p["entry_price"]), _text(p["mark"]), format_money(p["unrealized"]),
                     format_money(p["realized"])],
          "No open positions.")
    return 0


async def _orders(client: OperatorClient, args: argparse.Namespace) -> int:
    async def read(desk: str) -> dict[str, Any]:
        return await client.orders(desk, every=args.all)

    answers = await _answers(client, args, read)
    if isinstance(answers, int):
        return answers
    _show(answers, "orders",
          ["ORDER", "SYMBOL", "SIDE", "TYPE", "AMOUNT", "PRICE", "FILLED", "STATUS", "TURN"],
          lambda o: [_text(o["order_id"] or o["client_order_id"]), _text(o["symbol"]),
                     _text(o["side"]), _text(o["type"]), _text(o["amount"]), _text(o["price"]),
                     _text(o["filled"]), _text(o["status"]), _text(o["turn"])],
          "No orders." if args.all else "No open orders.")
    return 0


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "-"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _when(text: Any) -> str:
    """``2024-05-01 12:00`` from an ISO time in UTC."""
    return "-" if not isinstance(text, str) else text[:16].replace("T", " ")


async def _trades(client: OperatorClient, args: argparse.Namespace) -> int:
    async def read(desk: str) -> dict[str, Any]:
        return await client.trades(desk, since=args.since, open_only=args.open)

    answers = await _answers(client, args, read)
    if isinstance(answers, int):
        return answers
    _show(answers, "trades",
          ["ID", "SYMBOL", "SIDE", "OPENED", "CLOSED", "AMOUNT", "ENTRY", "EXIT", "PROFIT",
           "PROFIT %", "FEES", "HELD", "EXIT REASON"],
          lambda t: [str(t["id"]), _text(t["symbol"]), _text(t["side"]), _when(t["opened_at"]),
                     "open" if t["open"] else _when(t["closed_at"]), _text(t["amount"]),
                     _text(t["entry_price"]), _text(t["exit_price"]), format_money(t["profit"]),
                     _text(t["profit_percent"]), format_money(t["fees"]),
                     _duration(t["duration_seconds"]), _text(t["exit_reason"])],
          "No open trades." if args.open else "No trades.")
    return 0


async def _profit(client: OperatorClient, args: argparse.Namespace) -> int:
    async def read(desk: str) -> dict[str, Any]:
        return await client.profit(desk, period=args.period, since=args.since)

    answers = await _answers(client, args, read)
    if isinstance(answers, int):
        return answers
    style = Style(False)
    rows = []
    for answer in answers:
        s = answer["summary"]
        rate = s.get("win_rate")
        rows.append([printable(str(answer["desk"])), format_money(s["realized_today"]),
                     format_money(s["realized_total"]), format_money(s["unrealized"]),
                     format_money(s["fees_total"]), str(s["trades_closed"]), str(s["wins"]),
                     f"{rate:.0%}" if isinstance(rate, int | float) else "-",
                     str(s["open_trades"])])
    print(format_table(rows, ["DESK", "REALIZED TODAY", "REALIZED", "UNREALIZED", "FEES",
                              "CLOSED", "WON", "WIN RATE", "OPEN"], style))
    days = [[printable(str(answer["desk"])), str(r["day"]), format_money(r["realized"]),
             format_money(r["fees"]), str(r["fills"]), str(r["trades_closed"])]
            for answer in answers for r in answer.get("rows", [])]
    print()
    if days:
        print(format_table(days, ["DESK", "WEEK OF" if args.period == "weekly" else "DAY",
                                  "REALIZED", "FEES", "FILLS", "CLOSED"], style))
    else:
        print("No fills" + (f" since {args.since}." if args.since else " yet."))
    _no_books(answers)
    return 0


async def _cancel_order(client: OperatorClient, args: argparse.Namespace) -> int:
    try:
        answer = await client.cancel_order(args.desk, args.order_id, _operator(args))
    except OperatorRequestError as exc:
        print(printable(f"trading-agent: {exc.message}"), file=sys.stderr)
        return EXIT_REFUSED if exc.status < 500 else 1
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    order = answer["order"]
    print(printable(f"{args.desk}: order {order['order_id']} ({order['side']} {order['type']} "
                    f"{order['amount']} {order['symbol']}) is {order['status']}; filled "
                    f"{order['filled']}."))
    return 0


def _operator(args: argparse.Namespace) -> str:
    if args.operator:
        return str(args.operator)
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "operator"
