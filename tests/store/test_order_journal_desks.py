"""Desks on one live account keep one order journal; each desk's unresolved and
open-believed orders are its own, so one desk's lost answer neither holds up another's
orders nor is looked up on its start."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from trading_agent.store import StoreTarget
from trading_agent.store.order_journal import SqliteOrderJournal
from trading_agent.trading.exchange import OrderRequest

AT = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


def _request() -> OrderRequest:
    return OrderRequest("BTC/USDT", "buy", "limit", Decimal("0.01"), Decimal("15000"))


async def test_each_desk_sees_only_its_own_unresolved_and_open_orders(
        target: StoreTarget) -> None:
    alpha = await SqliteOrderJournal.open(target, desk="alpha")
    beta = await SqliteOrderJournal.open(target, desk="beta")
    everyone = await SqliteOrderJournal.open(target)
    try:
        lost, resting = _request(), _request()
        await alpha.record(lost, "binance", AT)  # its answer never came
        await beta.record(resting, "binance", AT)
        await beta.mark(resting.client_order_id, "placed", AT, exchange_order_id="42")

        assert [i.request.client_order_id for i in await alpha.unresolved("binance")] == [
            lost.client_order_id]
        assert await beta.unresolved("binance") == []
        assert [i.request.client_order_id for i in await alpha.believed_open("binance")] == [
            lost.client_order_id]
        assert [i.request.client_order_id for i in await beta.believed_open("binance")] == [
            resting.client_order_id]
        # A journal of no desk (a tool, a test) sees every desk's; any desk finds any id.
        assert len(await everyone.believed_open("binance")) == 2
        found = await alpha.get(resting.client_order_id)
        assert found is not None and found.exchange_order_id == "42"
    finally:
        for journal in (alpha, beta, everyone):
            await journal.close()
