"""The risk policy on the paper exchange: each limit refuses with the numbers, and holds.

The replay starts at 17:45 UTC on 2023-01-03 with BTC at 16,612.0; the paper exchange's ask
(10 bps of slippage) is 16,628.612 and its bid 16,595.388.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import anyio
import pytest

from trading_agent.errors import RiskLimitError
from trading_agent.store.halts import SqliteHalts
from trading_agent.store.paper_books import SqlitePaperBooks
from trading_agent.store.risk_records import SqliteRiskRecords
from trading_agent.trading.config import PaperExchangeConfig, RiskLimits
from trading_agent.trading.exchange import Candle, Order, OrderRequest
from trading_agent.trading.kill_switch import ALL_DESKS, KillSwitch
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.replay import ReplayFeed
from trading_agent.trading.risk import RiskPolicy
from trading_agent.trading.risk_journal import RiskJournal

from .conftest import replay_feed

D = Decimal
PAPER = PaperExchangeConfig(starting_balances={"USDT": D("100000")}, taker_fee=D("0.001"),
                            maker_fee=D("0.0008"), slippage_bps=D("10"))
LIMITS = RiskLimits(allowed_symbols=["BTC/USDT"], max_order_notional=D("10000"),
                    max_position_notional=D("20000"), max_open_orders=3,
                    max_orders_per_hour=10, max_daily_loss=D("500"))


@dataclass
class Desk:
    feed: ReplayFeed
    paper: PaperExchange
    policy: RiskPolicy


@pytest.fixture
async def desk(feed: ReplayFeed, database: Path) -> AsyncIterator[Desk]:
    paper = await PaperExchange.open(PAPER, feed, await SqlitePaperBooks.open(database))
    yield Desk(feed, paper, RiskPolicy(LIMITS, paper))
    await paper.close()


def order(side: str, amount: str, price: str | None = None, symbol: str = "BTC/USDT"
          ) -> OrderRequest:
    return OrderRequest(symbol, side, "market" if price is None else "limit",  # type: ignore[arg-type]
                        D(amount), None if price is None else D(price))


async def refused(policy: RiskPolicy, request: OrderRequest) -> RiskLimitError:
    with pytest.raises(RiskLimitError) as caught:
        await policy.place_order(request)
    return caught.value


async def test_a_symbol_outside_the_list_is_refused(desk: Desk) -> None:
    error = await refused(desk.policy, order("buy", "1", symbol="ETH/USDT"))

    assert error.limit == "allowed_symbols"
    assert str(error) == ("Refused: ETH/USDT is not in allowed_symbols; this desk may trade "
                          "BTC/USDT.")


async def test_an_order_too_large_is_refused_with_its_notional(desk: Desk) -> None:
    error = await refused(desk.policy, order("buy", "0.5", "25000"))

    assert error.limit == "max_order_notional"
    assert str(error) == ("Refused: order notional 12,500.00 USDT exceeds max_order_notional "
                          "10,000.00 USDT.")
    assert await desk.paper.fills() == []  # the exchange never saw it


async def test_a_market_buy_is_valued_at_the_ask(desk: Desk) -> None:
    # 0.6014 × 16,628.612 = 10,000.447... > 10,000, though 0.6014 × last would pass.
    error = await refused(desk.policy, order("buy", "0.6014"))

    assert "order notional 10,000.45 USDT" in str(error)
    accepted = await desk.policy.place_order(order("buy", "0.6013"))
    assert accepted.status == "closed"


async def test_the_position_limit_counts_open_orders_and_allows_reducing(desk: Desk) -> None:
    await desk.policy.place_order(order("buy", "0.6"))  # 0.6 BTC held
    await desk.policy.place_order(order("buy", "0.3", "16000"))  # resting buy

    error = await refused(desk.policy, order("buy", "0.36", "16000"))

    assert error.limit == "max_position_notional"
    assert str(error) == (
        "Refused: the BTC/USDT position could reach 1.26 BTC = 20,160.00 USDT (held 0.6, open "
        "buy orders 0.3, this order 0.36), exceeding max_position_notional 20,000.00 USDT.")
    await desk.policy.place_order(order("buy", "0.35", "16000"))  # exactly at the limit
    await desk.policy.place_order(order("sell", "0.5"))  # reducing is always allowed


async def test_open_orders_are_capped_but_market_orders_do_not_rest(desk: Desk) -> None:
    for price in ("15000", "15100", "15200"):
        await desk.policy.place_order(order("buy", "0.01", price))

    error = await refused(desk.policy, order("buy", "0.01", "15300"))

    assert error.limit == "max_open_orders"
    assert str(error) == ("Refused: 3 orders are open and max_open_orders is 3; cancel one "
                          "first.")
    assert (await desk.policy.place_order(order("buy", "0.01"))).status == "closed"


async def test_orders_per_hour_roll_with_the_exchange_clock(feed: ReplayFeed,
                                                            database: Path) -> None:
    paper = await PaperExchange.open(PAPER, feed, await SqlitePaperBooks.open(database))
    policy = RiskPolicy(LIMITS.model_copy(update={"max_orders_per_hour": 3}), paper)
    try:
        for _ in range(3):
            await policy.place_order(order("buy", "0.01"))
            feed.advance()  # five minutes between orders: 17:45, 17:50, 17:55
        error = await refused(policy, order("buy", "0.01"))
        feed.advance(9)  # 18:45: the 17:45 order is an hour old
        again = await policy.place_order(order("buy", "0.01"))
    finally:
        await paper.close()

    assert error.limit == "max_orders_per_hour"
    assert str(error) == ("Refused: 3 orders placed in the last hour and max_orders_per_hour "
                          "is 3; the next slot opens at 18:45 UTC.")
    assert again.status == "closed"


async def test_a_daily_loss_halts_the_day_and_switches_the_kill_switch_on(
        feed: ReplayFeed, database: Path) -> None:
    paper = await PaperExchange.open(PAPER, feed, await SqlitePaperBooks.open(database))
    limits = LIMITS.model_copy(update={"max_daily_loss": D("15")})
    journal = await RiskJournal.restore(await SqliteRiskRecords.open(database), "alpha", feed.now())
    switch = await KillSwitch.restore(await SqliteHalts.open(database))
    policy = RiskPolicy(limits, paper, journal=journal, kill_switch=switch)
    try:
        await policy.observe()  # the day starts at 100,000 USDT
        # 0.6 BTC bought at the ask costs 9.97 of slippage and 9.98 of fee: about 19.95 lost.
        await policy.place_order(order("buy", "0.6"))
        error = await refused(policy, order("sell", "0.6"))
        later = await refused(policy, order("sell", "0.1"))
        await journal.close()
        await switch.close()
        # A restart does not lift the halt, nor the kill switch.
        journal = await RiskJournal.restore(await SqliteRiskRecords.open(database), "alpha",
                                            feed.now())
        switch = await KillSwitch.restore(await SqliteHalts.open(database))
        policy = RiskPolicy(limits, paper, journal=journal, kill_switch=switch)
        after_restart = await refused(policy, order("sell", "0.1"))
        feed.advance(75)  # 00:00 UTC on 2023-01-04
        next_day = await refused(policy, order("sell", "0.1"))
        await switch.switch_off("alpha")  # an operator has looked
        switched_off = await policy.place_order(order("sell", "0.1"))
    finally:
        await journal.close()
        await switch.close()
        await paper.close()

    assert error.limit == "max_daily_loss"
    assert str(error).startswith("Refused: daily loss 19.9")
    assert str(error).endswith("USDT since 00:00 UTC reached max_daily_loss 15.00 USDT; new "
                               "orders are halted until 00:00 UTC on 2023-01-04.")
    assert later.limit == after_restart.limit == next_day.limit == "kill_switch"
    assert str(next_day).startswith("Refused (kill_switch): halted by risk limit "
                                    "max_daily_loss at 2023-01-03 ")
    assert "UTC: daily loss 19.9" in str(next_day)
    assert switched_off.status == "closed"


async def test_the_kill_switch_refuses_every_order_before_the_exchange_sees_it(
        desk: Desk) -> None:
    switch = KillSwitch.in_memory()
    policy = RiskPolicy(LIMITS, desk.paper, kill_switch=switch)
    before = len(await desk.paper.fills())
    await switch.switch_on(ALL_DESKS, "alice", "exchange outage",
                           datetime(2023, 1, 3, 9, 30, tzinfo=UTC))
    everywhere = await refused(policy, order("buy", "0.01"))
    await switch.switch_on(policy.desk, "bob", "model misbehaves")
    await switch.switch_off(ALL_DESKS)
    own = await refused(policy, order("buy", "0.01"))
    await switch.switch_off(policy.desk)
    placed = await policy.place_order(order("buy", "0.01"))

    assert everywhere.limit == own.limit == "kill_switch"
    assert str(everywhere) == ("Refused (kill_switch): halted by alice at 2023-01-03 09:30:00 UTC: "
                               "exchange outage. No new order is sent until an operator "
                               "switches the kill switch off.")
    assert "halted by bob at " in str(own)
    assert len(await desk.paper.fills()) == before + 1 == len([placed])


async def test_concurrent_orders_cannot_both_squeeze_under_a_limit(desk: Desk) -> None:
    # Each order alone (11,640 USDT) is within the position limit; together they are not.
    policy = RiskPolicy(LIMITS.model_copy(update={"max_order_notional": D("15000")}),
                        desk.paper)
    results: list[Order | RiskLimitError] = []

    async def place() -> None:
        try:
            results.append(await policy.place_order(order("buy", "0.7")))
        except RiskLimitError as exc:
            results.append(exc)

    async with anyio.create_task_group() as group:
        group.start_soon(place)
        group.start_soon(place)

    assert sorted(type(r).__name__ for r in results) == ["Order", "RiskLimitError"]
    [position] = await desk.paper.fetch_positions()
    assert position.amount == D("0.7")


async def test_describe_reports_usage(desk: Desk) -> None:
    await desk.policy.place_order(order("buy", "0.01", "15000"))

    text = await desk.policy.describe()

    assert "Open orders 1/3; orders in the last hour 1/10" in text
    assert "max order 10,000.00" in text


async def test_a_sell_limit_below_the_market_is_valued_at_the_bid(desk: Desk) -> None:
    await desk.policy.place_order(order("buy", "0.5"))  # something to sell
    # It would fill at the bid (16,595.388), so its limit price of 1 must not value it.
    check = await desk.policy.check(order("sell", "0.5", "1"))
    above = await desk.policy.check(order("sell", "0.5", "20000"))
    assert check.price == D("16595.388") and check.notional == D("8297.694")
    assert above.price == D("20000")
    error = await refused(desk.policy, order("sell", "1", "1"))
    assert error.limit == "max_order_notional"


async def test_the_day_does_not_start_while_a_holding_has_no_price(database: Path) -> None:
    t0 = datetime(2024, 1, 1, tzinfo=UTC)
    closes = [D(20000), D(20000), D(15000)]
    candles = tuple(Candle("BTC/USDT", "5m", t0 + i * timedelta(minutes=5), c, c, c, c, D(1))
                    for i, c in enumerate(closes))
    feed = replay_feed(start_offset=0, candles=candles)
    config = PaperExchangeConfig(starting_balances={"USDT": D("1000"), "BTC": D("1")})
    paper = await PaperExchange.open(config, feed, await SqlitePaperBooks.open(database))
    policy = RiskPolicy(LIMITS.model_copy(update={"max_daily_loss": D("1000")}), paper)
    try:
        assert await policy.observe() is None  # BTC has no price yet: no start value
        unpriced = await refused(policy, order("buy", "0.01"))
        feed.advance(1)
        started = await policy.observe()
        feed.advance(2)  # BTC 20,000 -> 15,000: 5,000 lost
        halted = await refused(policy, order("buy", "0.01"))
    finally:
        await paper.close()
    assert unpriced.limit == "max_daily_loss"
    assert str(unpriced) == ("Refused: BTC cannot be priced in USDT right now, so the daily "
                             "loss cannot be checked; try again in a few minutes.")
    assert started is not None and started.start_equity == D("21000")
    assert str(halted).startswith("Refused: daily loss 5,000.00 USDT since 00:00 UTC")


async def test_a_kill_switch_set_by_another_daemon_holds_once_refreshed(
        feed: ReplayFeed, database: Path) -> None:
    """In a fleet each daemon has its own switch on the shared store: the daemon that takes a
    desk over reads the switches again and refuses the orders another daemon halted."""
    paper = await PaperExchange.open(PAPER, feed, await SqlitePaperBooks.open(database))
    here = await KillSwitch.restore(await SqliteHalts.open(database))
    there = await KillSwitch.restore(await SqliteHalts.open(database))
    journal = await RiskJournal.restore(await SqliteRiskRecords.open(database), "alpha", feed.now())
    policy = RiskPolicy(LIMITS, paper, journal=journal, kill_switch=here)
    try:
        await there.switch_on("alpha", "ann", "moving it")
        before = await policy.place_order(order("buy", "0.01"))
        await here.refresh()
        refusal = await refused(policy, order("buy", "0.01"))
        await there.switch_off("alpha", "ann")
        await here.refresh()
        after = await policy.place_order(order("buy", "0.01"))
    finally:
        await journal.close()
        await here.close()
        await there.close()
        await paper.close()

    assert before.status == after.status == "closed"
    assert refusal.limit == "kill_switch"
    assert "halted by ann" in str(refusal) and "moving it" in str(refusal)


async def test_a_spot_desk_may_not_sell_more_than_it_holds(desk: Desk) -> None:
    await desk.policy.place_order(order("buy", "0.1"))
    error = await refused(desk.policy, order("sell", "0.2"))
    assert error.limit == "own_position"
    assert str(error) == (
        "Refused (own_position): this desk holds 0.1 BTC of BTC/USDT itself, and may sell at "
        "most 0.1 BTC; the account holds 0.1 BTC, but what this desk did not buy is not its "
        "to sell.")
    await desk.policy.place_order(order("sell", "0.1"))  # all it holds: allowed
