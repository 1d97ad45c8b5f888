"""Reconciliation on start against the fake Binance: ccxt's real code reads the open orders
and balances, and what differs from the order journal is reported (never assumed away)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import anyio

from tests.daemon_config import write_daemon_config
from tests.scripted_server import Reply, ScriptedServer
from trading_agent.agent.events import Event
from trading_agent.app.services import open_daemon
from trading_agent.jsontext import json_text
from trading_agent.operator.events import ReconciliationReported
from trading_agent.settings import Settings, load_settings
from trading_agent.trading.books import BookFill, BookOrder, fill_from_order
from trading_agent.trading.ccxt_exchange import CcxtExchange
from trading_agent.trading.config import CcxtExchangeConfig
from trading_agent.trading.exchange import OrderRequest, new_client_order_id
from trading_agent.trading.order_journal import OrderJournal
from trading_agent.trading.reconciliation import reconcile

from .binance_server import FakeBinance
from .conftest import ENVIRON, RecordingSleep


def limit_buy(price: str = "15000") -> OrderRequest:
    return OrderRequest("BTC/USDT", "buy", "limit", Decimal("0.01"), Decimal(price))


async def test_nothing_is_reported_when_all_agrees(
        exchange: CcxtExchange, journal: OrderJournal, ccxt_config: CcxtExchangeConfig,
        sleep: RecordingSleep) -> None:
    first = await reconcile(exchange)  # a fresh journal: the balances are seen for the first time
    await exchange.create_order(limit_buy())  # resting, in the journal
    again = await reconcile(exchange, journal)
    restarted = await CcxtExchange.open(ccxt_config, allow_orders=True, journal=journal,
                                        environ=ENVIRON, sleep=sleep)
    try:
        after_restart = await reconcile(restarted)
    finally:
        await restarted.close()

    for report in (first, again, after_restart):
        assert report.differences == []
        assert report.adopted == []
        assert report.agrees
        assert report.notice() is None


async def test_an_order_placed_by_someone_else_is_reported_and_left_alone(
        exchange: CcxtExchange, journal: OrderJournal, binance: FakeBinance) -> None:
    binance.place_directly("web_8f2c1d0e4b", side="SELL", price="18000.00000000")

    report = await reconcile(exchange)

    assert report.differences == [
        "Order 28001 (client id web_8f2c1d0e4b) is open on binance but was not placed by "
        "this daemon: sell limit 0.01 BTC on BTC/USDT @ 18,000.00, open. It was left alone."]
    assert report.adopted == []
    assert await journal.get("web_8f2c1d0e4b") is None
    assert binance.count("DELETE", "/api/v3/order") == 0


async def test_an_unknown_order_with_our_prefix_is_adopted_into_the_journal(
        exchange: CcxtExchange, journal: OrderJournal, binance: FakeBinance) -> None:
    ours = new_client_order_id()  # an earlier run's order whose journal entry is gone
    binance.place_directly(ours)

    report = await reconcile(exchange)
    again = await reconcile(exchange)

    assert report.differences == [
        f"Order 28001 (client id {ours}) is open on binance but was not in the journal; its "
        "client id is ours, so it was adopted: buy limit 0.01 BTC on BTC/USDT @ 15,000.00, "
        "open."]
    assert [order.id for order in report.adopted] == ["28001"]
    intent = await journal.get(ours)
    assert intent is not None
    assert (intent.state, intent.exchange_order_id) == ("placed", "28001")
    assert intent.request == OrderRequest("BTC/USDT", "buy", "limit", Decimal("0.01"),
                                          Decimal("15000"), ours)
    assert again.agrees  # known from now on


async def test_a_journal_order_gone_from_the_book_is_looked_up_and_found_filled(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    order = await exchange.create_order(limit_buy())
    binance.fill(int(order.id))  # it filled while the daemon was away

    report = await reconcile(exchange)
    again = await reconcile(exchange)

    assert report.differences == [
        f"Order with client id {order.client_order_id} (buy limit 0.01 BTC on BTC/USDT @ "
        "15,000.00), which the journal has as open, is FILLED on binance: buy limit 0.01 BTC "
        "on BTC/USDT @ 15,000.00, closed, filled 0.01 at 15,000.00."]
    lookups = [r for r in binance.requests if r.method == "GET" and r.path == "/api/v3/order"]
    assert lookups[0].params["origClientOrderId"] == order.client_order_id
    assert again.agrees  # its status is noted: not looked up again


async def test_a_journal_order_the_exchange_does_not_know_is_unknown_never_cancelled(
        exchange: CcxtExchange, journal: OrderJournal, binance: FakeBinance) -> None:
    placed = await exchange.create_order(limit_buy())
    binance.forget(int(placed.id))
    in_flight = limit_buy("14000")
    await journal.record(in_flight, "binance", exchange.now())  # the daemon died sending it

    report = await reconcile(exchange)

    assert report.differences == [
        f"Order with client id {placed.client_order_id} (buy limit 0.01 BTC on BTC/USDT @ "
        "15,000.00), which the journal has as open, is not among the open orders on binance, "
        "and binance does not know it: its fate is unknown. It is NOT assumed cancelled.",
        f"Order with client id {in_flight.client_order_id} (buy limit 0.01 BTC on BTC/USDT @ "
        "14,000.00), which the journal has as sent with its answer lost, is not among the "
        "open orders on binance, and binance does not know it: its fate is unknown. It is "
        "NOT assumed cancelled."]
    placed_intent = await journal.get(placed.client_order_id)
    sent_intent = await journal.get(in_flight.client_order_id)
    assert placed_intent is not None and placed_intent.state == "placed"
    assert sent_intent is not None and sent_intent.state == "unknown"
    assert await journal.last_status(placed.client_order_id) == "open"  # not "canceled"


async def test_an_order_whose_answer_was_lost_and_is_on_the_book_is_recorded_placed(
        exchange: CcxtExchange, journal: OrderJournal, binance: FakeBinance) -> None:
    request = limit_buy()
    await journal.record(request, "binance", exchange.now())
    binance.place_directly(request.client_order_id)  # it arrived; the answer did not

    report = await reconcile(exchange)

    assert report.differences == [
        f"Order 28001 (client id {request.client_order_id}), which the journal has as sent "
        "with its answer lost, is open on binance: buy limit 0.01 BTC on BTC/USDT @ "
        "15,000.00, open. It is now recorded as placed."]
    intent = await journal.get(request.client_order_id)
    assert intent is not None and intent.state == "placed"


async def test_a_balance_change_since_last_seen_is_reported(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    await reconcile(exchange)
    binance.set_balance("USDT", "9000.00000000", "500.00000000")  # 500 USDT withdrawn
    binance.set_balance("ETH", "1.50000000")  # and some ETH deposited

    report = await reconcile(exchange)
    again = await reconcile(exchange)

    assert len(report.differences) == 2
    nobody = (r" No desk's fill made this change \(a deposit, a withdrawal or a trade by "
              r"hand\?\), and it is assigned to no desk\.")
    assert re.fullmatch(r"The ETH balance is 1\.5 \(\+1\.5\); it was 0 when last seen at "
                        r"\d{4}-\d\d-\d\d \d\d:\d\d UTC\." + nobody, report.differences[0])
    assert re.fullmatch(r"The USDT balance is 9500 \(-500\); it was 10000 when last seen at "
                        r"\d{4}-\d\d-\d\d \d\d:\d\d UTC\." + nobody, report.differences[1])
    assert again.agrees


async def test_what_the_desks_fills_moved_is_explained_and_only_the_rest_reported(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    await reconcile(exchange)
    # A desk's market buy (its balances move on FakeBinance), then 500 USDT deposited.
    order = await exchange.create_order(OrderRequest("BTC/USDT", "buy", "market",
                                                     Decimal("0.05")))
    noted = BookOrder(order.client_order_id, "BTC/USDT", "buy", "market", Decimal("0.05"),
                      None, "turn-1", exchange.now())
    fill = fill_from_order(noted, order, exchange.now())
    assert fill is not None
    free, locked = binance.balance("USDT")
    binance.set_balance("USDT", f"{free + 500:f}", f"{locked:f}")
    asked: list[datetime] = []

    async def fills_since(since: datetime) -> list[BookFill]:
        asked.append(since)
        return [fill]

    report = await reconcile(exchange, explained=fills_since)

    assert len(asked) == 1  # since the balances were last seen
    # BTC moved only by the desk's fill: no difference. USDT: the fill's cost and fee are
    # explained, the deposit is not.
    cost = Decimal("0.05") * Decimal("16709.9") * Decimal("1.001")
    [usdt] = report.differences
    assert usdt.startswith(f"The USDT balance is {10000 - cost + 500:f} ({500 - cost:+f}); "
                           "it was 10000 when last seen at ")
    assert usdt.endswith(f"UTC. The desks' own fills since then explain {-cost:f}; +500 USDT "
                         "was moved by no desk (a deposit, a withdrawal or a trade by hand?), "
                         "and it is assigned to no desk.")


async def test_balances_the_desk_read_count_as_seen(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    await reconcile(exchange)
    binance.set_balance("USDT", "9000.00000000", "500.00000000")
    await exchange.fetch_balances()  # the desk saw it (get_balances, a risk check)

    assert (await reconcile(exchange)).agrees


async def test_an_exchange_that_cannot_be_read_is_itself_reported(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    binance.fail("GET", "/api/v3/openOrders", "bad_gateway", "bad_gateway", "bad_gateway")

    report = await reconcile(exchange)

    assert len(report.differences) == 1
    assert report.differences[0].startswith("The open orders on binance could not be read (")
    assert report.differences[0].endswith("); they were not compared with the journal.")


async def test_the_notice_and_the_event_carry_every_difference(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    binance.place_directly("web_8f2c1d0e4b")
    ours = new_client_order_id()
    binance.place_directly(ours)

    report = await reconcile(exchange)
    event = ReconciliationReported(desk="alpha", exchange=report.exchange,
                                   differences=tuple(report.differences),
                                   adopted=tuple(order.id for order in report.adopted))

    notice = report.notice()
    assert notice is not None
    assert notice.startswith("[Notice from the daemon] On start, the orders and balances on "
                             "binance were compared with what the daemon last knew (")
    for line in report.differences:
        assert f"\n- {line}\n" in notice
    assert "an order of unknown fate is not assumed cancelled" in notice
    data = json.loads(json_text(event.to_dict()))
    assert data["type"] == "reconciliation"
    assert data["differences"] == report.differences
    assert data["adopted"] == ["28002"]


async def test_past_the_lookup_bound_the_rest_are_reported_unchecked(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    first = await exchange.create_order(limit_buy("15000"))
    second = await exchange.create_order(limit_buy("14000"))
    binance.fill(int(first.id))
    binance.fill(int(second.id))

    report = await reconcile(exchange, max_lookups=1)
    later = await reconcile(exchange, max_lookups=1)

    assert report.differences[0] == (
        f"Order with client id {second.client_order_id} (buy limit 0.01 BTC on BTC/USDT @ "
        "14,000.00), which the journal has as open, is not among the open orders on binance "
        "and was not looked up this time (more than 1 to check); its fate is unknown.")
    assert report.differences[1].startswith(
        f"Order with client id {first.client_order_id} (buy limit 0.01 BTC on BTC/USDT @ "
        "15,000.00), which the journal has as open, is FILLED on binance")
    assert len(later.differences) == 1 and "is FILLED on binance" in later.differences[0]
    assert binance.count("GET", "/api/v3/order") == 2


# --------------------------------------------------------------------------- through the daemon


def _live_daemon(folder: Path, base_url: str, binance: FakeBinance) -> Settings:
    """One live desk on the fake Binance (ccxt feed and orders), on the scripted model."""
    config = write_daemon_config(folder, base_url, desks={"alpha": {
        "system_prompt": "You are alpha.", "tools": ["list_open_orders"],
        "exchange": {"mode": "live", "feed": "ccxt", "ccxt": {
            "exchange_id": "binance", "api_key_env": "FAKE_BINANCE_KEY",
            "secret_env": "FAKE_BINANCE_SECRET", "api_urls": binance.api_urls(),
            "options": {"fetchMarkets": {"types": ["spot"]}, "fetchCurrencies": False,
                        "fetchMargins": False},
            "client_settings": {"timeout_on_exit": 0}, "timeout_seconds": 2,
            "enable_rate_limit": False}}}})
    return load_settings(config)


async def _run_once(settings: Settings,
                    until: Callable[[list[Event]], bool] | None = None) -> list[Event]:
    """Starts the daemon (its start publishes what it found), collects its events until
    ``until`` holds (10 s at most; at once without it), stops."""
    seen: list[Event] = []
    async with open_daemon(settings, environ=ENVIRON) as daemon, \
            anyio.create_task_group() as group:
        with daemon.event_bus.subscribe("test") as events:
            group.start_soon(daemon.store.events.persist_events, daemon.store_subscription)
            await group.start(daemon.supervisor.run)
            with anyio.fail_after(10):
                while (event := events.get_nowait()) is not None or until is not None:
                    if event is None:
                        event = await events.get()
                    seen.append(event)
                    if until is not None and until(seen):
                        break
        group.cancel_scope.cancel()
    return seen


async def test_a_restart_reports_what_changed_on_the_exchange_to_operators_and_the_desk(
        binance: FakeBinance, scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.responder = lambda request: Reply("Noted.")
    settings = _live_daemon(tmp_path, scripted_server.base_url, binance)
    # A first run sees the account as it is: nothing to report, no turn.
    first = await _run_once(settings)
    # While the daemon is down: an order of ours placed by hand, a stranger's, a deposit.
    binance.place_directly(new_client_order_id(), price="15100.00000000")
    binance.place_directly("web_8812", side="SELL", price="19000.00000000")
    binance.set_balance("USDT", "12000.00000000")

    events = await _run_once(settings, lambda seen: any(e.type == "turn_end" for e in seen))

    assert not any(isinstance(e, ReconciliationReported) for e in first)
    [report] = [e for e in events if isinstance(e, ReconciliationReported)]
    assert report.desk == "alpha" and len(report.adopted) == 1
    lines = "\n".join(report.differences)
    assert "web_8812" in lines and "It was left alone." in lines
    assert "was not in the journal; its client id" in lines  # ours: adopted
    assert "The USDT balance is 12000 (+2000)" in lines
    # The desk's next turn opens with the same differences.
    [turn] = [e for e in events if e.type == "turn_start"]
    notice = str(scripted_server.requests[-1].messages[-1]["content"])
    assert "web_8812" in notice and "USDT balance is 12000" in notice
    assert turn.desk == "alpha"
