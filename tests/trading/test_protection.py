"""Stops and targets on a paper venue: the fill rule on candles, one-cancels-other, a
protection moved, a position partly closed first, and a restart that finds what fired.

The candles are made up (BTC/USDT around 100, five minutes apart) and the paper exchange
charges no fee and no slippage, so every figure can be checked by hand. The venue is opened
through the factory, as the daemon and a backtest open it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from trading_agent.errors import RiskLimitError
from trading_agent.store.trading_state import TradingStateFile
from trading_agent.trading.config import ExchangeConfig, PaperExchangeConfig, RiskLimits
from trading_agent.trading.exchange import Candle, OrderRequest
from trading_agent.trading.factory import TradingVenue, open_exchange
from trading_agent.trading.protection import (
    ProtectiveOrder,
    check_entry_protection,
    check_position_protection,
    exit_price_on,
    first_exit,
)
from trading_agent.trading.protection_keeper import ProtectionEvent
from trading_agent.trading.replay import ReplayFeed

D = Decimal
START = datetime(2024, 1, 1, tzinfo=UTC)
LIMITS = RiskLimits(allowed_symbols=["BTC/USDT"], max_order_notional=D("100000"),
                    max_position_notional=D("100000"))
FREE = PaperExchangeConfig(starting_balances={"USDT": D("1000")}, taker_fee=D(0),
                           maker_fee=D(0), slippage_bps=D(0))


def candle(index: int, open_: str, high: str, low: str, close: str) -> Candle:
    return Candle("BTC/USDT", "5m", START + timedelta(minutes=5 * index), D(open_), D(high),
                  D(low), D(close), D(10))


def series(*rows: tuple[str, str, str, str]) -> list[Candle]:
    """Candle 0 closes at 100 (where a market order fills); the rows follow it."""
    return [candle(0, "100", "100", "100", "100"),
            *(candle(i + 1, *row) for i, row in enumerate(rows))]


def protective(kind: str, side: str, trigger: str) -> ProtectiveOrder:
    return ProtectiveOrder(1, "BTC/USDT", kind, side, D(trigger), "c", START,  # type: ignore[arg-type]
                           status="active", held="simulated")


@pytest.mark.parametrize(("kind", "side", "trigger", "row", "price"), [
    ("stop_loss", "sell", "95", ("99", "100", "94", "96"), "95"),      # reached: its price
    ("stop_loss", "sell", "95", ("90", "91", "88", "89"), "90"),       # gapped through: open
    ("stop_loss", "sell", "95", ("99", "100", "95.1", "96"), None),    # not reached
    ("take_profit", "sell", "110", ("105", "111", "104", "109"), "110"),
    ("take_profit", "sell", "110", ("112", "113", "111", "112"), "112"),  # gapped up: open
    ("stop_loss", "buy", "105", ("101", "106", "100", "104"), "105"),  # a short's stop
    ("stop_loss", "buy", "105", ("108", "109", "107", "108"), "108"),  # gapped up: open
])
def test_the_rule_fills_at_the_price_or_at_the_open_it_gapped_to(
        kind: str, side: str, trigger: str, row: tuple[str, str, str, str],
        price: str | None) -> None:
    found = exit_price_on(protective(kind, side, trigger), candle(1, *row))
    assert found == (None if price is None else D(price))


def test_when_a_stop_and_a_target_fall_in_one_candle_the_stop_comes_first() -> None:
    stop, target = protective("stop_loss", "sell", "95"), protective("take_profit", "sell",
                                                                      "110")
    wide = candle(1, "100", "111", "94", "105")
    assert first_exit([target, stop], wide) == (stop, D(95))
    assert first_exit([target, stop], candle(1, "100", "111", "96", "105")) == (target, D(110))


def test_the_checks_refuse_with_the_numbers() -> None:
    strict = LIMITS.model_copy(update={"require_stop_loss": True,
                                       "max_loss_per_trade": D("50")})
    with pytest.raises(RiskLimitError, match=r"^Refused \(require_stop_loss\): this desk must "
                                             "give every entry a stop_loss"):
        check_entry_protection(strict, symbol="BTC/USDT", side="buy", amount=D(1),
                               price=D(100), opens=True, stop_loss=None, take_profit=None)
    with pytest.raises(RiskLimitError) as wrong_side:
        check_entry_protection(strict, symbol="BTC/USDT", side="buy", amount=D(1),
                               price=D(100), opens=True, stop_loss=D(101), take_profit=None,
                               price_name="ask")
    assert str(wrong_side.value) == (
        "Refused: stop_loss 101.00 is on the wrong side of the ask 100.00; a long position's "
        "stop must be below it.")
    with pytest.raises(RiskLimitError) as too_far:
        check_entry_protection(strict, symbol="BTC/USDT", side="buy", amount=D(2),
                               price=D(100), opens=True, stop_loss=D(70), take_profit=None,
                               price_name="limit price")
    assert str(too_far.value) == (
        "Refused (max_loss_per_trade): from the limit price 100.00 to the stop 70 is "
        "30 USDT x 2 BTC = 60.00 USDT at risk, more than max_loss_per_trade 50.00 USDT; "
        "bring the stop closer or trade less.")
    with pytest.raises(RiskLimitError, match="take_profit 99 is on the wrong side"):
        check_entry_protection(strict, symbol="BTC/USDT", side="buy", amount=D(1),
                               price=D(100), opens=True, stop_loss=D(90), take_profit=D(99))
    with pytest.raises(RiskLimitError, match="keep a stop; move it instead of removing it"):
        check_position_protection(strict, symbol="BTC/USDT", held=D(1), entry_price=D(100),
                                  mark=D(100), stop_loss=None, take_profit=None,
                                  removes_stop=True)
    # A short's stop goes above the price.
    check_position_protection(strict, symbol="BTC/USDT", held=D(-1), entry_price=D(100),
                              mark=D(99), stop_loss=D(120), take_profit=D(90),
                              removes_stop=False)


async def _open(database: Path, feed: ReplayFeed, paper: PaperExchangeConfig = FREE
                ) -> AsyncIterator[TradingVenue]:
    async with open_exchange(ExchangeConfig(paper=paper), state=TradingStateFile(database),
                             account="alpha", risk_limits=LIMITS, feed=feed) as venue:
        yield venue


def _feed(*rows: tuple[str, str, str, str]) -> ReplayFeed:
    return ReplayFeed({"BTC/USDT": series(*rows)}, speed=0, start_offset=1)


async def _enter(venue: TradingVenue, amount: str = "1", *, stop: str | None = "95",
                 target: str | None = "110") -> OrderRequest:
    """A market buy at 100 with its protection, as ``place_order`` sends it."""
    assert venue.risk is not None and venue.protection is not None
    request = OrderRequest("BTC/USDT", "buy", "market", D(amount), turn="t1")
    await venue.protection.attach(request, None if stop is None else D(stop),
                                  None if target is None else D(target))
    await venue.risk.place_order(request)
    await venue.protection.step()
    return request


async def _candle(venue: TradingVenue, feed: ReplayFeed) -> list[ProtectionEvent]:
    assert venue.protection is not None
    told: list[ProtectionEvent] = []
    venue.protection.on_event = told.append
    feed.advance(1)
    await venue.match_resting_orders()
    return told


async def test_a_stop_gapped_through_fills_at_the_open_and_cancels_the_target(
        tmp_path: Path) -> None:
    feed = _feed(("99", "101", "96", "97"), ("90", "91", "88", "89"))
    async for venue in _open(tmp_path / "state.sqlite3", feed):
        assert venue.protection is not None
        await _enter(venue)
        live = await venue.protection.live()
        assert [(o.kind, o.status, o.held, o.amount) for o in live] == [
            ("stop_loss", "active", "simulated", D(1)),
            ("take_profit", "active", "simulated", D(1))]
        assert await _candle(venue, feed) == []  # low 96: above the stop
        [event] = await _candle(venue, feed)     # opened at 90, below the stop at 95
        assert event.what == "fired" and event.profit == D(-10)
        assert event.text == ("alpha: the BTC/USDT stop-loss at 95 closed 1 BTC at 90 "
                              "(fired on the candle of 2024-01-01 00:10 UTC); the trade's "
                              "profit -10.00 USDT.")
        [trade] = await venue.books.trades()
        assert (trade.entry_price, trade.exit_price, trade.exit_reason, trade.profit) == (
            D(100), D(90), "stop_loss", D(-10))
        assert await venue.protection.live() == []
        history = await venue.protection.records.history()
        assert [(o.kind, o.status) for o in history] == [("stop_loss", "filled"),
                                                         ("take_profit", "canceled")]
        assert history[1].note == "its stop-loss filled (one cancels the other)"
        assert await venue.exchange.fetch_positions() == []


async def test_a_stop_and_a_target_inside_one_candle_close_at_the_stop(tmp_path: Path) -> None:
    feed = _feed(("100", "112", "94", "105"))
    async for venue in _open(tmp_path / "state.sqlite3", feed):
        await _enter(venue)
        [event] = await _candle(venue, feed)
        assert event.order.kind == "stop_loss" and event.order.exit_price == D(95)
        [trade] = await venue.books.trades()
        assert (trade.exit_price, trade.exit_reason, trade.profit) == (D(95), "stop_loss",
                                                                      D(-5))


async def test_a_target_reached_takes_the_profit(tmp_path: Path) -> None:
    feed = _feed(("101", "111", "100", "109"))
    async for venue in _open(tmp_path / "state.sqlite3", feed):
        await _enter(venue)
        [event] = await _candle(venue, feed)
        assert event.order.kind == "take_profit"
        [trade] = await venue.books.trades()
        assert (trade.exit_price, trade.exit_reason, trade.profit) == (D(110), "take_profit",
                                                                      D(10))


async def test_a_stop_moved_by_the_model_fires_at_its_new_price(tmp_path: Path) -> None:
    feed = _feed(("100", "103", "99", "102"), ("101", "101", "97", "98"))
    async for venue in _open(tmp_path / "state.sqlite3", feed):
        assert venue.protection is not None
        await _enter(venue)
        assert await _candle(venue, feed) == []
        live = await venue.protection.set("BTC/USDT", stop_loss=D(98))
        assert [(o.kind, o.trigger_price) for o in live] == [("take_profit", D(110)),
                                                             ("stop_loss", D(98))]
        [event] = await _candle(venue, feed)  # low 97: the moved stop at 98, not the old 95
        assert event.order.trigger_price == D(98)
        [trade] = await venue.books.trades()
        assert (trade.exit_price, trade.exit_reason, trade.profit) == (D(98), "stop_loss",
                                                                      D(-2))
        history = await venue.protection.records.history()
        assert [(o.kind, o.trigger_price, o.status, o.note) for o in history] == [
            ("stop_loss", D(95), "canceled", "moved"),
            ("take_profit", D(110), "canceled", "its stop-loss filled (one cancels the other)"),
            ("stop_loss", D(98), "filled", "fired on the candle of 2024-01-01 00:10 UTC")]


async def test_a_removed_target_no_longer_fires(tmp_path: Path) -> None:
    feed = _feed(("101", "111", "100", "109"))
    async for venue in _open(tmp_path / "state.sqlite3", feed):
        assert venue.protection is not None
        await _enter(venue)
        live = await venue.protection.set("BTC/USDT", take_profit=None)
        assert [o.kind for o in live] == ["stop_loss"]
        assert await _candle(venue, feed) == []
        [trade] = await venue.books.trades()
        assert trade.is_open


async def test_a_position_partly_closed_first_is_stopped_for_what_is_left(
        tmp_path: Path) -> None:
    feed = _feed(("104", "105", "103", "104"), ("96", "97", "93", "94"))
    async for venue in _open(tmp_path / "state.sqlite3", feed):
        assert venue.risk is not None
        await _enter(venue, "2")
        await _candle(venue, feed)
        await venue.risk.place_order(OrderRequest("BTC/USDT", "sell", "market", D("0.5"),
                                                  turn="t2"))  # at 104
        [event] = await _candle(venue, feed)  # opened at 96: the stop at 95 fills at 95
        assert event.order.amount == D("1.5")
        [trade] = await venue.books.trades()
        # 0.5 at 104 and 1.5 at 95: (52 + 142.5) / 2 = 97.25
        assert (trade.amount, trade.exit_price, trade.exit_reason) == (D(2), D("97.25"),
                                                                       "stop_loss")
        assert trade.profit == D("0.5") * 4 - D("1.5") * 5
        assert await venue.exchange.fetch_positions() == []


async def test_a_refused_entry_leaves_no_protection(tmp_path: Path) -> None:
    feed = _feed(("100", "100", "100", "100"))
    async for venue in _open(tmp_path / "state.sqlite3", feed):
        assert venue.protection is not None
        with pytest.raises(RiskLimitError, match="max_order_notional"):
            await _enter(venue, "5000")
        assert [o.status for o in await venue.protection.records.history()] == ["pending",
                                                                                "pending"]
        await venue.protection.step()  # its entry was never placed: nothing to protect
        assert await venue.protection.live() == []
        assert {o.note for o in await venue.protection.records.history()} == {
            "its entry never filled"}


async def test_a_stop_that_fired_while_the_daemon_was_down_is_booked_once_on_restart(
        tmp_path: Path) -> None:
    database = tmp_path / "state.sqlite3"
    feed = _feed(("99", "101", "96", "97"), ("97", "97", "92", "93"), ("93", "94", "92", "93"))
    async for venue in _open(database, feed):
        await _enter(venue)
    feed.advance(2)  # nobody watches: the stop is crossed in the second candle
    async for venue in _open(database, feed):
        assert venue.protection is not None
        told: list[ProtectionEvent] = []
        venue.protection.on_event = told.append
        await venue.reconcile()
        [event] = told
        assert event.while_down and event.order.exit_price == D(95)
        assert event.text.endswith("it fired while the daemon was not running and is booked "
                                   "now.")
        await venue.reconcile()
        await _candle(venue, feed)
        assert len(told) == 1
        [trade] = await venue.books.trades()
        assert (trade.exit_price, trade.exit_reason) == (D(95), "stop_loss")
        assert len(await venue.books.fills()) == 2


async def test_a_next_open_entry_is_protected_from_the_candle_it_fills_in(
        tmp_path: Path) -> None:
    """A backtest's market order fills at the next open; that candle can already stop it."""
    feed = _feed(("100", "101", "94", "96"))
    next_open = FREE.model_copy(update={"market_fill": "next_open"})
    async for venue in _open(tmp_path / "state.sqlite3", feed, next_open):
        assert venue.protection is not None
        await _enter(venue)
        assert [o.status for o in await venue.protection.live()] == ["pending", "pending"]
        [event] = await _candle(venue, feed)
        [trade] = await venue.books.trades()
        assert (trade.entry_price, trade.exit_price, trade.exit_reason) == (
            D(100), D(95), "stop_loss")
        assert event.profit == D(-5)


async def test_the_same_entry_attached_twice_stores_its_protection_once(tmp_path: Path) -> None:
    """A retried tool call (the same client order id) neither trades nor protects twice."""
    feed = _feed(("100", "100", "100", "100"))
    async for venue in _open(tmp_path / "state.sqlite3", feed):
        assert venue.protection is not None and venue.risk is not None
        request = OrderRequest("BTC/USDT", "buy", "market", D(1), turn="t1")
        for _ in range(2):
            await venue.protection.attach(request, D(95), D(110))
            await venue.risk.place_order(request)
            await venue.protection.step()
        assert [(o.kind, o.status) for o in await venue.protection.records.history()] == [
            ("stop_loss", "active"), ("take_profit", "active")]
        assert len(await venue.books.fills()) == 1
