"""Protections put a desk in reduce-only, and the risk policy holds it there.

Paper desks opened through the factory as the daemon opens them, on a replay of the packaged
candles driven by hand (its clock moves only when the test advances it: the injectable clock
a pause is measured on), trading BTC/USDT and a second market made of the same candles
(ETH/USDT), so a desk can hold one position while another closes round trips.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from trading_agent.errors import RiskLimitError
from trading_agent.store.desk_books import SqliteDeskBooks
from trading_agent.store.reduce_only import SqliteReduceOnly
from trading_agent.store.trading_state import TradingStateFile
from trading_agent.trading.books import BookOrder, RoundTrip
from trading_agent.trading.config import (
    ExchangeConfig,
    FlipFlopGuardConfig,
    ProtectionsConfig,
    RiskLimits,
)
from trading_agent.trading.exchange import Order, OrderRequest
from trading_agent.trading.factory import TradingVenue, open_exchange
from trading_agent.trading.protections import Evidence, FlipFlopGuard, ProtectionGuard
from trading_agent.trading.reduce_only import ReduceOnly, ReduceOnlyStates
from trading_agent.trading.replay import ReplayFeed

from .conftest import packaged_candles

D = Decimal
LIMITS = RiskLimits(allowed_symbols=["BTC/USDT", "ETH/USDT"], max_order_notional=D("100000"),
                    max_position_notional=D("100000"), max_orders_per_hour=1000)
LIFTS = re.compile(r"until (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) UTC")


def _two_markets() -> ReplayFeed:
    btc = list(packaged_candles())
    eth = [dataclasses.replace(candle, symbol="ETH/USDT") for candle in btc]
    return ReplayFeed({"BTC/USDT": btc, "ETH/USDT": eth}, speed=0, start_offset=300)


async def _venue(database: Path, feed: ReplayFeed, protections: dict[str, Any],
                 states: ReduceOnlyStates | None = None) -> AsyncIterator[TradingVenue]:
    async with open_exchange(ExchangeConfig(), state=TradingStateFile(database), account="alpha",
                             risk_limits=LIMITS, feed=feed,
                             protections=ProtectionsConfig.model_validate(protections),
                             reduce_only=states) as venue:
        yield venue


async def _order(venue: TradingVenue, side: str, amount: str, symbol: str = "BTC/USDT",
                 turn: str = "t1") -> None:
    assert venue.risk is not None
    await venue.risk.place_order(OrderRequest(symbol, side, "market", D(amount),  # type: ignore[arg-type]
                                              turn=turn))


async def _refused(venue: TradingVenue, side: str, amount: str,
                   symbol: str = "BTC/USDT") -> str:
    with pytest.raises(RiskLimitError) as refused:
        await _order(venue, side, amount, symbol)
    assert refused.value.limit == "reduce_only"
    return str(refused.value)


def _lift_time(text: str) -> datetime:
    match = LIFTS.search(text)
    assert match is not None, text
    return datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)


async def test_stoploss_guard_trips_after_its_stops_refuses_new_exposure_and_lifts(
        tmp_path: Path) -> None:
    feed = _two_markets()
    async for venue in _venue(tmp_path / "s.sqlite3", feed, {"stoploss_guard": {
            "max_stops": 2, "lookback_minutes": 60, "pause_minutes": 30}}):
        await _order(venue, "buy", "0.2", "ETH/USDT")  # a position held throughout
        for _ in range(2):  # two round trips, each closed by its stop
            await _order(venue, "buy", "0.1")
            await _order(venue, "sell", "0.1", turn="stop_loss")
        trades = [t for t in await venue.books.trades() if t.symbol == "BTC/USDT"]
        assert [t.exit_reason for t in trades] == ["stop_loss", "stop_loss"]
        now = venue.exchange.now()

        text = await _refused(venue, "buy", "0.1")
        assert text.startswith("Refused (reduce_only, protection stoploss_guard): 2 round "
                               "trips closed by their stop loss within the last 1 h (max_stops "
                               "2; together -"), text
        assert "would take the BTC/USDT position from 0 to 0.1" in text
        assert _lift_time(text) == now + timedelta(minutes=30)
        assert "stoploss_guard" in (await _refused(venue, "buy", "0.1", "ETH/USDT"))
        await _order(venue, "sell", "0.08", "ETH/USDT")  # shrinks a position: passes
        held = {p.symbol: p.amount for p in await venue.exchange.fetch_positions()}
        assert held["ETH/USDT"] == D("0.12")

        feed.advance(5)  # 25 minutes: still paused
        await _refused(venue, "buy", "0.1")
        feed.advance(1)  # 30 minutes: lifted
        await _order(venue, "buy", "0.1")
        assert venue.risk is not None and venue.risk.protections is not None
        assert await venue.risk.protections.current() is None


async def test_max_drawdown_trips_on_the_equity_fall_and_does_not_trip_again_once_lifted(
        tmp_path: Path) -> None:
    feed = _two_markets()
    async for venue in _venue(tmp_path / "d.sqlite3", feed, {"max_drawdown": {
            "max_drawdown_percent": "0.1", "lookback_minutes": 120, "pause_minutes": 10}}):
        # 0.5 BTC at about 16,600 pays 10 bps of slippage and 0.1% fee at once: the
        # account's 10,000 USDT fall by about 0.17%.
        await _order(venue, "buy", "0.5")
        text = await _refused(venue, "buy", "0.01")
        assert re.match(r"Refused \(reduce_only, protection max_drawdown\): equity fell "
                        r"0\.1\d% from its high of 10,000(\.00)? USDT to 9,98\d\.\d+ USDT "
                        r"within the last 2 h \(max_drawdown_percent 0\.1%\)\.", text), text
        await _order(venue, "sell", "0.2")  # shrinks the position: passes
        feed.advance(2)
        await _order(venue, "buy", "0.01")  # lifted after 10 minutes; the old high is answered


async def test_cooldown_after_exit_holds_new_exposure_for_its_pause(tmp_path: Path) -> None:
    feed = _two_markets()
    async for venue in _venue(tmp_path / "c.sqlite3", feed, {"cooldown_after_exit": {
            "pause_minutes": 15}}):
        await _order(venue, "buy", "0.2", "ETH/USDT")
        await _order(venue, "buy", "0.1")
        await _order(venue, "sell", "0.1")
        exit_at = venue.exchange.now()
        text = await _refused(venue, "buy", "0.1")
        assert text.startswith("Refused (reduce_only, protection cooldown_after_exit): a "
                               "BTC/USDT long round trip closed at "), text
        assert "no new exposure for 15 min after an exit" in text
        assert _lift_time(text) == exit_at + timedelta(minutes=15)
        feed.advance(1)
        await _order(venue, "sell", "0.2", "ETH/USDT")  # closes the other position: passes
        # ... and that exit starts a cooldown of its own once the first one lifts.
        feed.advance(1)
        assert "BTC/USDT long round trip" in await _refused(venue, "buy", "0.1")
        feed.advance(1)  # the first lifts at 15 minutes after its exit
        text = await _refused(venue, "buy", "0.1")
        assert "ETH/USDT long round trip" in text
        feed.advance(1)
        await _order(venue, "buy", "0.1")


async def test_tool_error_guard_counts_failed_calls_but_not_its_own_refusals(
        tmp_path: Path) -> None:
    feed = _two_markets()
    async for venue in _venue(tmp_path / "t.sqlite3", feed, {"tool_error_guard": {
            "max_errors": 2, "lookback_minutes": 30, "pause_minutes": 20}}):
        assert venue.risk is not None and venue.risk.protections is not None
        guard = venue.risk.protections
        await _order(venue, "buy", "0.2")
        for _ in range(2):
            guard.note_tool_result(True, "max_order_notional")
        guard.note_tool_result(False, None)
        await _order(venue, "buy", "0.1")  # two errors: not more than max_errors
        guard.note_tool_result(True, None)
        text = await _refused(venue, "buy", "0.1")
        assert "protection tool_error_guard): 3 tool calls failed or were refused within the " \
               "last 30 min (max_errors 2)" in text, text
        for _ in range(5):  # reduce-only's own refusals do not keep it going
            guard.note_tool_result(True, "reduce_only")
        await _order(venue, "sell", "0.1")
        feed.advance(4)
        await _order(venue, "buy", "0.1")


async def test_an_operators_reduce_only_outlives_a_restart_and_a_protection_never_replaces_it(
        tmp_path: Path) -> None:
    database = tmp_path / "r.sqlite3"
    feed = _two_markets()
    states = await ReduceOnlyStates.restore(await SqliteReduceOnly.open(database))
    seen: list[tuple[str, bool, str]] = []
    states.on_change = lambda state, on, by: seen.append((state.desk, on, by))
    at = feed.now()
    await states.switch_on(ReduceOnly("alpha", "ann", "FOMC at 18:00", at))
    # A protection's timed state does not replace an operator's.
    kept = await states.switch_on(ReduceOnly("alpha", "protection x", "y", at,
                                             at + timedelta(hours=1), "x"))
    assert kept.by == "ann"
    await states.close()

    states = await ReduceOnlyStates.restore(await SqliteReduceOnly.open(database))
    try:
        async for venue in _venue(database, feed, {"cooldown_after_exit": {"pause_minutes": 5}},
                                  states):
            text = await _refused(venue, "buy", "0.1")
            assert text.startswith("Refused (reduce_only, set by ann): FOMC at 18:00. This "
                                   "desk may only reduce its positions until an operator "
                                   "switches it off: this buy of 0.1 BTC would take the "
                                   "BTC/USDT position from 0 to 0.1"), text
            assert text.endswith("it holds no position to reduce.")
            feed.advance(100)
            await _refused(venue, "buy", "0.1")  # an operator's has no end of its own
            assert (await states.switch_off("alpha", "bob")) is not None
            await _order(venue, "buy", "0.1")
    finally:
        await states.close()
    assert seen == [("alpha", True, "ann")]


def _trip(side: str, opened_minutes: int, number: int) -> RoundTrip:
    start = datetime(2024, 1, 1, tzinfo=UTC)
    return RoundTrip(number, "BTC/USDT:USDT", side, start + timedelta(minutes=opened_minutes),  # type: ignore[arg-type]
                     D(1), D(100))


def test_flip_flop_guard_counts_reversals_of_the_position_within_its_lookback() -> None:
    rule = FlipFlopGuard(FlipFlopGuardConfig(max_flips=2, lookback_minutes=60,
                                             pause_minutes=30))
    now = datetime(2024, 1, 1, 2, 0, tzinfo=UTC)
    # long, short, long, long, short: three reversals, the first one long before the lookback.
    trades = [_trip("long", 0, 1), _trip("short", 10, 2), _trip("long", 70, 3),
              _trip("long", 80, 4), _trip("short", 100, 5)]
    evidence = Evidence(trades, [], [], "USDT")
    assert rule.check(evidence, now, None) is None  # two in the last hour: not more than 2
    trades.append(_trip("long", 110, 6))
    trip = rule.check(Evidence(trades, [], [], "USDT"), now, None)
    assert trip is not None
    assert trip.reason == ("the desk reversed its position 3 times within the last 1 h "
                           "(max_flips 2), the last at 01:50 UTC")
    assert trip.until == datetime(2024, 1, 1, 2, 20, tzinfo=UTC)
    # What a previous trip counted is not counted again: only reversals after it.
    after = datetime(2024, 1, 1, 1, 5, tzinfo=UTC)
    assert rule.check(Evidence(trades, [], [], "USDT"), now, after) is not None
    after = datetime(2024, 1, 1, 1, 20, tzinfo=UTC)
    assert rule.check(Evidence(trades, [], [], "USDT"), now, after) is None


async def test_flip_flop_guard_reads_the_reversals_in_the_desks_own_books(tmp_path: Path) -> None:
    """A derivatives desk's fills, as an exchange reports its orders, kept in the real books:
    long, then a sell that crosses zero (short), then a buy that crosses back, twice over."""
    books = await SqliteDeskBooks.open(tmp_path / "f.sqlite3", "alpha")
    clock = [datetime(2024, 1, 1, 12, 0, tzinfo=UTC)]
    states = ReduceOnlyStates.in_memory()

    async def no_equity() -> Decimal | None:
        return None

    guard = ProtectionGuard("alpha", [FlipFlopGuard(FlipFlopGuardConfig(
        max_flips=2, lookback_minutes=60, pause_minutes=45))], states, books,
        lambda: clock[0], no_equity, "USDT")
    symbol = "BTC/USDT:USDT"
    try:
        for number, (side, amount) in enumerate([("buy", "1"), ("sell", "2"), ("buy", "2"),
                                                 ("sell", "2")], start=1):
            request = OrderRequest(symbol, side, "market", D(amount),  # type: ignore[arg-type]
                                   client_order_id=f"c{number}", turn=f"t{number}")
            await books.note_order(BookOrder(request.client_order_id, symbol, request.side,
                                             "market", request.amount, None, request.turn,
                                             clock[0]))
            await books.observe(Order(f"o{number}", request.client_order_id, symbol,
                                      request.side, "market", request.amount, None, "closed",
                                      request.amount, D(100), D(0), None, clock[0]), clock[0])
            if number == 3:
                assert await guard.current() is None  # two reversals: not more than max_flips
            clock[0] += timedelta(minutes=5)
        state = await guard.current()
        assert state is not None and state.protection == "flip_flop_guard"
        assert state.reason == ("the desk reversed its position 3 times within the last 1 h "
                                "(max_flips 2), the last at 12:15 UTC")
        assert state.until == datetime(2024, 1, 1, 13, 0, tzinfo=UTC)
        assert [t.exit_reason for t in await books.trades() if not t.is_open] == [
            "reversed"] * 3
        clock[0] = datetime(2024, 1, 1, 13, 0, tzinfo=UTC)
        assert await guard.current() is None  # lifted at its end, and not tripped again
        assert states.states() == []
    finally:
        await books.close()
