"""A desk's view of its exchange: its own positions and orders, its books kept on the way.

Paper desks on the packaged replay (BTC/USDT at 16,612.0 at the start, market orders 10 bps
away), opened through the factory as the daemon opens them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from trading_agent.store.trading_state import TradingStateFile
from trading_agent.trading.books import BookFill, BookOrder
from trading_agent.trading.config import ExchangeConfig, PaperExchangeConfig, RiskLimits
from trading_agent.trading.exchange import OrderRequest
from trading_agent.trading.factory import TradingVenue, open_exchange
from trading_agent.trading.replay import ReplayFeed

from .conftest import replay_feed

D = Decimal
LIMITS = RiskLimits(allowed_symbols=["BTC/USDT"], max_order_notional=D("100000"),
                    max_position_notional=D("100000"))


@pytest.fixture
def replay() -> ReplayFeed:
    return replay_feed()


async def _venue(database: Path, feed: ReplayFeed, desk: str = "alpha",
                 **balances: str) -> AsyncIterator[TradingVenue]:
    config = ExchangeConfig(paper=PaperExchangeConfig(
        starting_balances={currency: D(v) for currency, v in
                           (balances or {"USDT": "10000"}).items()}))
    async with open_exchange(config, state=TradingStateFile(database), account=desk,
                             risk_limits=LIMITS, feed=feed) as venue:
        yield venue


@pytest.fixture
async def venue(tmp_path: Path, replay: ReplayFeed) -> AsyncIterator[TradingVenue]:
    async for opened in _venue(tmp_path / "state.sqlite3", replay):
        yield opened


async def test_a_market_fill_is_counted_once_and_announced_at_once(venue: TradingVenue) -> None:
    announced: list[BookFill] = []
    venue.exchange.on_fill = announced.append
    assert venue.risk is not None
    order = await venue.risk.place_order(OrderRequest("BTC/USDT", "buy", "market", D("0.1"),
                                                      turn="t1"))
    assert [f.fill_id for f in announced] == [f"{order.id}@0.1"]
    assert announced[0].turn == "t1" and announced[0].price == order.average
    await venue.exchange.fetch_order(order.id, "BTC/USDT")  # seen again: nothing new
    (position,) = await venue.exchange.fetch_positions()
    assert (position.side, position.amount, position.entry_price) == ("long", D("0.1"),
                                                                      order.average)
    assert len(await venue.books.fills()) == 1 and len(announced) == 1


async def test_a_resting_order_that_fills_on_a_candle_is_counted_on_the_refresh(
        venue: TradingVenue, replay: ReplayFeed) -> None:
    assert venue.risk is not None
    resting = await venue.risk.place_order(OrderRequest("BTC/USDT", "buy", "limit", D("0.1"),
                                                        D("16605"), turn="t1"))
    assert [o.client_order_id for o in await venue.exchange.fetch_open_orders()] == [
        resting.client_order_id]
    assert await venue.books.fills() == []
    replay.advance(1)
    fills = await venue.match_resting_orders()
    assert [(f.order_id, f.amount, f.price) for f in fills] == [(resting.id, D("0.1"),
                                                                 D("16605"))]
    assert await venue.exchange.fetch_open_orders() == []
    assert await venue.match_resting_orders() == []  # counted once


async def test_an_order_whose_answer_was_lost_is_looked_up_and_one_never_placed_settled(
        venue: TradingVenue, replay: ReplayFeed) -> None:
    exchange = venue.exchange
    now = exchange.now()
    # The daemon died after noting these and before their answers: one reached the paper
    # books, the other never left.
    placed = OrderRequest("BTC/USDT", "buy", "market", D("0.05"), turn="t1")
    never = OrderRequest("BTC/USDT", "buy", "market", D("0.05"), turn="t1")
    for request in (placed, never):
        await exchange.records.note_order(BookOrder(
            request.client_order_id, request.symbol, request.side, request.type,
            request.amount, None, request.turn, now))
    await exchange.inner.create_order(placed)
    assert await venue.match_resting_orders() == []  # too young to look up
    replay.advance(1)  # five minutes later
    (fill,) = await venue.match_resting_orders()
    assert fill.client_order_id == placed.client_order_id and fill.amount == D("0.05")
    statuses = {o.client_order_id: o.status for o in await venue.books.orders(open_only=False)}
    assert statuses == {placed.client_order_id: "closed", never.client_order_id: "lost"}
    assert replay.now() - now >= timedelta(minutes=1)


async def test_a_paper_accounts_starting_coins_are_the_desks(tmp_path: Path,
                                                             replay: ReplayFeed) -> None:
    async for venue in _venue(tmp_path / "state.sqlite3", replay, USDT="1000", BTC="0.2"):
        (position,) = await venue.exchange.fetch_positions()
        assert position.amount == D("0.2")
        (trade,) = await venue.books.trades()
        assert trade.opened_turn == "start" and trade.is_open
        assert venue.risk is not None
        await venue.risk.place_order(OrderRequest("BTC/USDT", "sell", "market", D("0.2")))
        assert await venue.exchange.fetch_positions() == []
    # Reopened: adopted once, not again.
    async for venue in _venue(tmp_path / "state.sqlite3", replay, USDT="1000", BTC="0.2"):
        assert await venue.exchange.fetch_positions() == []
        assert len(await venue.books.trades()) == 1


async def test_two_desks_in_one_store_keep_their_own_books(tmp_path: Path,
                                                           replay: ReplayFeed) -> None:
    database = tmp_path / "state.sqlite3"
    async for alpha in _venue(database, replay, "alpha"):
        async for beta in _venue(database, replay, "beta"):
            assert alpha.risk is not None and beta.risk is not None
            await alpha.risk.place_order(OrderRequest("BTC/USDT", "buy", "market", D("0.1")))
            await beta.risk.place_order(OrderRequest("BTC/USDT", "buy", "market", D("0.3")))
            assert [p.amount for p in await alpha.exchange.fetch_positions()] == [D("0.1")]
            assert [p.amount for p in await beta.exchange.fetch_positions()] == [D("0.3")]
            assert len(await alpha.books.fills()) == len(await beta.books.fills()) == 1


async def test_a_paper_desks_equity_is_its_account_and_moves_by_its_books_profit(
        venue: TradingVenue, replay: ReplayFeed) -> None:
    start = await venue.equity("USDT")
    assert (start.basis, start.total) == ("account", D("10000"))
    assert venue.risk is not None
    await venue.risk.place_order(OrderRequest("BTC/USDT", "buy", "market", D("0.1"),
                                              turn="t1"))
    for _ in range(3):  # the market moves on
        replay.advance(1)
        account = await venue.equity("USDT")
        books = await venue.books.equity("USDT")
        assert books.basis == "books" and books.unpriced == ()
        # The paper account is the desk's alone: what it gained or lost is its books'
        # profit (the fee and the move of what it holds), to the last digit.
        assert account.total - start.total == books.total != 0
