"""Stops and targets on a live venue: ccxt's real signing and parsing against the FakeBinance
stand-in. The protection goes to the exchange as Binance's own stop orders, each with its
client order id stored before sending; one side filling cancels the other; a stop that fired
while the daemon was down is found and booked once on restart; an exchange that cannot hold
a stop leaves it to the daemon to watch.

The fake's last price is 16,709.9, where a market buy of 0.01 BTC fills.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path

from structlog.testing import capture_logs

from trading_agent.store.trading_state import TradingStateFile
from trading_agent.trading.config import CcxtExchangeConfig, ExchangeConfig, RiskLimits
from trading_agent.trading.exchange import OrderRequest
from trading_agent.trading.factory import TradingVenue, open_exchange
from trading_agent.trading.protection_keeper import ProtectionEvent

from .binance_server import FakeBinance
from .conftest import ENVIRON, RecordingSleep

D = Decimal
ORDER = "/api/v3/order"
LIMITS = RiskLimits(max_order_notional=D("1000"))
NO_STOPS = {"createStopLossOrder": False, "createStopOrder": False, "createTriggerOrder": False,
            "createTakeProfitOrder": False, "createStopLimitOrder": False,
            "createStopMarketOrder": False}


@asynccontextmanager
async def _venue(config: CcxtExchangeConfig, database: Path, sleep: RecordingSleep
                 ) -> AsyncIterator[TradingVenue]:
    async with open_exchange(ExchangeConfig(mode="live", ccxt=config),
                             state=TradingStateFile(database), account="alpha",
                             environ=ENVIRON, sleep=sleep, risk_limits=LIMITS) as venue:
        yield venue


async def _enter(venue: TradingVenue, stop: str = "16500", target: str = "16900"
                 ) -> OrderRequest:
    assert venue.risk is not None and venue.protection is not None
    request = OrderRequest("BTC/USDT", "buy", "market", D("0.01"), turn="t1")
    await venue.protection.attach(request, D(stop), D(target))
    await venue.risk.place_order(request)
    await venue.protection.step()
    return request


def _posted(binance: FakeBinance) -> list[dict[str, str]]:
    return [r.params for r in binance.requests if r.method == "POST" and r.path == ORDER]


async def test_the_stop_and_the_target_are_held_by_the_exchange_and_one_cancels_the_other(
        ccxt_config: CcxtExchangeConfig, binance: FakeBinance, database: Path,
        sleep: RecordingSleep) -> None:
    async with _venue(ccxt_config, database, sleep) as venue:
        assert venue.protection is not None
        told: list[ProtectionEvent] = []
        venue.protection.on_event = told.append
        await _enter(venue)
        stop, target = await venue.protection.live()
        _, stop_sent, target_sent = _posted(binance)
        assert {k: stop_sent[k] for k in ("type", "side", "quantity", "stopPrice", "price",
                                          "newClientOrderId")} == {
            "type": "STOP_LOSS_LIMIT", "side": "SELL", "quantity": "0.01",
            "stopPrice": "16500", "price": "16417.5",
            "newClientOrderId": stop.client_order_id}
        assert {k: target_sent[k] for k in ("type", "side", "stopPrice", "price",
                                            "newClientOrderId")} == {
            "type": "TAKE_PROFIT_LIMIT", "side": "SELL", "stopPrice": "16900",
            "price": "16900", "newClientOrderId": target.client_order_id}
        assert (stop.held, target.held) == ("exchange", "exchange")
        # The desk's resting orders are its own decisions; its protection is apart.
        assert await venue.exchange.fetch_open_orders() == []

        [filled] = binance.set_price("16450")
        await venue.match_resting_orders()
        assert binance.orders[filled]["clientOrderId"] == stop.client_order_id
        assert binance.orders[int(target.order_id or 0)]["status"] == "CANCELED"
        [event] = told
        assert (event.what, event.while_down) == ("fired", False)
        [trade] = await venue.books.trades()
        assert (trade.exit_price, trade.exit_reason) == (D("16450"), "stop_loss")
        assert event.profit == trade.profit
        assert [(o.kind, o.status) for o in await venue.protection.records.history()] == [
            ("stop_loss", "filled"), ("take_profit", "canceled")]
        assert binance.balance("BTC") == (D("0.5"), D(0))  # nothing held back any more


async def test_a_stop_that_fired_during_a_restart_is_found_and_booked_once(
        ccxt_config: CcxtExchangeConfig, binance: FakeBinance, database: Path,
        sleep: RecordingSleep) -> None:
    async with _venue(ccxt_config, database, sleep) as venue:
        await _enter(venue)
    binance.set_price("16950")  # the target fills while no daemon runs
    async with _venue(ccxt_config, database, sleep) as venue:
        assert venue.protection is not None
        told: list[ProtectionEvent] = []
        venue.protection.on_event = told.append
        await venue.reconcile()
        [event] = told
        assert event.while_down and event.order.kind == "take_profit"
        assert "it fired while the daemon was not running and is booked now" in event.text
        await venue.reconcile()
        await venue.match_resting_orders()
        assert len(told) == 1
        [trade] = await venue.books.trades()
        assert (trade.exit_price, trade.exit_reason) == (D("16950"), "take_profit")
        assert len(await venue.books.fills()) == 2
        assert sum(1 for o in binance.orders.values() if o["status"] == "CANCELED") == 1


async def test_a_spot_venue_holding_the_coins_for_the_stop_leaves_the_target_to_the_daemon(
        ccxt_config: CcxtExchangeConfig, binance: FakeBinance, database: Path,
        sleep: RecordingSleep) -> None:
    binance.set_balance("BTC", "0")  # the desk's 0.01 is all there is: the stop holds it
    async with _venue(ccxt_config, database, sleep) as venue:
        assert venue.protection is not None
        told: list[ProtectionEvent] = []
        venue.protection.on_event = told.append
        await _enter(venue)
        stop, target = await venue.protection.live()
        assert (stop.held, target.held) == ("exchange", "daemon")
        [event] = told
        assert event.what == "watched" and "the daemon watches the price instead" in event.text
        binance.set_price("16910")  # the target is crossed: the daemon cancels the stop, sells
        await venue.match_resting_orders()
        [trade] = await venue.books.trades()
        assert (trade.exit_price, trade.exit_reason) == (D("16910"), "take_profit")
        assert binance.orders[int(stop.order_id or 0)]["status"] == "CANCELED"
        assert await venue.protection.live() == []


async def test_an_exchange_that_cannot_hold_stops_has_them_watched_by_the_daemon(
        ccxt_config: CcxtExchangeConfig, binance: FakeBinance, database: Path,
        sleep: RecordingSleep) -> None:
    config = ccxt_config.model_copy(update={"client_settings": {
        **ccxt_config.client_settings, "has": NO_STOPS}})
    with capture_logs() as logs:
        async with _venue(config, database, sleep) as venue:
            # What run logs for the desk as it opens its venue.
            [said] = [line for line in logs if line["event"] == "protection_watched_by_daemon"]
            assert (said["desk"], said["log_level"]) == ("alpha", "warning")
            assert said["text"] == (
                "binance cannot hold stop-loss and take-profit orders itself (by ccxt's has "
                "flags): the daemon watches the price and sends a market order when it is "
                "crossed, so this protection stops when the daemon does.")
            assert venue.protection is not None
            await _enter(venue)
            assert [o.held for o in await venue.protection.live()] == ["daemon", "daemon"]
            assert len(_posted(binance)) == 1  # the entry only
            binance.set_price("16490")
            await venue.match_resting_orders()
            _, exit_ = _posted(binance)
            stop = (await venue.protection.records.history())[0]
            assert (exit_["type"], exit_["side"], exit_["newClientOrderId"]) == (
                "MARKET", "SELL", stop.client_order_id)
            [trade] = await venue.books.trades()
            assert (trade.exit_price, trade.exit_reason) == (D("16490"), "stop_loss")


async def test_a_position_partly_sold_has_its_stop_placed_again_for_the_rest(
        ccxt_config: CcxtExchangeConfig, binance: FakeBinance, database: Path,
        sleep: RecordingSleep) -> None:
    binance.set_balance("BTC", "0")
    async with _venue(ccxt_config, database, sleep) as venue:
        assert venue.risk is not None and venue.protection is not None
        request = OrderRequest("BTC/USDT", "buy", "market", D("0.02"), turn="t1")
        await venue.protection.attach(request, D("16500"), None)
        await venue.risk.place_order(request)
        await venue.protection.step()
        [first] = await venue.protection.live()
        # The coins are held for the stop: it is cancelled before the sell goes out.
        await venue.risk.place_order(OrderRequest("BTC/USDT", "sell", "market", D("0.005"),
                                                  turn="t2"))
        assert binance.orders[int(first.order_id or 0)]["status"] == "CANCELED"
        await venue.match_resting_orders()
        [again] = await venue.protection.live()
        assert again.client_order_id != first.client_order_id
        placed = binance.orders[int(again.order_id or 0)]
        assert (placed["type"], placed["origQty"], placed["stopPrice"]) == (
            "STOP_LOSS_LIMIT", "0.015", "16500")
        binance.set_price("16480")
        await venue.match_resting_orders()
        [trade] = await venue.books.trades()
        assert (trade.exit_reason, trade.exited) == ("stop_loss", D("0.02"))


async def test_an_entry_filled_in_parts_has_its_stop_grow_with_it(
        ccxt_config: CcxtExchangeConfig, binance: FakeBinance, database: Path,
        sleep: RecordingSleep) -> None:
    binance.set_balance("BTC", "0")
    async with _venue(ccxt_config, database, sleep) as venue:
        assert venue.risk is not None and venue.protection is not None
        request = OrderRequest("BTC/USDT", "buy", "limit", D("0.02"), D("16600"), turn="t1")
        await venue.protection.attach(request, D("16500"), None)
        entry = await venue.risk.place_order(request)
        await venue.protection.step()
        [waiting] = await venue.protection.live()
        assert (waiting.status, waiting.order_id) == ("pending", None)

        binance.fill_part(int(entry.id), "0.01")
        await venue.match_resting_orders()
        [first] = await venue.protection.live()
        assert (first.status, first.amount) == ("active", D("0.01"))
        assert binance.orders[int(first.order_id or 0)]["origQty"] == "0.01"

        binance.fill(int(entry.id))
        await venue.match_resting_orders()
        [grown] = await venue.protection.live()
        assert grown.amount == D("0.02") and grown.client_order_id != first.client_order_id
        assert binance.orders[int(first.order_id or 0)]["status"] == "CANCELED"
        assert binance.orders[int(grown.order_id or 0)]["origQty"] == "0.02"

        binance.set_price("16450")
        await venue.match_resting_orders()
        [trade] = await venue.books.trades()
        assert (trade.amount, trade.exited, trade.exit_price, trade.exit_reason) == (
            D("0.02"), D("0.02"), D("16450"), "stop_loss")
        assert binance.balance("BTC") == (D(0), D(0))


async def test_a_stop_the_exchange_dropped_is_watched_by_the_daemon_and_said_so(
        ccxt_config: CcxtExchangeConfig, binance: FakeBinance, database: Path,
        sleep: RecordingSleep) -> None:
    async with _venue(ccxt_config, database, sleep) as venue:
        assert venue.protection is not None
        told: list[ProtectionEvent] = []
        venue.protection.on_event = told.append
        await _enter(venue, target="17500")
        stop, _ = await venue.protection.live()
        binance.expire(int(stop.order_id or 0))  # the exchange lets it go
        await venue.match_resting_orders()
        [event] = told
        assert event.what == "lost"
        assert event.text == ("alpha: binance expired the BTC/USDT stop-loss at 16,500.00; the "
                              "daemon watches the price instead, and this protection stops "
                              "when the daemon does.")
        watched, _ = await venue.protection.live()
        assert (watched.kind, watched.held) == ("stop_loss", "daemon")
        binance.set_price("16480")
        await venue.match_resting_orders()
        [trade] = await venue.books.trades()
        assert (trade.exit_price, trade.exit_reason) == (D("16480"), "stop_loss")
        sent = _posted(binance)[-1]
        assert (sent["type"], sent["newClientOrderId"]) == ("MARKET", watched.client_order_id)
