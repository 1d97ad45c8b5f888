"""An order call the daemon never answered gets its real outcome on restore.

A desk's turn is stored as the daemon stores it (the turn's events, the trigger, the model's
``place_order`` call) in a real SQLite store; the order is placed, or not, by the real
``place_order`` tool on a real paper exchange (or on ccxt against the fake Binance); then
the conversation is restored with :class:`OrderOutcomes` and the tool result the model reads
is checked. The last test kills a real daemon right after its paper order filled.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.harness import is_valid_transcript, wait_for
from tests.daemon.process import DaemonProcess, short_dir, write_config
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, Step, ToolCall
from trading_agent.agent.conversation import (
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.errors import ToolError
from trading_agent.store import INTERRUPTED_NOTICE, Store, database_path
from trading_agent.store.order_journal import SqliteOrderJournal
from trading_agent.store.paper_books import SqlitePaperBooks
from trading_agent.store.recovery import LOOKED_UP_NOTE
from trading_agent.tools.orders import register_order_tools
from trading_agent.trading.ccxt_exchange import CcxtExchange
from trading_agent.trading.config import (
    CcxtExchangeConfig,
    PaperExchangeConfig,
    ReplayConfig,
    RiskLimits,
)
from trading_agent.trading.exchange import Exchange, client_order_id_for
from trading_agent.trading.order_outcomes import OrderOutcomes
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.replay import ReplayFeed
from trading_agent.trading.risk import RiskPolicy

from .binance_server import FakeBinance
from .conftest import ENVIRON, RecordingSleep

D = Decimal
DESK = "alpha"
TURN = "turn-7f3a"
PAPER = PaperExchangeConfig(starting_balances={"USDT": D("10000")}, taker_fee=D("0.001"),
                            maker_fee=D("0.0008"), slippage_bps=D("10"))
MARKET_BUY = {"symbol": "BTC/USDT", "side": "buy", "type": "market", "amount": "0.01"}
RESTING_BUY = {"symbol": "BTC/USDT", "side": "buy", "type": "limit", "amount": "0.01",
               "price": "2"}


class Transcript:
    """A desk's turn written to the store as the daemon writes it, up to a tool round: each
    message with its turn, a held call's approval before the call goes on."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.at = time.time() - 100

    def tick(self) -> float:
        self.at += 1
        return self.at

    async def turn(self, turn: str = TURN, *, text: str = "Buy 0.01 BTC.") -> None:
        await self.store.transcripts.append_message(DESK, Message(
            role="user", kind="operator", content=(TextBlock(text),), created_at=self.tick()),
            turn=turn)

    async def calls(self, *calls: tuple[str, str, dict[str, Any]], turn: str | None = TURN
                    ) -> None:
        """The model's tool calls (id, tool, arguments)."""
        await self.store.transcripts.append_message(DESK, Message(
            role="assistant", created_at=self.tick(), content=tuple(
            ToolUseBlock(call_id, name, json.dumps(arguments))
            for call_id, name, arguments in calls)), turn=turn)

    async def held(self, call_id: str, outcome: str | None = None, *, turn: str = TURN) -> None:
        """The call waited for an operator's approval (and, with ``outcome``, got it)."""
        await self.store.held_calls.record_approval(DESK, turn, call_id, "ab12cd34", None)
        if outcome is not None:
            await self.store.held_calls.record_approval(DESK, turn, call_id, "ab12cd34", outcome)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    opened = await Store.open(database_path(tmp_path / "state"))
    yield opened
    await opened.close()


@pytest.fixture
async def paper(feed: ReplayFeed, store: Store) -> AsyncIterator[PaperExchange]:
    # The daemon keeps the paper books in the store's file.
    exchange = await PaperExchange.open(PAPER, feed, await SqlitePaperBooks.open(store.path, DESK))
    yield exchange
    await exchange.close()


def order_tool(exchange: Exchange) -> ToolRegistry:
    registry = ToolRegistry()
    register_order_tools(registry, exchange=exchange,
                         risk_policy=RiskPolicy(RiskLimits(), exchange), symbols=["BTC/USDT"])
    return registry


async def place(exchange: Exchange, call_id: str, arguments: dict[str, Any],
                turn: str = TURN) -> str:
    """Runs the real ``place_order`` tool for the call, as the executor would."""
    tool = order_tool(exchange).get("place_order")
    assert tool is not None
    context = ToolContext(desk=DESK, turn=turn, call_id=call_id, events=EventBus())
    result = await tool.handler(tool.arguments.model_validate(arguments), context)
    assert isinstance(result, str)
    return result


async def restored_results(store: Store, exchange: Exchange) -> tuple[ToolResultBlock, ...]:
    """The tool results the desk reads after a restore with order outcomes."""
    conversation = await store.transcripts.restore_conversation(DESK, "You trade.",
                                                    outcomes=OrderOutcomes(exchange))
    assert is_valid_transcript(conversation.messages)
    assert conversation.messages[-1].kind == "notice"
    results = conversation.messages[-2]
    assert results.kind == "tool_results"
    return tuple(results.tool_results)


async def test_an_order_that_filled_is_told_filled_with_amount_price_and_fee(
        store: Store, paper: PaperExchange) -> None:
    transcript = Transcript(store)
    await transcript.turn()
    await transcript.calls(("call_1", "place_order", MARKET_BUY))
    placed = await place(paper, "call_1", MARKET_BUY)
    assert "filled" in placed  # then the daemon was killed: the result was never stored

    (result,) = await restored_results(store, paper)

    client_id = client_order_id_for(DESK, TURN, "call_1")
    assert result.text == (
        "The daemon stopped before this place_order call answered. Looked up after the "
        f"restart on paper by its client order id {client_id}: order P1 FILLED: bought 0.01 "
        "BTC on BTC/USDT at 16,628.61 (market), fee 0.16628612 USDT. It is done: do not place it "
        "again.")
    assert not result.is_error
    transcript_rows = await store.transcripts.transcript(DESK)
    assert transcript_rows[-2]["content"][0]["content"][0]["text"] == result.text  # stored
    assert transcript_rows[-1]["text"] == f"{INTERRUPTED_NOTICE}\n{LOOKED_UP_NOTE}"


async def test_an_order_resting_on_the_book_is_told_resting_with_how_to_cancel_it(
        store: Store, paper: PaperExchange) -> None:
    transcript = Transcript(store)
    await transcript.turn()
    await transcript.calls(("call_1", "place_order", RESTING_BUY))
    await place(paper, "call_1", RESTING_BUY)

    (result,) = await restored_results(store, paper)

    assert result.text.endswith(
        "order P1 is RESTING on the book: buy limit 0.01 BTC on BTC/USDT @ 2, filled 0 "
        "so far. Do not place it again; cancel it with cancel_order(order_id='P1', "
        "symbol='BTC/USDT') if you no longer want it.")
    assert not result.is_error


async def test_an_order_never_sent_is_told_so_and_safe_to_place_again(
        store: Store, paper: PaperExchange) -> None:
    transcript = Transcript(store)
    await transcript.turn()
    await transcript.calls(("call_1", "place_order", MARKET_BUY),
                           ("call_2", "get_ticker", {"symbol": "BTC/USDT"}))

    order_result, ticker_result = await restored_results(store, paper)

    assert order_result.text.endswith(
        "it was NEVER SENT: there is no order with that id. Nothing was bought or sold; it "
        "is safe to place it again if you still want it.")
    assert order_result.is_error
    # Other tools keep the default answer.
    assert "get_ticker was interrupted before it finished; it may or may not have taken " \
        "effect" in ticker_result.text
    assert (await paper.fetch_open_orders()) == []


async def test_a_cancel_that_took_effect_is_told_canceled_and_one_that_did_not_resting(
        store: Store, paper: PaperExchange) -> None:
    transcript = Transcript(store)
    await transcript.turn()
    await transcript.calls(("call_1", "place_order", RESTING_BUY))
    await place(paper, "call_1", RESTING_BUY)
    await store.transcripts.append_message(DESK, Message(
        role="user", kind="tool_results", created_at=transcript.tick(),
        content=(ToolResultBlock("call_1", (TextBlock("Order P1 rests."),)),)), turn=TURN)
    await transcript.calls(("call_2", "cancel_order", {"order_id": "P1", "symbol": "BTC/USDT"}))
    await paper.cancel_order("P1", "BTC/USDT")  # then the daemon was killed

    (result,) = await restored_results(store, paper)

    assert result.text == (
        "The daemon stopped before this cancel_order call answered. Looked up after the "
        "restart on paper: order P1 was placed (buy limit 0.01 BTC on BTC/USDT @ 2) and is "
        "now CANCELED; nothing filled. Nothing more will fill; place a new order if you "
        "still want one.")
    assert (await paper.fetch_open_orders()) == []


async def test_a_call_held_for_approval_is_told_never_sent(
        store: Store, paper: PaperExchange) -> None:
    transcript = Transcript(store)
    await transcript.turn()
    await transcript.calls(("call_1", "place_order", MARKET_BUY))
    await transcript.held("call_1")

    (result,) = await restored_results(store, paper)

    assert result.text.endswith(
        "it was NEVER SENT: it was waiting for an operator's approval when the daemon "
        "stopped, so it never reached the exchange. Nothing was bought or sold; it is safe "
        "to place it again if you still want it (it will wait for approval again).")
    assert result.is_error


async def test_an_approved_call_whose_order_filled_is_told_filled(
        store: Store, paper: PaperExchange) -> None:
    transcript = Transcript(store)
    await transcript.turn()
    await transcript.calls(("call_1", "place_order", MARKET_BUY))
    await transcript.held("call_1", "approved")
    await place(paper, "call_1", MARKET_BUY)

    (result,) = await restored_results(store, paper)

    assert "order P1 FILLED: bought 0.01 BTC" in result.text


async def test_without_a_resolver_a_held_call_is_still_told_it_never_ran(
        store: Store) -> None:
    transcript = Transcript(store)
    await transcript.turn()
    await transcript.calls(("call_1", "place_order", MARKET_BUY))
    await transcript.held("call_1")

    conversation = await store.transcripts.restore_conversation(DESK, "You trade.")

    (result,) = conversation.messages[-2].tool_results
    assert result.text == (
        "Error: the call to place_order was waiting for an operator's approval when the "
        "daemon stopped, so it never ran. Make it again if it is still wanted (it will wait "
        "for approval again).")
    assert conversation.messages[-1].text == INTERRUPTED_NOTICE


async def test_the_turn_is_read_from_the_calls_own_message(
        store: Store, paper: PaperExchange) -> None:
    # The trigger was stored before turns were (an older file); the calls carry their turn.
    await store.transcripts.append_message(DESK, Message.user_text("Buy.", kind="operator"))
    await Transcript(store).calls(("call_1", "place_order", MARKET_BUY))
    await place(paper, "call_1", MARKET_BUY)

    (result,) = await restored_results(store, paper)

    assert "order P1 FILLED" in result.text


async def test_an_earlier_turn_reusing_the_call_id_is_not_mistaken_for_this_one(
        store: Store, paper: PaperExchange) -> None:
    transcript = Transcript(store)
    await transcript.turn("turn-1")
    await transcript.calls(("call_0", "place_order", MARKET_BUY), turn="turn-1")
    await place(paper, "call_0", MARKET_BUY, turn="turn-1")
    await store.transcripts.append_message(DESK, Message(
        role="user", kind="tool_results", created_at=transcript.tick(),
        content=(ToolResultBlock("call_0", (TextBlock("Order P1 filled."),)),)))
    await store.transcripts.append_message(DESK, Message(
        role="assistant", content=(TextBlock("Done."),), created_at=transcript.tick()))
    # The next turn's call has the same id; the daemon died before its order was sent.
    await transcript.turn("turn-2")
    await transcript.calls(("call_0", "place_order", MARKET_BUY), turn="turn-2")

    (result,) = await restored_results(store, paper)

    assert "NEVER SENT" in result.text
    assert client_order_id_for(DESK, "turn-2", "call_0") in result.text


async def test_a_held_call_of_an_earlier_turn_reusing_the_id_is_not_this_ones(
        store: Store, paper: PaperExchange) -> None:
    transcript = Transcript(store)
    await transcript.turn("turn-1")
    await transcript.calls(("call_1", "place_order", MARKET_BUY), turn="turn-1")
    await transcript.held("call_1", "denied", turn="turn-1")
    await store.transcripts.append_message(DESK, Message(
        role="user", kind="tool_results", created_at=transcript.tick(),
        content=(ToolResultBlock("call_1", (TextBlock("Denied."),)),)), turn="turn-1")
    await store.transcripts.record_turn_end(DESK, "turn-1", "answered")
    # turn-2 reuses the call id; it was never held, and its order went out before the kill.
    await transcript.turn("turn-2")
    await transcript.calls(("call_1", "place_order", MARKET_BUY), turn="turn-2")
    await place(paper, "call_1", MARKET_BUY, turn="turn-2")

    (result,) = await restored_results(store, paper)

    assert "order P1 FILLED" in result.text


async def test_with_no_turn_stored_the_default_answer_stands(
        store: Store, paper: PaperExchange) -> None:
    await store.transcripts.append_message(DESK, Message.user_text("Buy.", kind="operator"))
    await store.transcripts.append_message(DESK, Message(role="assistant", content=(
        ToolUseBlock("call_1", "place_order", json.dumps(MARKET_BUY)),)))

    (result,) = await restored_results(store, paper)

    assert "may or may not have taken effect" in result.text
    assert (await store.transcripts.transcript(DESK))[-1]["text"] == INTERRUPTED_NOTICE


async def test_a_registered_resolver_is_used_and_a_second_restore_adds_nothing(
        store: Store, paper: PaperExchange) -> None:
    transcript = Transcript(store)
    await transcript.turn()
    await transcript.calls(("call_1", "place_order", MARKET_BUY))
    await place(paper, "call_1", MARKET_BUY)
    store.transcripts.set_call_outcomes(DESK, OrderOutcomes(paper))

    first = await store.transcripts.restore_conversation(DESK, "You trade.")
    second = await store.transcripts.restore_conversation(DESK, "You trade.")

    assert "order P1 FILLED" in first.messages[-2].tool_results[0].text
    assert [m.id for m in second.messages] == [m.id for m in first.messages]
    assert len(await store.transcripts.transcript(DESK)) == 4  # trigger, calls, results, notice


async def test_a_resolver_that_raises_leaves_the_default_answer(store: Store) -> None:
    transcript = Transcript(store)
    await transcript.turn()
    await transcript.calls(("call_1", "place_order", MARKET_BUY))

    async def broken(call: object) -> None:
        raise RuntimeError("bug")

    conversation = await store.transcripts.restore_conversation(DESK, "You trade.", outcomes=broken)

    assert "may or may not" in conversation.messages[-2].tool_results[0].text


# --------------------------------------------------------------------------- ccxt


@pytest.fixture
async def live(ccxt_config: CcxtExchangeConfig, store: Store,
               sleep: RecordingSleep) -> AsyncIterator[CcxtExchange]:
    journal = await SqliteOrderJournal.open(store.path)
    exchange = await CcxtExchange.open(ccxt_config, allow_orders=True, journal=journal,
                                       environ=ENVIRON, sleep=sleep)
    yield exchange
    await exchange.close()
    await journal.close()


async def test_a_live_order_that_filled_is_found_through_the_journal(
        store: Store, live: CcxtExchange) -> None:
    transcript = Transcript(store)
    await transcript.turn()
    await transcript.calls(("call_1", "place_order", MARKET_BUY))
    await place(live, "call_1", MARKET_BUY)

    (result,) = await restored_results(store, live)

    assert "on binance by its client order id" in result.text
    assert "order 28001 FILLED: bought 0.01 BTC on BTC/USDT at 16,709.90 (market)" in \
        result.text


async def test_a_live_order_missing_from_the_journal_was_never_sent(
        store: Store, live: CcxtExchange, binance: FakeBinance) -> None:
    transcript = Transcript(store)
    await transcript.turn()
    await transcript.calls(("call_1", "place_order", MARKET_BUY))

    (result,) = await restored_results(store, live)

    assert result.text.endswith(
        "it was NEVER SENT: the order journal, written before any order goes out, has no "
        "entry for it. Nothing was bought or sold; it is safe to place it again if you still "
        "want it.")
    assert binance.count("GET", "/api/v3/order") == 0  # the journal is enough


async def test_a_live_order_the_exchange_refused_is_told_rejected(
        store: Store, live: CcxtExchange, binance: FakeBinance) -> None:
    transcript = Transcript(store)
    await transcript.turn()
    await transcript.calls(("call_1", "place_order", MARKET_BUY))
    binance.fail("POST", "/api/v3/order", "insufficient_funds")
    with pytest.raises(ToolError):
        await place(live, "call_1", MARKET_BUY)

    (result,) = await restored_results(store, live)

    assert "the exchange REJECTED it: " in result.text
    assert "Nothing was placed" in result.text
    assert result.is_error


async def test_when_the_lookup_fails_the_old_answer_names_the_client_id(
        store: Store, live: CcxtExchange, binance: FakeBinance) -> None:
    transcript = Transcript(store)
    await transcript.turn()
    await transcript.calls(("call_1", "place_order", RESTING_BUY))
    await place(live, "call_1", RESTING_BUY)
    binance.fail("GET", "/api/v3/order", "bad_gateway", "bad_gateway", "bad_gateway")

    (result,) = await restored_results(store, live)

    client_id = client_order_id_for(DESK, TURN, "call_1")
    assert result.text.startswith(
        "Error: the call to place_order was interrupted before it finished; it may or may "
        "not have taken effect, and looking it up on binance failed (")
    assert result.text.endswith(f"Its client order id is {client_id}: check list_open_orders "
                                "and get_order before placing it again.")


# --------------------------------------------------------------------------- kill -9


class FillThenHold:
    """The desk buys at market and, in the same round, delegates a task whose subagent the
    server holds: the order fills while the round is still open."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.subagent_asked = threading.Event()

    def __call__(self, request: RecordedRequest) -> Step:
        system = request.messages[0]["content"]
        if "research assistant" in system:
            self.subagent_asked.set()
            return Reply("Research done.", hold_until=self.hold)
        if request.messages[-1]["role"] == "tool":
            return Reply("Done.")
        text = json.dumps(request.messages[-1].get("content"))
        if "Buy now." in text:
            return Reply(tool_calls=[ToolCall("place_order", MARKET_BUY),
                                     ToolCall("delegate", {"task": "Study BTC/USDT."})])
        return Reply("Noted.")


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_dir() as path:
        yield path


async def test_kill_9_right_after_a_paper_order_filled_then_restore_says_it_filled(
        scripted_server: ScriptedServer, folder: Path) -> None:
    script = FillThenHold()
    scripted_server.responder = script
    config = write_config(folder, scripted_server.base_url)
    state = folder / "state"
    daemon = DaemonProcess(config)
    try:
        await daemon.wait_ready()
        async with daemon.client() as client:
            await client.send_message(DESK, "Buy now.", "ann")
        await wait_for(script.subagent_asked.is_set, 15, "the subagent's request")
        await wait_for(lambda: _filled_orders(state) == 1, 10, "the paper order to fill")
        daemon.kill()
    finally:
        daemon.close()
        script.hold.set()

    # The daemon starts again on the same state: the desk is restored and resumes.
    asked = len(scripted_server.requests)
    restarted = DaemonProcess(config)
    try:
        await restarted.wait_ready()
        await wait_for(lambda: len(scripted_server.requests) > asked, 15,
                       "the resumed turn's request")
    finally:
        restarted.close()
    resumed = scripted_server.requests[asked].messages
    order, delegate = (m for m in resumed if m["role"] == "tool")
    assert "order P1 FILLED: bought 0.01 BTC on BTC/USDT at " in order["content"]
    assert "It is done: do not place it again." in order["content"]
    assert "may or may not" not in order["content"]
    assert "delegate was interrupted" in delegate["content"]
    assert _filled_orders(state) == 1  # and nothing was placed twice


class HeldOrder:
    """The desk places an order that waits for an operator's approval (nobody answers)."""

    def __call__(self, request: RecordedRequest) -> Step:
        if request.messages[-1]["role"] == "tool":
            return Reply("Done.")
        if "Buy now." in json.dumps(request.messages[-1].get("content")):
            return Reply(tool_calls=[ToolCall("place_order", MARKET_BUY)])
        return Reply("Noted.")


async def test_kill_9_while_an_order_waits_for_approval_then_restore_says_never_sent(
        scripted_server: ScriptedServer, folder: Path) -> None:
    scripted_server.responder = HeldOrder()
    config = write_config(folder, scripted_server.base_url,
                          operator={"approval_notional_threshold": 1})
    state = folder / "state"
    daemon = DaemonProcess(config)
    try:
        await daemon.wait_ready()
        async with daemon.client() as client:
            await client.send_message(DESK, "Buy now.", "ann")
        await wait_for(lambda: _events_of(state, "approval_requested") == 1, 15,
                       "the order to wait for approval")
        daemon.kill()
    finally:
        daemon.close()

    feed = ReplayFeed.from_config(ReplayConfig())
    exchange = await PaperExchange.open(PaperExchangeConfig(), feed,
                                        await SqlitePaperBooks.open(database_path(state), DESK))
    try:
        async with await Store.open(database_path(state)) as store:
            conversation = await store.transcripts.restore_conversation(DESK, "x",
                                                            outcomes=OrderOutcomes(exchange))
    finally:
        await exchange.close()
        await feed.close()
    (order,) = conversation.messages[-2].tool_results
    assert "it was NEVER SENT: it was waiting for an operator's approval when the daemon " \
        "stopped, so it never reached the exchange." in order.text
    assert _filled_orders(state) == 0


def _events_of(state: Path, kind: str) -> int:
    database = sqlite3.connect(database_path(state))
    try:
        return int(database.execute("SELECT COUNT(*) FROM events WHERE type = ?",
                                    (kind,)).fetchone()[0])
    except sqlite3.OperationalError:
        return 0
    finally:
        database.close()


def _filled_orders(state: Path) -> int:
    database = sqlite3.connect(database_path(state))
    try:
        return int(database.execute(
            "SELECT COUNT(*) FROM paper_orders WHERE status = 'closed'").fetchone()[0])
    except sqlite3.OperationalError:
        return 0
    finally:
        database.close()
