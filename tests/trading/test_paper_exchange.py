"""The paper exchange on the replayed BTC/USDT candles: fills, fees, balances, restarts.

The replay starts with 300 candles in the past: the last close is 16,612.0 (17:40 candle of
2023-01-03), and the next candles are (open time, low, high):
17:45 16,600.3 / 16,616.9 · 17:50 16,616.0 / 16,622.0 · ... · 18:25 16,624.3 / 16,645.8.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from trading_agent.errors import OrderRejectedError
from trading_agent.store.paper_books import SqlitePaperBooks
from trading_agent.trading.config import PaperExchangeConfig
from trading_agent.trading.exchange import Candle, OrderRequest
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.replay import ReplayFeed

from .conftest import packaged_candles, replay_feed

D = Decimal
CONFIG = PaperExchangeConfig(starting_balances={"USDT": D("10000")}, taker_fee=D("0.001"),
                             maker_fee=D("0.0008"), slippage_bps=D("10"))


@pytest.fixture
async def paper(feed: ReplayFeed, database: Path) -> AsyncIterator[PaperExchange]:
    exchange = await PaperExchange.open(CONFIG, feed, await SqlitePaperBooks.open(database,
                                                                                  "alpha"))
    yield exchange
    await exchange.close()


def buy(amount: str, price: str | None = None, **kwargs: str) -> OrderRequest:
    kind = "market" if price is None else "limit"
    return OrderRequest("BTC/USDT", "buy", kind, D(amount), None if price is None else D(price),
                        **kwargs)


def sell(amount: str, price: str | None = None) -> OrderRequest:
    kind = "market" if price is None else "limit"
    return OrderRequest("BTC/USDT", "sell", kind, D(amount), None if price is None else D(price))


async def balances(paper: PaperExchange) -> dict[str, tuple[Decimal, Decimal]]:
    return {c: (b.free, b.used) for c, b in (await paper.fetch_balances()).items()}


def test_the_scenario_matches_the_packaged_data() -> None:
    candles = packaged_candles()
    assert candles[299].close == D("16612.0")
    assert (candles[300].low, candles[308].high) == (D("16600.3"), D("16645.8"))


async def test_a_market_buy_fills_at_the_slipped_price_and_pays_the_taker_fee(
        paper: PaperExchange) -> None:
    order = await paper.create_order(buy("0.1"))

    # 16,612.0 × (1 + 10 bps) = 16,628.612; 0.1 BTC cost 1,662.8612; fee 0.1% = 1.6628612.
    assert order.status == "closed"
    assert order.average == D("16628.612")
    assert order.fee == D("1.6628612") and order.fee_currency == "USDT"
    assert await balances(paper) == {"BTC": (D("0.1"), D(0)),
                                     "USDT": (D("8335.4759388"), D(0))}
    fills = await paper.fills()
    assert [(f.liquidity, f.price, f.at.isoformat()) for f in fills] == [
        ("taker", D("16628.612"), "2023-01-03T17:45:00+00:00")]


async def test_a_round_trip_loses_exactly_the_fees_and_the_slippage(
        paper: PaperExchange) -> None:
    await paper.create_order(buy("0.1"))
    await paper.create_order(sell("0.1"))

    # Sold at 16,612.0 × (1 − 10 bps) = 16,595.388: proceeds 1,659.5388 minus 1.6595388 fee.
    usdt = (await paper.fetch_balances())["USDT"]
    assert usdt.free == D("10000") - D("1662.8612") - D("1.6628612") + D("1659.5388") \
        - D("1.6595388")
    assert usdt.free == D("9993.3552")
    assert "BTC" not in await paper.fetch_balances()
    assert await paper.fetch_positions() == []


async def test_a_resting_limit_buy_holds_funds_then_fills_as_maker_when_crossed(
        paper: PaperExchange, feed: ReplayFeed) -> None:
    order = await paper.create_order(buy("0.1", "16601.0"))

    # Held back: 0.1 × 16,601.0 × (1 + 0.08%) = 1,661.42808.
    assert order.status == "open"
    assert await balances(paper) == {"USDT": (D("8338.57192"), D("1661.42808"))}
    assert await paper.sync() == []  # the 17:40 candle was already there: no look-ahead

    feed.advance()  # the 17:45 candle trades down to 16,600.3
    fills = await paper.sync()

    assert [(f.price, f.fee, f.liquidity, f.at.isoformat()) for f in fills] == [
        (D("16601.0"), D("1.32808"), "maker", "2023-01-03T17:50:00+00:00")]
    filled = await paper.fetch_order(order.id, "BTC/USDT")
    assert (filled.status, filled.filled, filled.average) == ("closed", D("0.1"), D("16601.0"))
    assert await balances(paper) == {"BTC": (D("0.1"), D(0)), "USDT": (D("8338.57192"), D(0))}
    [position] = await paper.fetch_positions()
    assert (position.amount, position.entry_price) == (D("0.1"), D("16601.0"))


async def test_touching_the_limit_price_is_not_enough(paper: PaperExchange,
                                                      feed: ReplayFeed) -> None:
    order = await paper.create_order(buy("0.1", "16600.3"))  # exactly the next candle's low

    feed.advance(20)

    assert [o.id for o in await paper.fetch_open_orders()] == [order.id]


async def test_a_limit_sell_fills_when_the_high_trades_through(paper: PaperExchange,
                                                               feed: ReplayFeed) -> None:
    await paper.create_order(buy("0.2"))
    order = await paper.create_order(sell("0.2", "16645.0"))
    assert (await paper.fetch_balances())["BTC"].used == D("0.2")

    feed.advance(8)  # through the 18:20 candle: highs stay below 16,645.0
    assert len(await paper.fetch_open_orders()) == 1
    feed.advance()  # 18:25 reaches 16,645.8

    filled = await paper.fetch_order(order.id, "BTC/USDT")
    assert filled.status == "closed"
    # Proceeds 0.2 × 16,645.0 = 3,329.0, maker fee 2.6632.
    assert filled.fee == D("2.6632")
    usdt = (await paper.fetch_balances())["USDT"]
    assert usdt.free == D("10000") - D("0.2") * D("16628.612") * D("1.001") + D("3329.0") \
        - D("2.6632")


async def test_a_marketable_limit_order_fills_at_once_as_a_taker(paper: PaperExchange) -> None:
    order = await paper.create_order(buy("0.1", "16700"))

    assert order.status == "closed"
    assert order.average == D("16628.612")  # the slipped price, better than the limit
    assert order.fee == D("1.6628612")


async def test_insufficient_funds_is_a_readable_rejection_that_changes_nothing(
        paper: PaperExchange) -> None:
    with pytest.raises(OrderRejectedError, match=r"Insufficient USDT: this buy costs "
                       r"16,628.61 USDT plus a fee of 16.63 USDT, but only 10,000.00 USDT"):
        await paper.create_order(buy("1"))
    with pytest.raises(OrderRejectedError, match="Insufficient BTC"):
        await paper.create_order(sell("0.1", "17000"))

    assert await balances(paper) == {"USDT": (D("10000"), D(0))}
    assert await paper.fetch_open_orders() == []


async def test_unknown_symbols_and_bad_amounts_are_rejected(paper: PaperExchange) -> None:
    with pytest.raises(OrderRejectedError, match="no market ETH/USDT"):
        await paper.create_order(OrderRequest("ETH/USDT", "buy", "market", D("1")))
    with pytest.raises(OrderRejectedError, match="amount must be positive"):
        await paper.create_order(buy("0"))


async def test_cancel_releases_exactly_what_was_held(paper: PaperExchange) -> None:
    order = await paper.create_order(buy("0.05", "16000"))

    canceled = await paper.cancel_order(order.id, "BTC/USDT")

    assert canceled.status == "canceled"
    assert await balances(paper) == {"USDT": (D("10000.0000"), D("0.0000"))}
    with pytest.raises(OrderRejectedError, match=f"order {order.id} is canceled, not open"):
        await paper.cancel_order(order.id, "BTC/USDT")


async def test_the_same_client_order_id_is_never_filled_twice(paper: PaperExchange) -> None:
    first = await paper.create_order(buy("0.1", client_order_id="desk-alpha-1"))
    again = await paper.create_order(buy("0.1", client_order_id="desk-alpha-1"))

    assert again.id == first.id
    assert len(await paper.fills()) == 1
    assert (await paper.fetch_balances())["BTC"].free == D("0.1")


async def test_a_restart_resumes_open_orders_and_balances_exactly(
        feed: ReplayFeed, database: Path) -> None:
    first = await PaperExchange.open(CONFIG, feed, await SqlitePaperBooks.open(database, "alpha"))
    await first.create_order(buy("0.1"))
    resting_buy = await first.create_order(buy("0.1", "16601.0"))
    resting_sell = await first.create_order(sell("0.05", "16700"))
    before = await balances(first)
    await first.close()

    second = await PaperExchange.open(CONFIG, feed, await SqlitePaperBooks.open(database, "alpha"))
    try:
        assert await balances(second) == before
        assert [o.id for o in await second.fetch_open_orders()] == [resting_buy.id,
                                                                    resting_sell.id]
        feed.advance()  # the buy fills after the restart
        open_after = await second.fetch_open_orders()
        new_order = await second.create_order(buy("0.01", "15000"))
    finally:
        await second.close()

    assert [o.id for o in open_after] == [resting_sell.id]
    assert new_order.id == "P4"  # numbering continues
    assert before == {"BTC": (D("0.05"), D("0.05")),
                      "USDT": (D("6674.0478588"), D("1661.42808"))}


async def test_starting_balances_apply_only_to_a_new_account(feed: ReplayFeed,
                                                             database: Path) -> None:
    first = await PaperExchange.open(CONFIG, feed, await SqlitePaperBooks.open(database, "alpha"))
    await first.create_order(buy("0.1"))
    await first.close()
    richer = CONFIG.model_copy(update={"starting_balances": {"USDT": D("99999")}})

    reopened = await PaperExchange.open(richer, feed, await SqlitePaperBooks.open(database,
                                                                                  "alpha"))
    other = await PaperExchange.open(richer, feed, await SqlitePaperBooks.open(database, "beta"))
    try:
        alpha, beta = await balances(reopened), await balances(other)
    finally:
        await reopened.close()
        await other.close()

    assert alpha["USDT"] == (D("8335.4759388"), D(0))
    assert beta == {"USDT": (D("99999"), D(0))}


async def test_the_ledger_keeps_an_audit_trail_that_adds_up(paper: PaperExchange,
                                                            feed: ReplayFeed,
                                                            database: Path) -> None:
    await paper.create_order(buy("0.1"))
    order = await paper.create_order(buy("0.1", "16601.0"))
    await paper.create_order(sell("0.05", "16700"))
    feed.advance()
    await paper.sync()
    await paper.cancel_order((await paper.fetch_open_orders())[0].id, "BTC/USDT")
    final = await balances(paper)

    with sqlite3.connect(database) as connection:
        rows = connection.execute("SELECT currency, free_delta, used_delta FROM "
                                  "paper_balance_changes WHERE account = 'alpha'").fetchall()
        statuses = dict(connection.execute("SELECT id, status FROM paper_orders").fetchall())
        mode = connection.execute("PRAGMA journal_mode").fetchone()[0]
    connection.close()
    summed: dict[str, list[Decimal]] = {}
    for currency, free, used in rows:
        total = summed.setdefault(currency, [D(0), D(0)])
        total[0] += D(free)
        total[1] += D(used)

    assert {c: (f, u) for c, (f, u) in summed.items() if f or u} == final
    assert statuses == {"P1": "closed", order.id: "closed", "P3": "canceled"}
    assert mode == "wal"


async def test_a_simulated_order_book_surrounds_the_fill_prices(paper: PaperExchange) -> None:
    book = await paper.fetch_order_book("BTC/USDT", 5)
    ticker = await paper.fetch_ticker("BTC/USDT")

    assert book.simulated
    assert book.asks[0][0] == ticker.ask == D("16628.612")
    assert book.bids[0][0] == ticker.bid == D("16595.388")
    assert len(book.bids) == len(book.asks) == 5
    assert all(a[0] < b[0] for a, b in zip(book.asks, book.asks[1:], strict=False))


NEXT_OPEN = CONFIG.model_copy(update={"market_fill": "next_open"})


async def test_with_next_open_a_market_order_waits_for_the_next_candles_open(
        feed: ReplayFeed, database: Path) -> None:
    paper = await PaperExchange.open(NEXT_OPEN, feed, await SqlitePaperBooks.open(database,
                                                                                  "backtest"))
    try:
        order = await paper.create_order(buy("0.1"))
        # Decided at the 17:40 candle's close (16,612.0): nothing is known of 17:45 yet.
        assert order.status == "open" and order.filled == 0
        held = await balances(paper)
        # Held back at the last price, slipped, with the taker fee: 0.1 × 16,628.612 × 1.001.
        assert held["USDT"] == (D("10000") - D("1664.5240612"), D("1664.5240612"))
        assert await paper.fills() == []

        feed.advance()  # the 17:45 candle: open 16,611.9
        filled = await paper.fetch_order(order.id, "BTC/USDT")
    finally:
        await paper.close()

    # 16,611.9 × (1 + 10 bps) = 16,628.5119; fee 0.1% of 1,662.85119.
    assert packaged_candles()[300].open == D("16611.9")
    assert (filled.status, filled.average, filled.fee) == ("closed", D("16628.5119"),
                                                          D("1.66285119"))
    reopened = await PaperExchange.open(NEXT_OPEN, feed, await SqlitePaperBooks.open(database,
                                                                                     "backtest"))
    try:
        fills = await reopened.fills()
        assert [(f.liquidity, f.at.isoformat()) for f in fills] == [
            ("taker", "2023-01-03T17:45:00+00:00")]
        assert await balances(reopened) == {
            "BTC": (D("0.1"), D(0)),
            "USDT": (D("10000") - D("1662.85119") - D("1.66285119"), D(0))}
    finally:
        await reopened.close()


async def test_with_next_open_a_buy_the_open_makes_unaffordable_is_rejected_and_freed(
        database: Path) -> None:
    # Real 5-minute candles open where the last closed; a gap (a halt, a weekend on another
    # market) is made up here: the close is 100, the next open 110.
    start = packaged_candles()[0].opened_at
    gap = (Candle("BTC/USDT", "5m", start, D(99), D(101), D(98), D(100), D(5)),
           Candle("BTC/USDT", "5m", start + timedelta(minutes=5), D(110), D(111), D(109),
                  D(110), D(5)))
    feed = replay_feed(start_offset=1, candles=gap)
    paper = await PaperExchange.open(NEXT_OPEN, feed, await SqlitePaperBooks.open(database,
                                                                                  "all-in"))
    try:
        order = await paper.create_order(buy("99"))  # 99 × 100.1 × 1.001 = 9,919.9101
        assert order.status == "open"
        feed.advance()
        after = await paper.fetch_order(order.id, "BTC/USDT")
        assert after.status == "rejected"
        assert await balances(paper) == {"USDT": (D("10000"), D(0))}
        assert await paper.fills() == []
    finally:
        await paper.close()


async def test_with_next_open_a_marketable_limit_order_takes_the_next_open_not_the_close(
        feed: ReplayFeed, database: Path) -> None:
    paper = await PaperExchange.open(NEXT_OPEN, feed, await SqlitePaperBooks.open(database,
                                                                                  "limits"))
    try:
        # Above the last close (16,612.0): marketable, yet it reaches the book at 17:45.
        taker = await paper.create_order(buy("0.1", "16700"))
        # Below every price of 17:45 (low 16,600.3): it rests, then fills at its own price
        # on the first later candle that trades through it.
        maker = await paper.create_order(buy("0.1", "16605"))
        assert (taker.status, maker.status) == ("open", "open")

        feed.advance()  # 17:45: open 16,611.9, low 16,600.3
        took = await paper.fetch_order(taker.id, "BTC/USDT")
        rested = await paper.fetch_order(maker.id, "BTC/USDT")
        fills = await paper.fills()
    finally:
        await paper.close()

    # The open slipped 10 bps, with the taker fee: not the close the desk decided at.
    assert (took.status, took.average, took.fee) == ("closed", D("16628.5119"),
                                                      D("1.66285119"))
    assert (rested.status, rested.average) == ("closed", D("16605"))
    assert [(f.liquidity, f.at.isoformat()) for f in fills] == [
        ("taker", "2023-01-03T17:45:00+00:00"), ("maker", "2023-01-03T17:50:00+00:00")]
