"""``kill -9`` anywhere in a trading turn: the transcript and the paper books stay equal.

One desk, one state directory, one scripted model that trades carefully. Each operator
message opens a turn of five model rounds, one tool call each: a market buy (it fills at once
on the paper exchange), a limit buy far below the market (it rests), its cancel, a market
sell, then the answer. Every model reply is held ``_HOLD`` seconds by the server, so a
turn's rounds take a known time.

- 20 moments spread evenly over a turn: a first turn runs uninterrupted and is timed
  (message sent to answer); turn ``i`` is then cut by ``kill -9`` at ``i/20`` of that time,
  timed from the model request that precedes the moment in the timed turn (the rounds' small
  delays do not add up), and the daemon is started again on the same directory to finish it.
- The narrow moment the whole suite is about, made wide: each order call of a turn runs
  beside a research call (``delegate``) whose subagent the server holds, so the kill lands
  after the order took effect in the books and before its result was stored.

After each restart, the state directory is audited (:func:`_audit`) once the desk has
answered and is idle:

- no message id twice; each operator message in the transcript exactly once, in order;
- every tool call answered by the message right after it; every turn answered;
- the ledger equal to what the transcript says: every order in the books was placed by a
  ``place_order`` call of the transcript (matched by its client order id); each call's result
  agrees with the books (an order said filled is filled, by that amount, at that price; one
  said never sent does not exist); the transcript's last word on each order is its status in
  the books, so every fill is reported; the balances are what the fills make them;
- no client order id twice (paper orders, and the order journal when the file has one), and
  no step of a turn traded twice.

A finding is attributed to the kill after which it first appears; each test fails at the
end listing every kill with its findings and where it landed.

The scripted model does what the daemon's notice asks of a careful model: a result that says
a call "may or may not have taken effect" is checked with ``get_order`` (by the client order
id the result gives, or the resting order's id) before anything is repeated; an order the
exchange says was never sent is placed again; one it cannot look up is not repeated.
"""

from __future__ import annotations

import json
import re
import signal
import sqlite3
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.daemon.harness import is_valid_transcript
from tests.daemon.process import DaemonProcess, short_dir, write_config
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, Step, ToolCall
from trading_agent.agent.conversation import Message
from trading_agent.store.codec import decode_content
from trading_agent.store.store import Store
from trading_agent.trading.exchange import client_order_id_for
from trading_agent.trading.formatting import format_price

pytestmark = pytest.mark.slow

MOMENTS = 20
"""How many kills, spread evenly over one turn."""

_HOLD = 0.05
"""Seconds the server holds each model reply: long enough that the turn's timeline is the
server's, short enough that the daemon's own work (storing, running tools) is a good share
of the turn and so of the moments."""

_DESK = "alpha"
_SYMBOL = "BTC/USDT"
_STARTING_USDT = Decimal("10000")  # PaperExchangeConfig's default starting balance
_STEPS = ("buy", "rest", "cancel", "sell")
_PLACES = {
    "buy": {"symbol": _SYMBOL, "side": "buy", "type": "market", "amount": "0.01"},
    "rest": {"symbol": _SYMBOL, "side": "buy", "type": "limit", "amount": "0.01",
             "price": "2"},
    "sell": {"symbol": _SYMBOL, "side": "sell", "type": "market", "amount": "0.01"},
}

_EXTRA_CONFIG = """
[desks.alpha.risk]
max_open_orders = 1000
max_orders_per_hour = 100000

[desks.alpha.model]
context_window = 200000
"""
"""Room for every turn's orders: no risk limit or compaction may change what a turn does."""

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


def _text(blocks: Sequence[dict[str, Any]]) -> str:
    """The text of stored blocks, or of an OpenAI message's content parts."""
    return "\n".join(block.get("text", "") for block in blocks)


def _result_of(books: _Books, call_id: str) -> str:
    """The text of the first stored result of a call."""
    for _, _, _, blocks in books.messages:
        for block in blocks:
            if block["type"] == "tool_result" and block["tool_use_id"] == call_id:
                return _text(block.get("content", []))
    return ""


def _content_text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    return content if isinstance(content, str) else _text(content)


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
    """

    def __init__(self, research_hold: threading.Event | None = None) -> None:
        self.research_hold = research_hold
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
            return Reply("Noted.", delay=_HOLD)
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
            return Reply(f"Turn {number} done.", delay=_HOLD)
        research = _RESEARCH.search(text)
        if research and research.group(1) == step and not any(
                call.name == "delegate" for call in calls):
            return Reply(tool_calls=[action, ToolCall("delegate", {"task": "Study BTC/USDT."})],
                         delay=_HOLD)
        return Reply(tool_calls=[action], delay=_HOLD)

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
class _Books:
    """What the state directory holds, read without writing (the daemon may be running)."""

    messages: list[tuple[str, str, str, list[dict[str, Any]]]]  # id, role, kind, blocks
    turns: set[str]
    orders: dict[str, dict[str, Any]]  # by order id, oldest first
    fills: list[dict[str, Any]]
    balances: dict[str, Decimal]  # free + used
    journal_ids: list[str]


def _read(database: Path) -> _Books:
    connection = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
    connection.row_factory = sqlite3.Row
    try:
        messages = [(row["message_id"], row["role"], row["kind"], json.loads(row["content"]))
                    for row in connection.execute(
                        "SELECT message_id, role, kind, content FROM messages WHERE desk = ? "
                        "AND subagent_id IS NULL ORDER BY seq", (_DESK,))]
        turns = {row[0] for row in connection.execute(
            "SELECT DISTINCT turn FROM events WHERE desk = ? AND turn IS NOT NULL", (_DESK,))}
        orders = {row["id"]: dict(row) for row in connection.execute(
            "SELECT * FROM paper_orders WHERE account = ? ORDER BY seq", (_DESK,))}
        fills = [dict(row) for row in connection.execute(
            "SELECT * FROM paper_fills WHERE account = ? ORDER BY seq", (_DESK,))]
        balances = {row["currency"]: Decimal(row["free"]) + Decimal(row["used"])
                    for row in connection.execute(
                        "SELECT * FROM paper_balances WHERE account = ?", (_DESK,))}
        journal = connection.execute(
            "SELECT 1 FROM sqlite_master WHERE name = 'order_intents'").fetchone()
        journal_ids = [row[0] for row in connection.execute(
            "SELECT client_order_id FROM order_intents")] if journal else []
    finally:
        connection.close()
    return _Books(messages, turns, orders, fills, balances, journal_ids)


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


def _audit(books: _Books, sent: Sequence[str]) -> set[str]:
    """Every way the state directory breaks the invariants, one line each (a stable text,
    so a finding can be traced to the kill after which it first appeared)."""
    problems = {f"message {m} stored {n} times"
                for m, n in Counter(m for m, *_ in books.messages).items() if n > 1}
    delivered = [m for m, _, kind, _ in books.messages if kind in ("operator", "steering")]
    if delivered != list(sent):
        problems.add(f"operator messages in the transcript {delivered} != sent {list(sent)}")
    if not is_valid_transcript(_messages(books)):
        problems.add("the transcript is not valid to send as stored (repair changes it)")

    # Every call answered by the message right after it; every turn answered.
    uses: dict[str, dict[str, Any]] = {}
    results: dict[str, dict[str, Any]] = {}
    turn_of_call: dict[str, int] = {}
    turn, opened, answered = -1, set(), set()
    for index, (_, role, kind, blocks) in enumerate(books.messages):
        if kind == "operator" and (opening := _TURN_OPENING.search(_text(blocks))):
            turn = int(opening.group(1))
            opened.add(turn)
        if role == "assistant" and _text(blocks) == f"Turn {turn} done.":
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
        order_id = next((by_client_id[c] for c in (client_order_id_for(_DESK, t, call_id)
                                                    for t in books.turns)
                         if c in by_client_id), None)
        text = _text(results.get(call_id, {}).get("content", ()))
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
                 for statement in _statements(_text(block["content"]))}
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


def _messages(books: _Books) -> list[Message]:
    return [Message(role=role, kind=kind, id=message_id,  # type: ignore[arg-type]
                    content=decode_content(blocks, {}))
            for message_id, role, kind, blocks in books.messages]


def _changes(before: _Books, after: _Books) -> list[str]:
    """The orders a turn placed or changed, as ``P12 market buy closed``."""
    return [f"{o} {_step_of(order)} {order['status']}" for o, order in after.orders.items()
            if before.orders.get(o, {}).get("status") != order["status"]]


def _stored_last(books: _Books) -> str:
    if not books.messages:
        return "nothing"
    _, _, kind, blocks = books.messages[-1]
    calls = [b["name"] for b in blocks if b["type"] == "tool_use"]
    return f"{kind} ({', '.join(calls)})" if calls else kind


# --------------------------------------------------------------------------- the daemon


class _Desk:
    """The daemon on one state directory: started, told, killed, started again, audited."""

    def __init__(self, server: ScriptedServer, folder: Path) -> None:
        self.config = write_config(folder, server.base_url, extra=_EXTRA_CONFIG)
        self.database = folder / "state" / "trading-agent.sqlite3"
        self.sent: list[str] = []
        self.known: set[str] = set()
        self.daemon: DaemonProcess | None = None

    async def start(self) -> None:
        self.daemon = DaemonProcess(self.config)
        await self.daemon.wait_ready()

    @property
    def running(self) -> DaemonProcess:
        assert self.daemon is not None
        return self.daemon

    async def send(self, text: str, *, wait: bool = False) -> None:
        async with self.running.client() as client:
            if wait:
                reply = await client.send_and_wait(_DESK, text, "ann", wait_seconds=30)
                assert reply["reply"]["ok"], reply
            else:
                reply = await client.send_message(_DESK, text, "ann")
        self.sent.append(reply["id"])

    def kill(self) -> None:
        self.running.kill()
        self.running.close()

    async def restart_and_audit(self, turn: int, kill: _Kill) -> list[str]:
        """Starts the daemon again, waits for the desk to answer ``turn``; the findings
        that were not there before ``kill``."""
        await self.start()
        try:
            await self.idle_after(turn)
        except AssertionError as exc:
            raise AssertionError(f"after {kill.describe()}:\n{exc}") from None
        found = _audit(_read(self.database), self.sent)
        new, self.known = sorted(found - self.known), self.known | found
        return new

    async def idle_after(self, turn: int, within: float = 30) -> None:
        answer = f"Turn {turn} done."
        try:
            with anyio.fail_after(within):
                while True:
                    books = _read(self.database)
                    if books.messages and books.messages[-1][1] == "assistant" \
                            and _text(books.messages[-1][3]) == answer:
                        async with self.running.client() as client:
                            status = await client.desk(_DESK)
                        if status["state"] == "idle" and not status["queued_triggers"]:
                            return
                    await anyio.sleep(0.05)
        except TimeoutError:
            raise AssertionError(f"the desk did not answer turn {turn} within {within} s:\n"
                                 f"{self.running.log()[-3000:]}") from None

    async def stop(self, last_turn: int) -> None:
        """SIGTERM; then the store, read back as a restart would, holds nothing cut off."""
        self.running.signal(signal.SIGTERM)
        assert await self.running.wait_exit(10) == 0, self.running.log()[-3000:]
        async with await Store.open(self.database) as store:
            assert await store.undelivered_operator_messages(_DESK) == []
            restored = await store.restore_conversation(_DESK, "x")
        assert is_valid_transcript(restored.messages)
        assert restored.messages[-1].text == f"Turn {last_turn} done.", "left cut off"

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.close()


@dataclass
class _Kill:
    """One kill: where it landed, and what the audit found after the restart."""

    name: str
    landed: str = ""
    findings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return "\n    ".join([f"{self.name}: {self.landed}", *self.findings])


def _report(kills: Sequence[_Kill], preface: str) -> str:
    failing = [kill for kill in kills if kill.findings]
    return (f"{len(failing)} of {len(kills)} kills break the invariants ({preface}):\n  "
            + "\n  ".join(kill.describe() for kill in failing))


def _where(requests: Sequence[RecordedRequest], killed_at: float) -> str:
    """Where in the turn a kill landed, by the model requests the server had seen."""
    requests = [request for request in requests if request.received_at <= killed_at]
    if not requests:
        return "before the turn's first model request"
    since = killed_at - requests[-1].received_at
    if since < _HOLD:
        return f"{since * 1000:.0f} ms into the model's hold of reply {len(requests)}"
    return f"{(since - _HOLD) * 1000:.0f} ms after model reply {len(requests)} was sent"


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_dir() as path:
        yield path


async def _kill_at_moments(server: ScriptedServer, folder: Path,
                           moments: Sequence[int]) -> tuple[list[_Kill], float]:
    """One state directory: a turn timed, then a turn cut by ``kill -9`` at each of
    ``moments`` (of :data:`MOMENTS` spread over the timed turn) and finished after a
    restart; the kills with their findings, and the timed turn's length."""
    server.responder = CarefulTrader()
    desk = _Desk(server, folder)
    kills: list[_Kill] = []
    try:
        await desk.start()
        first, opened = len(server.requests), time.monotonic()
        await desk.send("Turn 0: buy, rest, cancel, sell.", wait=True)
        duration = time.monotonic() - opened
        arrivals = [0.0] + [r.received_at - opened for r in server.requests[first:]]
        assert len(arrivals) == 6, f"the plan takes 5 model rounds, not {len(arrivals) - 1}"
        desk.known = _audit(_read(desk.database), desk.sent)
        assert not desk.known, f"the uninterrupted turn breaks the invariants: {desk.known}"

        for turn, index in enumerate(moments, start=1):
            at = index / MOMENTS * duration
            anchor = max(k for k, arrival in enumerate(arrivals) if arrival <= at)
            before, base, opened = _read(desk.database), len(server.requests), \
                time.monotonic()
            await desk.send(f"Turn {turn}: buy, rest, cancel, sell.")
            with anyio.fail_after(20):
                while len(server.requests) < base + anchor:  # noqa: ASYNC110
                    await anyio.sleep(0.001)
            start = opened if anchor == 0 else server.requests[base + anchor - 1].received_at
            await anyio.sleep(max(0.0, start + at - arrivals[anchor] - time.monotonic()))
            killed_at = time.monotonic()
            desk.kill()
            books = _read(desk.database)
            kill = _Kill(f"moment {index} ({index}/{MOMENTS} of the turn, {at * 1000:.0f} ms)",
                         f"{_where(server.requests[base:], killed_at)}; stored last: "
                         f"{_stored_last(books)}; books: {_changes(before, books) or 'as before'}")
            kills.append(kill)
            kill.findings = await desk.restart_and_audit(turn, kill)
        await desk.stop(len(moments))
    finally:
        desk.close()
    return kills, duration


@pytest.mark.timeout(300)
async def test_kill_9_at_20_moments_of_an_order_turn_keeps_transcript_and_books_equal(
        scripted_server: ScriptedServer) -> None:
    # Two state directories, each with its own server, take every other moment side by
    # side: a restart is mostly the daemon's start, and two of them share the two cores.
    kills: dict[int, tuple[list[_Kill], float]] = {}
    with ScriptedServer() as other_server, short_dir() as first, short_dir() as second:

        async def lane(number: int, server: ScriptedServer, folder: Path) -> None:
            kills[number] = await _kill_at_moments(server, folder, range(number, MOMENTS, 2))

        async with anyio.create_task_group() as group:
            group.start_soon(lane, 0, scripted_server, first)
            group.start_soon(lane, 1, other_server, second)
    every = sorted([*kills[0][0], *kills[1][0]], key=lambda kill: int(kill.name.split()[1]))
    assert len(every) == MOMENTS
    timed = ", ".join(f"{duration * 1000:.0f} ms" for _, duration in kills.values())
    assert not any(kill.findings for kill in every), _report(
        every, f"the timed turns took {timed}")


@pytest.mark.timeout(120)
async def test_kill_9_after_each_order_took_effect_and_before_its_result_was_stored(
        scripted_server: ScriptedServer, folder: Path) -> None:
    hold = threading.Event()
    script = CarefulTrader(research_hold=hold)
    scripted_server.responder = script
    desk = _Desk(scripted_server, folder)
    wanted = {"buy": "market buy closed", "rest": "limit buy open",
              "cancel": "limit buy canceled", "sell": "market sell closed"}
    kills: list[_Kill] = []
    try:
        await desk.start()
        for turn, step in enumerate(_STEPS, start=1):
            hold.clear()
            script.research_asked.clear()
            before = _read(desk.database)
            await desk.send(f"Turn {turn}: buy, rest, cancel, sell; research beside the {step}.")
            with anyio.fail_after(20):
                while not (script.research_asked.is_set() and any(  # noqa: ASYNC110
                        change.endswith(wanted[step])
                        for change in _changes(before, _read(desk.database)))):
                    await anyio.sleep(0.005)
            desk.kill()
            hold.set()  # the killed daemon's subagent request ends; nothing else is held
            books = _read(desk.database)
            kill = _Kill(f"the {step}", f"stored last: {_stored_last(books)}; books: "
                                        f"{_changes(before, books)}")
            kills.append(kill)
            call = "cancel_order" if step == "cancel" else "place_order"
            assert _stored_last(books) == f"assistant ({call}, delegate)", \
                f"the kill missed the moment it aims at: {kill.landed}"
            (call_id,) = [b["id"] for b in books.messages[-1][3]
                          if b["type"] == "tool_use" and b["name"] == call]
            kill.findings = await desk.restart_and_audit(turn, kill)
            # The restore looked the cut-off order call up: a definite answer, not a guess.
            answer = _result_of(_read(desk.database), call_id)
            if "may or may not" in answer or "looked up after the restart" not in answer.lower():
                kill.findings.append(f"the restore did not look {call} up: {answer!r}")
        await desk.stop(len(_STEPS))
    finally:
        hold.set()
        desk.close()
    assert not any(kill.findings for kill in kills), _report(
        kills, "each order took effect in the books, its result was not stored yet")
