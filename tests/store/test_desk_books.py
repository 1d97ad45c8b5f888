"""A desk's own books in the store, on both engines: what is noted and observed reads back,
each part of an order's fill is counted once, other desks' orders are not the desk's, and
the books are as committed after a reopen."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal

import anyio
import pytest

from tests.store.test_fencing import LostDeskB
from trading_agent.store import FencedError, StoreTarget
from trading_agent.store.desk_books import SqliteDeskBooks
from trading_agent.store.trading_state import TradingStateFile
from trading_agent.trading.books import BookFill, BookOrder, BookPosition, DayProfit
from trading_agent.trading.exchange import Order, OrderSide, OrderStatus

AT = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
D = Decimal


def _noted(client_order_id: str, side: OrderSide = "buy", amount: str = "1",
           turn: str | None = "t1", at: datetime = AT) -> BookOrder:
    return BookOrder(client_order_id, "BTC/USDT", side, "limit", D(amount), D(110), turn, at)


def _report(client_order_id: str, filled: str, average: str | None, fee: str = "0",
            status: OrderStatus = "open", side: OrderSide = "buy",
            amount: str = "1") -> Order:
    return Order(id=f"X-{client_order_id}", client_order_id=client_order_id,
                 symbol="BTC/USDT", side=side, type="limit", amount=D(amount),
                 price=D(110), status=status, filled=D(filled),
                 average=None if average is None else D(average), fee=D(fee),
                 fee_currency="USDT", created_at=AT)


@pytest.fixture
async def books(target: StoreTarget) -> AsyncIterator[SqliteDeskBooks]:
    opened = await TradingStateFile(target).desk_books("alpha")
    try:
        yield opened
    finally:
        await opened.close()


async def test_noted_orders_and_their_fills_read_back(books: SqliteDeskBooks) -> None:
    await books.note_order(_noted("cid-1"))
    await books.note_order(_noted("cid-1", amount="5"))  # the same id again: nothing
    (noted,) = await books.orders()
    assert noted == _noted("cid-1") and noted.status == "new" and noted.is_open

    first = await books.observe(_report("cid-1", "0.4", "100", "0.04"), AT)
    assert first == [BookFill("X-cid-1@0.4", "X-cid-1", "cid-1", "BTC/USDT", "buy",
                              D("0.4"), D(100), D("0.04"), "USDT", AT, "t1")]
    (order,) = await books.orders(open_only=True)
    assert (order.order_id, order.status, order.filled, order.cost, order.fee) == (
        "X-cid-1", "open", D("0.4"), D(40), D("0.04"))

    later = AT + timedelta(minutes=1)
    (rest,) = await books.observe(_report("cid-1", "1", "101.2", "0.1012", "closed"), later)
    assert (rest.fill_id, rest.amount, rest.price, rest.fee, rest.at) == (
        "X-cid-1@1", D("0.6"), D(102), D("0.0612"), later)
    assert await books.orders(open_only=True) == []
    (order,) = await books.orders()
    assert (order.status, order.filled, order.cost, order.fee) == (
        "closed", D(1), D("101.2"), D("0.1012"))
    assert await books.fills() == [*first, rest]
    assert await books.fills(later) == [rest]
    assert await books.positions() == {"BTC/USDT": BookPosition(
        "BTC/USDT", D(1), D("101.2"), D("-0.1012"), D("0.1012"), {}, AT, 1)}
    (trade,) = await books.trades()
    assert (trade.id, trade.side, trade.amount, trade.entry_price, trade.opened_at,
            trade.profit, trade.is_open) == (1, "long", D(1), D("101.2"), AT,
                                             D("-0.1012"), True)


async def test_the_same_order_state_observed_twice_is_counted_once(
        books: SqliteDeskBooks) -> None:
    await books.note_order(_noted("cid-1"))
    report = _report("cid-1", "0.5", "100", "0.05")
    assert len(await books.observe(report, AT)) == 1
    assert await books.observe(report, AT + timedelta(seconds=1)) == []
    # An older report (nothing filled yet) neither counts nor takes back what was counted.
    assert await books.observe(_report("cid-1", "0", None), AT) == []
    assert [f.amount for f in await books.fills()] == [D("0.5")]
    assert (await books.positions())["BTC/USDT"].amount == D("0.5")
    (order,) = await books.orders()
    assert order.filled == D("0.5")


async def test_a_closed_order_is_not_reopened_by_an_older_report(
        books: SqliteDeskBooks) -> None:
    await books.note_order(_noted("cid-1"))
    await books.observe(_report("cid-1", "1", "100", status="closed"), AT)
    await books.observe(_report("cid-1", "0.5", "100", status="open"), AT)
    (order,) = await books.orders()
    assert order.status == "closed" and order.filled == 1


async def test_orders_the_desk_never_noted_are_ignored(target: StoreTarget) -> None:
    alpha = await SqliteDeskBooks.open(target, "alpha")
    beta = await SqliteDeskBooks.open(target, "beta")
    try:
        await beta.note_order(_noted("cid-beta"))
        assert await alpha.observe(_report("cid-beta", "1", "100", status="closed"), AT) == []
        assert await alpha.observe(_report("someone-elses", "1", "100"), AT) == []
        assert await alpha.orders() == [] and await alpha.fills() == []
        assert await alpha.positions() == {} and await alpha.trades() == []
        assert await alpha.daily() == []
        (beta_order,) = await beta.orders()
        assert beta_order.status == "new" and beta_order.order_id is None
        assert await beta.fills() == []
    finally:
        await alpha.close()
        await beta.close()


async def test_two_desks_in_one_store_keep_their_own_books(target: StoreTarget) -> None:
    alpha = await SqliteDeskBooks.open(target, "alpha")
    beta = await SqliteDeskBooks.open(target, "beta")
    try:
        await alpha.note_order(_noted("cid-a"))
        await beta.note_order(_noted("cid-b", side="sell", amount="2"))
        await alpha.observe(_report("cid-a", "1", "100", status="closed"), AT)
        await beta.observe(_report("cid-b", "2", "105", status="closed", side="sell",
                                   amount="2"), AT)
        assert (await alpha.positions())["BTC/USDT"].amount == 1
        assert (await beta.positions())["BTC/USDT"].amount == -2
        assert [o.client_order_id for o in await alpha.orders()] == ["cid-a"]
        assert [f.client_order_id for f in await beta.fills()] == ["cid-b"]
        (a_trade,), (b_trade,) = await alpha.trades(), await beta.trades()
        assert (a_trade.side, b_trade.side) == ("long", "short")
    finally:
        await alpha.close()
        await beta.close()


async def test_a_reversal_closes_one_round_trip_and_opens_the_next(
        books: SqliteDeskBooks) -> None:
    await books.note_order(_noted("cid-1"))
    await books.observe(_report("cid-1", "1", "100", status="closed"), AT)
    await books.note_order(_noted("cid-2", side="sell", amount="3", turn="t2"))
    later = AT + timedelta(hours=1)
    await books.observe(_report("cid-2", "3", "110", "0.33", "closed", "sell", "3"), later)
    closed, opened = await books.trades()
    assert (closed.id, closed.exit_reason, closed.closed_at, closed.profit) == (
        1, "reversed", later, D("9.89"))
    assert (opened.id, opened.side, opened.amount, opened.profit, opened.is_open) == (
        2, "short", D(3) - D(1), D("-0.22"), True)
    position = (await books.positions())["BTC/USDT"]
    assert (position.amount, position.entry_price, position.realized, position.trade_id,
            position.opened_at) == (D(-2), D(110), D("9.67"), 2, later)
    (day,) = await books.daily()
    assert day == DayProfit(date(2025, 6, 1), D("9.67"), D("0.33"), 2, 1)


async def test_books_are_as_committed_after_a_reopen(target: StoreTarget) -> None:
    books = await SqliteDeskBooks.open(target, "alpha")
    try:
        await books.note_order(_noted("cid-1"))
        await books.observe(_report("cid-1", "0.5", "100", "0.05"), AT)
        await books.note_order(_noted("cid-2", side="sell", amount="0.2"))
        await books.observe(_report("cid-2", "0.2", "120", status="closed", side="sell",
                                    amount="0.2"), AT)
        before = (await books.orders(), await books.positions(), await books.fills(),
                  await books.trades(), await books.daily())
    finally:
        await books.close()
    again = await SqliteDeskBooks.open(target, "alpha")
    try:
        after = (await again.orders(), await again.positions(), await again.fills(),
                 await again.trades(), await again.daily())
        assert after == before
        position = after[1]["BTC/USDT"]
        assert position.amount == D("0.3") and position.realized == D(4) - D("0.05")
        # The rest of the first order still counts once, after the reopen.
        (fill,) = await again.observe(_report("cid-1", "1", "100", "0.1", "closed"), AT)
        assert fill.amount == D("0.5")
        assert (await again.positions())["BTC/USDT"].amount == D("0.8")
    finally:
        await again.close()


async def test_profit_is_grouped_by_utc_day_across_midnight(books: SqliteDeskBooks) -> None:
    evening = datetime(2025, 6, 1, 23, 30, tzinfo=UTC)
    morning = datetime(2025, 6, 2, 0, 30, tzinfo=UTC)
    # 01:00 on June 2 in UTC+2 is 23:00 UTC on June 1: the day is the UTC one.
    night = datetime(2025, 6, 2, 1, 0, tzinfo=timezone(timedelta(hours=2)))
    await books.note_order(_noted("cid-1", at=evening))
    await books.observe(_report("cid-1", "1", "100", "0.1", "closed"), evening)
    await books.note_order(_noted("cid-2", side="sell", at=morning))
    await books.observe(_report("cid-2", "1", "110", "0.11", "closed", "sell"), morning)
    await books.note_order(_noted("cid-3", at=night))
    await books.observe(_report("cid-3", "1", "90", "0.09", "closed"), night)
    june_1 = DayProfit(date(2025, 6, 1), D("-0.1") - D("0.09"), D("0.19"), 2, 0)
    june_2 = DayProfit(date(2025, 6, 2), D(10) - D("0.11"), D("0.11"), 1, 1)
    assert await books.daily() == [june_1, june_2]
    assert await books.daily(date(2025, 6, 2)) == [june_2]
    assert [f.at for f in await books.fills()] == [evening, morning, night]
    assert [f.at for f in await books.fills(morning)] == [morning]
    (opened,) = await books.trades(open_only=True)
    assert opened.opened_at == night and opened.opened_at.tzinfo == UTC


async def test_trades_since_keep_the_open_ones(books: SqliteDeskBooks) -> None:
    day1, day2 = datetime(2025, 6, 1, 10, tzinfo=UTC), datetime(2025, 6, 2, 10, tzinfo=UTC)
    await books.note_order(_noted("cid-1", at=day1))
    await books.observe(_report("cid-1", "1", "100", status="closed"), day1)
    await books.note_order(_noted("cid-2", side="sell", at=day1))
    await books.observe(_report("cid-2", "1", "105", status="closed", side="sell"), day1)
    await books.note_order(_noted("cid-3", at=day1))
    await books.observe(_report("cid-3", "1", "104", status="closed"), day1)
    first, second = await books.trades()
    assert not first.is_open and first.profit == D(5) and second.is_open
    assert await books.trades(open_only=True) == [second]
    assert await books.trades(day2) == [second]
    assert await books.trades(day1) == [first, second]
    assert await books.trades(day2, open_only=True) == [second]


async def test_a_desk_this_daemon_lost_writes_nothing(target: StoreTarget) -> None:
    books = await TradingStateFile(target, LostDeskB()).desk_books("b")
    try:
        with pytest.raises(FencedError, match="desk b"):
            await books.note_order(_noted("cid-1"))
        assert await books.orders() == []
    finally:
        await books.close()


def _observe_all(target: StoreTarget, reports: list[Order]) -> int:
    """Observes ``reports`` through connections of its own (an event loop of its own, as
    another process would): returns how many fills it counted."""

    async def run() -> int:
        books = await SqliteDeskBooks.open(target, "alpha")
        try:
            return sum([len(await books.observe(report, AT)) for report in reports])
        finally:
            await books.close()

    return anyio.run(run)


async def test_observations_racing_on_two_connections_count_each_part_once(
        target: StoreTarget) -> None:
    steps = 20
    reports = [_report("cid-1", str(D("0.05") * step), "100", str(D("0.001") * step),
                       amount="1") for step in range(1, steps + 1)]
    books = await SqliteDeskBooks.open(target, "alpha")
    try:
        await books.note_order(_noted("cid-1"))
        counts: list[int] = []

        async def observer(order: list[Order]) -> None:
            counts.append(await anyio.to_thread.run_sync(_observe_all, target, order))

        async with anyio.create_task_group() as group:
            group.start_soon(observer, reports)
            group.start_soon(observer, [r for pair in zip(reports, reports, strict=True)
                                        for r in pair])
            group.start_soon(observer, reports[1::2])
        fills = await books.fills()
        assert sum(counts) == len(fills) and len({f.fill_id for f in fills}) == len(fills)
        assert sum((f.amount for f in fills), D(0)) == D(1)
        assert sum((f.fee for f in fills), D(0)) == D("0.02")
        position = (await books.positions())["BTC/USDT"]
        assert position.amount == D(1) and position.entry_price == D(100)
        assert position.fees == D("0.02")
        (order,) = await books.orders()
        assert (order.filled, order.cost, order.fee) == (D(1), D(100), D("0.02"))
    finally:
        await books.close()
