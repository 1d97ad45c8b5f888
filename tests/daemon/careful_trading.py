"""A careful scripted trader and the audit of what it leaves in the books, shared by the
tests that cut a trading turn off (``kill -9`` on one daemon, a fleet's take-over).

:class:`CarefulTrader` is the scripted model: each operator message ``Turn N: ...`` opens a
turn of five rounds, one tool call each: a market buy (it fills at once on the paper
exchange), a limit buy far below the market (it rests), its cancel, a market sell, then the
answer ``Turn N done.``. It does what the daemon's notice asks of a careful model: a result
that says a call "may or may not have taken effect" is checked with ``get_order`` before
anything is repeated.

:func:`audit` lists every way a desk's stored state breaks the invariants (see
``test_kill_anywhere``'s docstring): messages once each, every call answered, the ledger
equal to what the transcript says, no client order id twice.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from tests.daemon.harness import is_valid_transcript
from tests.scripted_server import RecordedRequest, Reply, Step, ToolCall
from trading_agent.agent.conversation import Message
from trading_agent.store.codec import decode_content
from trading_agent.trading.exchange import client_order_id_for
from trading_agent.trading.formatting import format_price

HOLD = 0.05
"""Seconds the server holds each model reply: long enough that the turn's timeline is the
server's, short enough that the daemon's own work (storing, running tools) is a good share
of the turn and so of the moments."""

_SYMBOL = "BTC/USDT"
_STARTING_USDT = Decimal("10000")  # PaperExchangeConfig's default starting balance
STEPS = ("buy", "rest", "cancel", "sell")
_PLACES = {
    "buy": {"symbol": _SYMBOL, "side": "buy", "type": "market", "amount": "0.01"},
    "rest": {"symbol": _SYMBOL, "side": "buy", "type": "limit", "amount": "0.01",
             "price": "2"},
    "sell": {"symbol": _SYMBOL, "side": "sell", "type": "market", "amount": "0.01"},
}


_TURN_OPENING = re.compile(r"a human operator\]\nTurn (\d+):")
_RESEARCH = re.compile(r"research beside the (\w+)")
_UNCERTAIN = "may or may not have taken effect"
_CLIENT_ID = re.compile(r"client order id (ta[0-9a-f]{30})")
_ORDER_ID = re.compile(r"\b(P\d+)\b")
_DESCRIBED = re.compile(r"(P\d+): (buy|sell) (market|limit) ([\d.]+) \w+ on \S+"
                        r"(?: @ [\d,.]+)?, (open|closed|canceled|rejected|expired)")
_FILLED = re.compile(r"\b[Oo]rder (P\d+) (?:filled|FILLED): (?:bought|sold) ([\d.]+) \w+ "
                     r"on \S+ at ([\d,.]+)")
_RESTING = re.compile(r"\b[Oo]rder (P\d+) (?:placed and resting|is RESTING)")
_LOOKED_UP = re.compile(r"order (P\d+) (?:was REJECTED|was placed .*? and is now ([A-Z]+))")


def text_of(blocks: Sequence[dict[str, Any]]) -> str:
    """The text of stored blocks, or of an OpenAI message's content parts."""
    return "\n".join(block.get("text", "") for block in blocks)


def result_of(books: Books, call_id: str) -> str:
    """The text of the first stored result of a call."""
    for _, _, _, blocks in books.messages:
        for block in blocks:
            if block["type"] == "tool_result" and block["tool_use_id"] == call_id:
                return text_of(block.get("content", []))
    return ""


def _content_text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    return content if isinstance(content, str) else text_of(content)


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class _Call:
    """A tool call of the turn, and the result the desk read (None: not answered yet)."""

    name: str
    arguments: dict[str, Any]
    result: str | None


class CarefulTrader:
    """The scripted model: works through the turn's plan as its tool results stand.

    A pure function of the request, so a restarted daemon's requests (the same conversation,
    repaired, with a notice) are answered from where the turn really stands.

    Args:
        research_hold: What a subagent's reply waits for; an operator message saying
            ``research beside the STEP`` makes that step's first call go out beside a
            ``delegate`` call, whose result (and so the round's) waits for it.
        hold: Seconds each reply is held before it is sent.
    """

    def __init__(self, research_hold: threading.Event | None = None, *,
                 hold: float = HOLD) -> None:
        self.research_hold = research_hold
        self.hold = hold
        self.research_asked = threading.Event()

    def __call__(self, request: RecordedRequest) -> Step:
        if "research assistant" in request.messages[0]["content"]:
            self.research_asked.set()
            return Reply("Research done: nothing new.", hold_until=self.research_hold)
        messages = request.messages
        opening = next((index for index in range(len(messages) - 1, -1, -1)
                        if messages[index]["role"] == "user"
                        and _TURN_OPENING.search(_content_text(messages[index]))), None)
        if opening is None:
            return Reply("Noted.", delay=self.hold)
        text = _content_text(messages[opening])
        results = {m["tool_call_id"]: _content_text(m) for m in messages[opening:]
                   if m["role"] == "tool"}
        calls = [_Call(call["function"]["name"], json.loads(call["function"]["arguments"]),
                       results.get(call["id"]))
                 for message in messages[opening:] if message["role"] == "assistant"
                 for call in message.get("tool_calls") or ()]
        step, action = self._next(calls)
        number = _TURN_OPENING.search(text).group(1)  # type: ignore[union-attr]
        if action is None:
            return Reply(f"Turn {number} done.", delay=self.hold)
        research = _RESEARCH.search(text)
        if research and research.group(1) == step and not any(
                call.name == "delegate" for call in calls):
            return Reply(tool_calls=[action, ToolCall("delegate", {"task": "Study BTC/USDT."})],
                         delay=self.hold)
        return Reply(tool_calls=[action], delay=self.hold)

    def _next(self, calls: list[_Call]) -> tuple[str, ToolCall | None]:
        """The step under way and the call it needs, or None once the plan is done."""
        bought = self._place("buy", calls)
        if isinstance(bought, ToolCall):
            return "buy", bought
        resting = self._place("rest", calls)
        if isinstance(resting, ToolCall):
            return "rest", resting
        if resting is not None:
            cancel = self._cancel(resting, calls)
            if cancel is not None:
                return "cancel", cancel
        sold = self._place("sell", calls)
        return "sell", sold if isinstance(sold, ToolCall) else None

    def _place(self, step: str, calls: list[_Call]) -> ToolCall | str | None:
        """The call a ``place_order`` step needs, else its order id once settled (None when
        it failed or cannot be known: such a step is never repeated blindly)."""
        wanted = _PLACES[step]
        for index, call in enumerate(calls):
            if call.name != "place_order" or call.arguments != wanted:
                continue
            result = call.result or ""
            if "NEVER SENT" in result:
                continue  # safe to place again, the result says
            if _UNCERTAIN not in result:
                found = _ORDER_ID.search(result)
                return found.group(1) if found and "REJECTED" not in result else None
            client_id = _CLIENT_ID.search(result)
            if client_id is None:
                return None  # nothing to look it up by: not repeated
            checked = self._checked(client_id.group(1), calls[index + 1:])
            if checked is None:
                return ToolCall("get_order", {"order_id": client_id.group(1), "symbol": _SYMBOL})
            if checked != "missing":
                return checked[0]
        return ToolCall("place_order", dict(wanted))

    def _cancel(self, order_id: str, calls: list[_Call]) -> ToolCall | None:
        """The call the cancel needs, or None once the order is not open."""
        for index, call in enumerate(calls):
            if call.name != "cancel_order" or call.arguments.get("order_id") != order_id:
                continue
            if _UNCERTAIN not in (call.result or ""):
                return None  # cancelled, or the exchange says there is nothing to cancel
            checked = self._checked(order_id, calls[index + 1:])
            if checked is None:
                return ToolCall("get_order", {"order_id": order_id, "symbol": _SYMBOL})
            if checked == "missing" or checked[1] != "open":
                return None
        return ToolCall("cancel_order", {"order_id": order_id, "symbol": _SYMBOL})

    @staticmethod
    def _checked(order_id: str, later: list[_Call]) -> tuple[str, str] | str | None:
        """What the last conclusive ``get_order`` of ``order_id`` said: ``(id, status)``,
        ``"missing"``, or None when there is none yet."""
        for call in reversed(later):
            if call.name != "get_order" or call.arguments.get("order_id") != order_id:
                continue
            described = _DESCRIBED.search(call.result or "")
            if described is not None:
                return described.group(1), described.group(5)
            if "has no order" in (call.result or ""):
                return "missing"
        return None


# --------------------------------------------------------------------------- the audit


@dataclass
class Books:
    """What the state directory holds, read without writing (the daemon may be running)."""

    desk: str
    messages: list[tuple[str, str, str, list[dict[str, Any]]]]  # id, role, kind, blocks
    turns: set[str]
    orders: dict[str, dict[str, Any]]  # by order id, oldest first
    fills: list[dict[str, Any]]
    balances: dict[str, Decimal]  # free + used
    journal_ids: list[str]
    book_orders: dict[str, dict[str, Any]]  # the desk's own books, by client order id
    book_fills: list[dict[str, Any]]
    book_positions: dict[str, Decimal]  # by symbol


def read_books(database: Path, desk: str = "alpha") -> Books:
    """What a SQLite state file holds of ``desk``, read without writing."""
    connection = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
    connection.row_factory = sqlite3.Row
    try:
        messages = [(row["message_id"], row["role"], row["kind"], json.loads(row["content"]))
                    for row in connection.execute(
                        "SELECT message_id, role, kind, content FROM messages WHERE desk = ? "
                        "AND subagent_id IS NULL ORDER BY seq", (desk,))]
        turns = {row[0] for row in connection.execute(
            "SELECT DISTINCT turn FROM events WHERE desk = ? AND turn IS NOT NULL", (desk,))}
        orders = {row["id"]: dict(row) for row in connection.execute(
            "SELECT * FROM paper_orders WHERE account = ? ORDER BY seq", (desk,))}
        fills = [dict(row) for row in connection.execute(
            "SELECT * FROM paper_fills WHERE account = ? ORDER BY seq", (desk,))]
        balances = {row["currency"]: Decimal(row["free"]) + Decimal(row["used"])
                    for row in connection.execute(
                        "SELECT * FROM paper_balances WHERE account = ?", (desk,))}
        journal = connection.execute(
            "SELECT 1 FROM sqlite_master WHERE name = 'order_intents'").fetchone()
        journal_ids = [row[0] for row in connection.execute(
            "SELECT client_order_id FROM order_intents")] if journal else []
        book_orders = {row["client_order_id"]: dict(row) for row in connection.execute(
            "SELECT * FROM book_orders WHERE desk = ?", (desk,))}
        book_fills = [dict(row) for row in connection.execute(
            "SELECT * FROM book_fills WHERE desk = ? ORDER BY seq", (desk,))]
        book_positions = {row["symbol"]: Decimal(row["amount"]) for row in connection.execute(
            "SELECT symbol, amount FROM book_positions WHERE desk = ?", (desk,))}
    finally:
        connection.close()
    return Books(desk, messages, turns, orders, fills, balances, journal_ids, book_orders,
                 book_fills, book_positions)


@dataclass(frozen=True)
class _Statement:
    """What one tool result says of one order."""

    order_id: str
    status: str
    filled: Decimal | None = None
    price: str | None = None


def _statements(text: str) -> list[_Statement]:
    """Every order status a tool result states, in the order tools' and the restore's words."""
    found = [_Statement(m.group(1), "closed", Decimal(m.group(2)), m.group(3))
             for m in _FILLED.finditer(text)]
    found += [_Statement(m.group(1), "open") for m in _RESTING.finditer(text)]
    found += [_Statement(m.group(1), (m.group(2) or "rejected").lower())
              for m in _LOOKED_UP.finditer(text)]
    found += [_Statement(m.group(1), m.group(5)) for m in _DESCRIBED.finditer(text)
              if not any(s.order_id == m.group(1) for s in found)]
    return found


def audit(books: Books, sent: Sequence[str]) -> set[str]:
    """Every way the state directory breaks the invariants, one line each (a stable text,
    so a finding can be traced to the kill after which it first appeared)."""
    problems = {f"message {m} stored {n} times"
                for m, n in Counter(m for m, *_ in books.messages).items() if n > 1}
    delivered = [m for m, _, kind, _ in books.messages if kind in ("operator", "steering")]
    if delivered != list(sent):
        problems.add(f"operator messages in the transcript {delivered} != sent {list(sent)}")
    if not is_valid_transcript(as_messages(books)):
        problems.add("the transcript is not valid to send as stored (repair changes it)")

    # Every call answered by the message right after it; every turn answered.
    uses: dict[str, dict[str, Any]] = {}
    results: dict[str, dict[str, Any]] = {}
    turn_of_call: dict[str, int] = {}
    turn, opened, answered = -1, set(), set()
    for index, (_, role, kind, blocks) in enumerate(books.messages):
        if kind == "operator" and (opening := _TURN_OPENING.search(text_of(blocks))):
            turn = int(opening.group(1))
            opened.add(turn)
        if role == "assistant" and text_of(blocks) == f"Turn {turn} done.":
            answered.add(turn)
        following = books.messages[index + 1][3] if index + 1 < len(books.messages) else []
        given = {b["tool_use_id"]: b for b in following if b["type"] == "tool_result"}
        for use in (b for b in blocks if b["type"] == "tool_use" and role == "assistant"):
            uses[use["id"]], turn_of_call[use["id"]] = use, turn
            if use["id"] in given:
                results[use["id"]] = given[use["id"]]
            else:
                problems.add(f"call {use['id']} ({use['name']}) has no result after it")
    problems |= {f"turn {n} was never answered" for n in opened - answered}

    # Each order in the books to the place_order call that placed it, by client order id.
    by_client_id = {order["client_order_id"]: order["id"] for order in books.orders.values()}
    placed_by: dict[str, str] = {}
    for call_id, use in uses.items():
        if use["name"] != "place_order":
            continue
        order_id = next((by_client_id[c] for c in (client_order_id_for(books.desk, t, call_id)
                                                    for t in books.turns)
                         if c in by_client_id), None)
        text = text_of(results.get(call_id, {}).get("content", ()))
        said = _statements(text)
        if order_id is not None:
            placed_by[order_id] = call_id
        if "NEVER SENT" in text and order_id is not None:
            problems.add(f"call {call_id}: the result says never sent, yet the books hold "
                         f"order {order_id} ({books.orders[order_id]['status']})")
        elif said and order_id is None:
            problems.add(f"call {call_id}: the result speaks of order {said[0].order_id}; "
                         "the books hold no order with the call's client order id")
        elif said and said[0].order_id != order_id:
            problems.add(f"call {call_id}: the result names {said[0].order_id}, the call's "
                         f"client order id is that of {order_id}")
        elif (results.get(call_id, {}).get("is_error") and _UNCERTAIN not in text and not said
              and order_id is not None):
            problems.add(f"call {call_id}: the result is a refusal ({text[:80]!r}), yet the "
                         f"books hold order {order_id}")
    problems |= {f"order {o} ({order['status']}) is in the books, but no place_order call of "
                 "the transcript placed it"
                 for o, order in books.orders.items() if o not in placed_by}

    # The transcript's last word on each order is its status in the books.
    last_word = {statement.order_id: statement
                 for *_, blocks in books.messages for block in blocks
                 if block["type"] == "tool_result"
                 for statement in _statements(text_of(block["content"]))}
    filled: dict[str, Decimal] = defaultdict(Decimal)
    for fill in books.fills:
        filled[fill["order_id"]] += Decimal(fill["amount"])
    for order_id, order in books.orders.items():
        last, amount = last_word.get(order_id), filled[order_id]
        if amount != Decimal(order["filled"]):
            problems.add(f"order {order_id}: fills of {amount}, filled {order['filled']}")
        if last is None:
            problems.add(f"order {order_id} is {order['status']} in the books"
                         f"{f' (filled {amount})' if amount else ''}; no tool result says so")
        elif last.status != order["status"]:
            problems.add(f"order {order_id} is {order['status']} in the books; the transcript "
                         f"last says {last.status}")
        elif last.filled is not None and (
                last.filled != amount or last.price != format_price(Decimal(order["average"]))):
            problems.add(f"order {order_id}: reported filled {last.filled} at {last.price}; "
                         f"the books hold {amount} at {order['average']}")

    # The balances (free plus held back) are what the fills make them.
    expected = {"USDT": _STARTING_USDT, "BTC": Decimal(0)}
    for fill in books.fills:
        sign = 1 if fill["side"] == "buy" else -1
        expected["BTC"] += sign * Decimal(fill["amount"])
        expected["USDT"] -= sign * Decimal(fill["amount"]) * Decimal(fill["price"]) + Decimal(
            fill["fee"])
    problems |= {f"{currency} balance {books.balances.get(currency, Decimal(0))}, the fills "
                 f"make it {amount}" for currency, amount in expected.items()
                 if books.balances.get(currency, Decimal(0)) != amount}

    # The desk's own books hold every fill once: each order's counted part is its fills,
    # and the position is what the fills make it.
    counted: dict[str, Decimal] = defaultdict(Decimal)
    for fill in books.book_fills:
        counted[fill["client_order_id"]] += Decimal(fill["amount"])
    for order in books.orders.values():
        client_id = order["client_order_id"]
        booked = books.book_orders.get(client_id)
        if booked is None:
            problems.add(f"order {order['id']} is not in the desk's books")
        elif counted[client_id] != filled[order["id"]] or Decimal(booked["filled"]) != (
                filled[order["id"]]):
            problems.add(f"order {order['id']}: the desk's books count {counted[client_id]} "
                         f"(order row {booked['filled']}), the fills are {filled[order['id']]}")
    problems |= {f"fill {f} is {n} times in the desk's books"
                 for f, n in Counter(f["fill_id"] for f in books.book_fills).items() if n > 1}
    held = books.book_positions.get("BTC/USDT", Decimal(0))
    if held != expected["BTC"]:
        problems.add(f"the desk's books hold {held} BTC, the fills make it {expected['BTC']}")

    # No client order id twice; no step of a turn traded twice.
    for name, client_ids in (("paper orders", [o["client_order_id"]
                                               for o in books.orders.values()]),
                             ("order journal", books.journal_ids)):
        problems |= {f"client order id {c} is {n} times in the {name}"
                     for c, n in Counter(client_ids).items() if n > 1}
    steps = Counter((turn_of_call[call_id], _step_of(books.orders[order_id]))
                    for order_id, call_id in placed_by.items())
    problems |= {f"turn {t} placed its {step} {n} times"
                 for (t, step), n in steps.items() if n > 1}
    return problems


def _step_of(order: dict[str, Any]) -> str:
    return "limit buy" if order["type"] == "limit" else f"market {order['side']}"


def as_messages(books: Books) -> list[Message]:
    return [Message(role=role, kind=kind, id=message_id,  # type: ignore[arg-type]
                    content=decode_content(blocks, {}))
            for message_id, role, kind, blocks in books.messages]


def changes(before: Books, after: Books) -> list[str]:
    """The orders a turn placed or changed, as ``P12 market buy closed``."""
    return [f"{o} {_step_of(order)} {order['status']}" for o, order in after.orders.items()
            if before.orders.get(o, {}).get("status") != order["status"]]


def stored_last(books: Books) -> str:
    if not books.messages:
        return "nothing"
    _, _, kind, blocks = books.messages[-1]
    calls = [b["name"] for b in blocks if b["type"] == "tool_use"]
    return f"{kind} ({', '.join(calls)})" if calls else kind


