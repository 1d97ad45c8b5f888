"""Write fencing: a store opened with a fence refuses, changing nothing, every write for a
desk the fence says this daemon no longer holds; the other desks' writes land, even in the
same group commit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, date, datetime
from decimal import Decimal

import anyio
import pytest

from tests.store.conftest import FakeClock
from trading_agent.agent.conversation import Message
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import ErrorEvent, UsageReported
from trading_agent.agent.steering_inbox import SteeringMessage
from trading_agent.store import Connection, FencedError, Store, StoreTarget
from trading_agent.store.database import Database
from trading_agent.store.memory_notes import SqliteMemory
from trading_agent.store.order_journal import SqliteOrderJournal
from trading_agent.store.paper_books import SqlitePaperBooks
from trading_agent.store.risk_records import SqliteRiskRecords
from trading_agent.trading.exchange import OrderRequest
from trading_agent.trading.ledger import LedgerChanges
from trading_agent.trading.risk_journal import DayState

AT = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
REFUSAL = ("desk b: this daemon no longer holds it (lease epoch 7 is stale); the write was "
           "refused")


class LostDeskB:
    """A fence for a daemon that holds desk ``a`` and lost desk ``b`` (at epoch 7)."""

    def __init__(self) -> None:
        self.checked: list[str] = []

    def check(self, connection: Connection, desk: str) -> None:
        # As the lease side does: a query in the write's own transaction.
        assert connection.execute("SELECT 1").fetchone()[0] == 1
        self.checked.append(desk)
        if desk == "b":
            raise FencedError(desk, 7)


@pytest.fixture
def fence() -> LostDeskB:
    return LostDeskB()


@pytest.fixture
async def fenced(target: StoreTarget, fence: LostDeskB) -> AsyncIterator[Store]:
    opened = await Store.open(target, clock=FakeClock(AT.timestamp()), fence=fence)
    try:
        yield opened
    finally:
        await opened.close()


async def test_writes_for_a_held_desk_land_and_for_a_lost_one_change_nothing(
        fenced: Store, fence: LostDeskB) -> None:
    await fenced.transcripts.append_message("a", Message.user_text("kept"))
    with pytest.raises(FencedError) as refused:
        await fenced.transcripts.append_message("b", Message.user_text("late"))
    assert str(refused.value) == REFUSAL
    assert (refused.value.desk, refused.value.epoch) == ("b", 7)
    assert [row["text"] for row in await fenced.transcripts.transcript("a")] == ["kept"]
    assert await fenced.transcripts.transcript("b") == []

    refused_writes = {
        "operator message": fenced.inbox.add_operator_message("b", SteeringMessage(text="sell")),
        "turn end": fenced.transcripts.record_turn_end("b", "t1", "answered"),
        "approval": fenced.held_calls.record_approval("b", "t1", "c1", "ap1", None),
        "schedule": fenced.schedules.record_schedule_fired("b", "hourly", AT),
        "usage": fenced.usage.add_usage("b", input_tokens=1, output_tokens=1, cost=None),
        "equity": fenced.equity.record_equity_sample("b", 100.0),
        "compaction": fenced.transcripts.record_compaction("b", Message.user_text("summary"), None),
        "spend resume": fenced.spend.record_spend_resume("b", AT.date()),
    }
    for name, write in refused_writes.items():
        with pytest.raises(FencedError, match="desk b"):
            await write
        assert fence.checked[-1] == "b", name
    assert await fenced.inbox.undelivered_operator_messages("b") == []
    assert await fenced.transcripts.turn_end("b", "t1") is None
    assert await fenced.held_calls.held_calls("b", "t1") == {}
    assert await fenced.schedules.schedule_last_fired("b") == {}
    assert (await fenced.usage.usage_on("b", AT.date())).requests == 0
    assert await fenced.equity.equity_samples("b") == []
    assert await fenced.spend.spend_resumes(AT.date()) == set()


async def test_in_one_group_commit_only_the_lost_desks_writes_are_refused(
        fenced: Store) -> None:
    outcomes: dict[str, object] = {}

    async def append(desk: str, text: str) -> None:
        try:
            outcomes[text] = await fenced.transcripts.append_message(desk, Message.user_text(text))
        except FencedError as exc:
            outcomes[text] = exc

    async with anyio.create_task_group() as group:
        for number in range(10):
            group.start_soon(append, "a" if number % 2 else "b", f"m{number}")
    assert fenced.database.commits < 10  # they shared commits
    assert sorted(text for text, outcome in outcomes.items()
                  if isinstance(outcome, FencedError)) == ["m0", "m2", "m4", "m6", "m8"]
    assert [row["text"] for row in await fenced.transcripts.transcript("a")] == [
        "m1", "m3", "m5", "m7", "m9"]
    assert await fenced.transcripts.transcript("b") == []


async def test_events_of_a_lost_desk_are_left_out_and_the_others_stored(
        fenced: Store) -> None:
    bus = EventBus(first_id=1)
    usage = [UsageReported(desk=desk, input_tokens=10, output_tokens=1, estimated=False,
                           cost=None, context_tokens=11, context_window=100,
                           at=AT.timestamp()) for desk in ("a", "b")]
    events = [bus.publish(event) for event in (
        ErrorEvent(desk="a", message="one", error_type="E"),
        ErrorEvent(desk="b", message="two", error_type="E"), *usage)]
    assert await fenced.events.append_events(events) == 2
    assert [(event["desk"], event["type"]) for event in await fenced.events.events_since(0)] == [
        ("a", "error"), ("a", "usage")]
    assert (await fenced.usage.usage_on("a", AT.date())).requests == 1
    assert (await fenced.usage.usage_on("b", AT.date())).requests == 0
    # A fenced store is a fleet's: each daemon numbers its events from a block of its own,
    # so no high water is kept (a row every daemon wrote would make them wait on each other).
    assert await fenced.events.last_event_id() == 3


async def test_a_hold_without_a_fence_is_not_fenced(fenced: Store, target: StoreTarget) -> None:
    async with await Store.open(target) as unfenced:
        await unfenced.transcripts.append_message("b", Message.user_text("one daemon"))
    assert [row["text"] for row in await fenced.transcripts.transcript("b")] == ["one daemon"]


async def test_the_trading_parts_fence_every_write(target: StoreTarget,
                                                   fence: LostDeskB) -> None:
    books = await SqlitePaperBooks.open(target, "b", fence=fence, desk="b")
    journal = await SqliteOrderJournal.open(target, fence=fence, desk="b")
    records = await SqliteRiskRecords.open(target, fence=fence)
    memory = await SqliteMemory.open(target, "b", fence=fence)
    try:
        start = LedgerChanges(AT, balances={"USDT": (Decimal(1000), Decimal(0))})
        with pytest.raises(FencedError, match="desk b"):
            await books.create_account(start)
        assert not (await books.load()).exists
        request = OrderRequest("BTC/USDT", "buy", "market", Decimal("0.1"))
        with pytest.raises(FencedError, match="desk b"):
            await journal.record(request, "paper", AT)
        assert await journal.get(request.client_order_id) is None
        with pytest.raises(FencedError, match="desk b"):
            await records.add_order("b", "cid-1", AT)
        with pytest.raises(FencedError, match="desk b"):
            await records.put_day("b", DayState(date(2025, 6, 1), Decimal(1000)))
        await records.add_order("a", "cid-2", AT)  # each record is fenced on its own desk
        assert await records.load("b", datetime(2025, 1, 1, tzinfo=UTC),
                                  date(2025, 1, 1)) == ([], {})
        assert (await records.load("a", datetime(2025, 1, 1, tzinfo=UTC),
                                   date(2025, 1, 1)))[0] == [AT]
        with pytest.raises(FencedError, match="desk b"):
            await memory.remember("plan", "buy the dip")
        assert await memory.recall("plan") is None
    finally:
        for part in (books, journal, records, memory):
            await part.close()


async def test_a_database_write_names_its_desk_to_be_fenced(target: StoreTarget,
                                                            fence: LostDeskB) -> None:
    database = await Database.open(target, ((1, ("CREATE TABLE notes (text TEXT)",)),),
                                   "test", fence=fence)
    try:
        def insert(connection: Connection) -> None:
            connection.execute("INSERT INTO notes (text) VALUES ('x')")

        await database.write(insert)  # no desk: not fenced
        await database.write(insert, desk="a")
        with pytest.raises(FencedError):
            await database.write(insert, desk="b")
        count = await database.read(lambda connection: connection.execute(
            "SELECT COUNT(*) FROM notes").fetchone()[0])
        assert (count, fence.checked) == (2, ["a", "b"])
    finally:
        await database.close()
