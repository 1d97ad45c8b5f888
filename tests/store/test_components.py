"""The trading layer's parts in the store, on both engines: what each writes it reads back
(the trading tests cover their behaviour on a SQLite file)."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from trading_agent.store import StoreTarget
from trading_agent.store.halts import SqliteHalts
from trading_agent.store.memory_notes import SqliteMemory
from trading_agent.store.order_journal import SqliteOrderJournal
from trading_agent.store.paper_books import SqlitePaperBooks
from trading_agent.store.pinned_instructions import SqlitePins
from trading_agent.store.risk_records import SqliteRiskRecords
from trading_agent.trading.exchange import Balance, Fill, Order, OrderRequest
from trading_agent.trading.kill_switch import Halt
from trading_agent.trading.ledger import BalanceChange, LedgerChanges, PaperOrder
from trading_agent.trading.risk_journal import DayState

AT = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)


def _order(order_id: str, client_order_id: str, status: str = "open") -> Order:
    return Order(id=order_id, client_order_id=client_order_id, symbol="BTC/USDT", side="buy",
                 type="limit", amount=Decimal("0.5"), price=Decimal("60000.10"),
                 status=status, filled=Decimal(0), average=None, fee=Decimal(0),  # type: ignore[arg-type]
                 fee_currency=None, created_at=AT)


async def test_paper_books_keep_orders_fills_and_balances_exactly(target: StoreTarget) -> None:
    books = await SqlitePaperBooks.open(target, "alpha")
    try:
        await books.create_account(LedgerChanges(AT, balances={
            "USDT": (Decimal("10000.000000001"), Decimal(0))}))
        resting = PaperOrder(_order("1", "cid-1"), Decimal("30000.05"), "USDT")
        fill = Fill("1", "BTC/USDT", "buy", Decimal("0.5"), Decimal("60000.10"),
                    Decimal("0.03"), "USDT", "maker", AT)
        assert await books.commit(LedgerChanges(
            AT, orders=[resting], balance_changes=[
                BalanceChange("USDT", Decimal("-30000.05"), Decimal("30000.05"), "reserve",
                              "1")],
            balances={"USDT": (Decimal("-19999.999999999"), Decimal("30000.05"))}),
            new_client_order_id="cid-1")
        # Another order under a client order id the account used: nothing is written.
        assert not await books.commit(LedgerChanges(
            AT, orders=[PaperOrder(_order("2", "cid-1"), Decimal(1), "USDT")],
            balances={"USDT": (Decimal(0), Decimal(0))}), new_client_order_id="cid-1")
        filled = PaperOrder(_order("1", "cid-1", "closed"), Decimal(0), "USDT")
        assert await books.commit(LedgerChanges(
            AT, orders=[filled], fills=[fill], positions={"BTC/USDT": (Decimal("0.5"), None)}))

        snapshot = await books.load()
        assert snapshot.exists and snapshot.order_count == 1 and snapshot.open_orders == []
        assert snapshot.balances == {"USDT": (Decimal("-19999.999999999"),
                                              Decimal("30000.05"))}
        assert snapshot.positions == {"BTC/USDT": (Decimal("0.5"), None)}
        found = await books.find_order(client_order_id="cid-1")
        assert found is not None and found.order.status == "closed"
        assert await books.fills("1") == [fill]
        assert await books.fills("2") == []
    finally:
        await books.close()


async def test_the_order_journal_keeps_intents_statuses_and_balances(
        target: StoreTarget) -> None:
    journal = await SqliteOrderJournal.open(target)
    try:
        request = OrderRequest("BTC/USDT", "buy", "limit", Decimal("0.5"), Decimal(60000),
                               "cid-1")
        await journal.record(request, "binance", AT)
        await journal.mark("cid-1", "placed", AT, exchange_order_id="x1")
        assert [intent.request for intent in await journal.believed_open("binance")] == [
            request]
        await journal.note_status(_order("x1", "cid-1", "closed"), AT)
        await journal.note_status(_order("x9", "someone-elses"), AT)  # not ours: ignored
        assert await journal.last_status("cid-1") == "closed"
        assert await journal.last_status("someone-elses") is None
        assert await journal.believed_open("binance") == []

        assert await journal.adopt(_order("x2", "cid-2"), "binance", AT)
        assert not await journal.adopt(_order("x2", "cid-2"), "binance", AT)
        adopted = await journal.get_by_exchange_order_id("binance", "x2")
        assert adopted is not None and adopted.state == "placed"
        assert await journal.last_status("cid-2") == "open"

        await journal.record_balances("binance", {"BTC": Balance("BTC", Decimal("0.5"))}, AT)
        later = AT + timedelta(minutes=1)
        await journal.record_balances("binance", {"BTC": Balance("BTC", Decimal(1))}, later)
        seen = await journal.last_balances("binance")
        assert seen is not None and seen.balances["BTC"].free == Decimal(1)
    finally:
        await journal.close()


async def test_risk_records_keep_orders_and_each_days_halt(target: StoreTarget) -> None:
    records = await SqliteRiskRecords.open(target)
    try:
        await records.add_order("alpha", "cid-1", AT)
        await records.add_order("alpha", "cid-2", AT + timedelta(minutes=5))
        day = date(2025, 6, 1)
        await records.put_day("alpha", DayState(day, Decimal("1000.5")))
        await records.put_day("alpha", DayState(day, Decimal(999), "daily loss limit"))
        orders, days = await records.load("alpha", AT, day)
        assert orders == [AT + timedelta(minutes=5)]
        # The start equity stays the first one seen; the halt is the latest word.
        assert days == {day: DayState(day, Decimal("1000.5"), "daily loss limit")}
        # A day started again on another basis (the desk's books after an upgrade) takes
        # the new start; its halt stands.
        await records.put_day("alpha", DayState(day, Decimal(-2), "daily loss limit",
                                                "books"))
        _, days = await records.load("alpha", AT, day)
        assert days == {day: DayState(day, Decimal(-2), "daily loss limit", "books")}
    finally:
        await records.close()


async def test_halts_are_put_replaced_and_deleted(target: StoreTarget) -> None:
    halts = await SqliteHalts.open(target)
    try:
        await halts.put(Halt("alpha", "ann", AT, "too fast"))
        await halts.put(Halt("alpha", "risk", AT, "daily loss"))
        await halts.put(Halt("*", "bob", AT, "all off"))
        assert await halts.load() == {"alpha": Halt("alpha", "risk", AT, "daily loss"),
                                      "*": Halt("*", "bob", AT, "all off")}
        await halts.delete("alpha")
        assert list(await halts.load()) == ["*"]
    finally:
        await halts.close()


async def test_notes_are_versioned_and_searched_without_regard_to_case(
        target: StoreTarget) -> None:
    minute = iter(range(60))

    def clock() -> datetime:
        return AT + timedelta(minutes=next(minute))

    memory = await SqliteMemory.open(target, "alpha", clock)
    other = await SqliteMemory.open(target, "beta", clock)
    try:
        assert await memory.remember("plan", "Buy BTC under 60k") is None
        previous = await memory.remember("plan", "Hold BTC; 100% of the budget is in")
        assert previous is not None and previous.text == "Buy BTC under 60k"
        await memory.remember("Risk_Notes", "no leverage")
        await other.remember("plan", "beta's own plan")
        recalled = await memory.recall("plan")
        assert recalled is not None and recalled.text.startswith("Hold")
        assert [note.key for note in await memory.search("btc")] == ["plan"]
        assert [note.key for note in await memory.search("100%")] == ["plan"]
        assert [note.key for note in await memory.search("o_l")] == []  # _ is no wildcard
        assert [note.key for note in await memory.search("RISK_")] == ["Risk_Notes"]
        assert [note.key for note in await memory.recent()] == ["Risk_Notes", "plan"]
        assert await memory.keys() == ["Risk_Notes", "plan"]
    finally:
        await memory.close()
        await other.close()


async def test_pins_are_kept_numbered_and_removed_per_desk(target: StoreTarget) -> None:
    pins = await SqlitePins.open(target)
    try:
        first = await pins.add("alpha", "Never hold more than 0.1 BTC.", "ann", AT)
        second = await pins.add("beta", "Close by Friday.", "bob", AT + timedelta(hours=1))
        third = await pins.add("alpha", "Quote every price with its time.", "bob", AT)
        assert first.id < second.id < third.id
        assert await pins.load() == [first, second, third]
        assert not await pins.remove("beta", first.id)  # not beta's
        assert await pins.remove("alpha", first.id)
    finally:
        await pins.close()
    reopened = await SqlitePins.open(target)
    try:
        assert await reopened.load() == [second, third]
        assert (await reopened.add("alpha", "x", "ann", AT)).id > third.id  # never reused
    finally:
        await reopened.close()
