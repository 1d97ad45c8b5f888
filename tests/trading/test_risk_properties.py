"""Random orders thrown at a risk policy on the paper exchange: no accepted order breaks a limit.

Each example replays the real candles, moving the clock forward a random number of candles
between orders (so hours and UTC days roll over; the policy observes every candle, as the
daemon has it do), and checks every accepted order against the limits with numbers computed
here, independently of the policy.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta
from decimal import Decimal

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trading_agent.errors import OrderRejectedError, RiskLimitError
from trading_agent.store.paper_books import SqlitePaperBooks
from trading_agent.trading.config import PaperExchangeConfig, RiskLimits
from trading_agent.trading.exchange import OrderRequest
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.risk import RiskPolicy
from trading_agent.trading.valuation import value_account

from .conftest import packaged_candles, replay_feed

D = Decimal
PAPER = PaperExchangeConfig(starting_balances={"USDT": D("20000"), "BTC": D("0.05")},
                            taker_fee=D("0.001"), maker_fee=D("0.0008"), slippage_bps=D("10"))
# Tight limits, so that random orders run into every one of them.
LIMITS = RiskLimits(allowed_symbols=["BTC/USDT"], max_order_notional=D("1500"),
                    max_position_notional=D("3000"), max_open_orders=3, max_orders_per_hour=8,
                    max_daily_loss=D("10"))

orders = st.lists(
    st.tuples(
        st.sampled_from(["BTC/USDT", "BTC/USDT", "BTC/USDT", "ETH/USDT"]),
        st.sampled_from(["buy", "sell"]),
        st.sampled_from(["market", "limit"]),
        st.decimals(min_value=D("0.001"), max_value=D("0.1"), places=3),
        st.integers(min_value=-200, max_value=200),  # limit price offset from last, in bps
        # Candles elapsed before the order: mostly bursts, sometimes hours, sometimes a day.
        st.one_of(st.integers(0, 2), st.integers(0, 2), st.integers(0, 24),
                  st.integers(100, 300)),
    ),
    min_size=20,
    max_size=50,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(orders)
def test_no_accepted_order_breaks_a_limit(
        script: list[tuple[str, str, str, Decimal, int, int]]) -> None:
    anyio.run(_play, script)


async def _play(script: list[tuple[str, str, str, Decimal, int, int]]) -> None:
    feed = replay_feed(candles=packaged_candles()[:4000])  # two weeks are plenty
    paper = await PaperExchange.open(PAPER, feed, await SqlitePaperBooks.open(":memory:"))
    policy = RiskPolicy(LIMITS, paper)
    accepted_at: list[datetime] = []
    day_start: dict[date, Decimal] = {}
    halted: set[date] = set()
    try:
        for symbol, side, kind, amount, offset_bps, elapsed in script:
            for _ in range(elapsed):
                feed.advance()
                if paper.now().date() not in day_start:
                    # The daemon has the policy observe every candle; only a day's first
                    # observation matters, so the test makes just that one.
                    await policy.observe()
                    day_start[paper.now().date()] = (await value_account(paper, "USDT")).total
            await paper.sync()
            now = paper.now()
            equity = (await value_account(paper, "USDT")).total
            day_start.setdefault(now.date(), equity)
            last = (await feed.ticker("BTC/USDT")).last
            price = (last * (1 + D(offset_bps) / 10000)).quantize(D("0.1"))
            request = OrderRequest(symbol, side, kind, amount,  # type: ignore[arg-type]
                                   price if kind == "limit" else None)
            ticker = await paper.fetch_ticker("BTC/USDT")
            check_price = price if kind == "limit" else (ticker.ask if side == "buy"
                                                         else ticker.bid)
            assert check_price is not None
            open_before = await paper.fetch_open_orders()
            held = sum((p.amount for p in await paper.fetch_positions()), D(0))
            try:
                await policy.place_order(request)
            except RiskLimitError as refusal:
                assert refusal.limit in str(refusal)  # every refusal names its limit
                if refusal.limit == "max_daily_loss":
                    halted.add(now.date())
                continue
            except OrderRejectedError:
                continue  # the exchange refused it (funds): not placed

            assert symbol in LIMITS.allowed_symbols
            assert now.date() not in halted
            assert day_start[now.date()] - equity < LIMITS.max_daily_loss
            assert amount * check_price <= LIMITS.max_order_notional
            pending = sum((o.remaining for o in open_before if o.side == side), D(0))
            projected = held + pending + amount if side == "buy" else held - pending - amount
            assert abs(projected) <= abs(held) or \
                abs(projected) * check_price <= LIMITS.max_position_notional
            if kind == "limit":
                assert len(open_before) < LIMITS.max_open_orders
            assert len(await paper.fetch_open_orders()) <= LIMITS.max_open_orders
            accepted_at.append(now)
            in_hour = [t for t in accepted_at if t > now - timedelta(hours=1)]
            assert len(in_hour) <= LIMITS.max_orders_per_hour
    finally:
        await paper.close()
