"""CcxtExchange against a fake Binance on loopback, through ccxt's real HTTP and parsing code."""

from __future__ import annotations

import decimal
import logging
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from pydantic import ValidationError

from trading_agent.errors import (
    ConfigError,
    ExchangeUnavailableError,
    OrderRejectedError,
)
from trading_agent.store.order_journal import SqliteOrderJournal
from trading_agent.trading.ccxt_exchange import CcxtExchange
from trading_agent.trading.config import CcxtExchangeConfig
from trading_agent.trading.exchange import OrderRequest
from trading_agent.trading.formatting import format_amount, format_percent, format_price
from trading_agent.trading.order_journal import OrderJournal

from .binance_server import FakeBinance
from .conftest import API_KEY, ENVIRON, SECRET, RecordingSleep

ORDER = "/api/v3/order"
TICKER = "/api/v3/ticker/24hr"


def limit_buy(amount: str = "0.01", price: str = "16000") -> OrderRequest:
    return OrderRequest("BTC/USDT", "buy", "limit", Decimal(amount), Decimal(price))


# -- reads -------------------------------------------------------------------------------

async def test_markets_are_loaded_once_with_their_precision(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    markets = await exchange.markets()
    await exchange.fetch_ticker("BTC/USDT")
    await exchange.markets()

    assert set(markets) == {"BTC/USDT", "ETH/USDT"}
    btc = markets["BTC/USDT"]
    assert (btc.base, btc.quote) == ("BTC", "USDT")
    assert btc.amount_step == Decimal("0.00001")
    assert btc.price_step == Decimal("0.01")
    assert btc.min_notional == Decimal("5")
    assert binance.count("GET", "/api/v3/exchangeInfo") == 1


async def test_ticker_is_parsed_into_decimals(exchange: CcxtExchange) -> None:
    ticker = await exchange.fetch_ticker("BTC/USDT")

    assert ticker.last == Decimal("16709.9")
    assert (ticker.bid, ticker.ask) == (Decimal("16709.8"), Decimal("16709.9"))
    assert ticker.change_24h == Decimal("0.0152")
    assert ticker.volume_24h == Decimal("205547.947")


async def test_candles_come_oldest_first(exchange: CcxtExchange, binance: FakeBinance) -> None:
    candles = await exchange.fetch_candles("BTC/USDT", "5m", limit=3)

    assert [c.close for c in candles] == [Decimal("16707.5"), Decimal("16704.1"),
                                          Decimal("16709.9")]
    assert candles[0].opened_at.isoformat() == "2023-01-02T16:50:00+00:00"
    assert candles[-1].volume == Decimal("800.432")
    klines = next(r for r in binance.requests if r.path == "/api/v3/klines")
    assert klines.params["interval"] == "5m"
    assert klines.params["limit"] == "3"


async def test_order_book_and_balances(exchange: CcxtExchange) -> None:
    book = await exchange.fetch_order_book("BTC/USDT", 2)
    balances = await exchange.fetch_balances()
    positions = await exchange.fetch_positions(["BTC/USDT"])

    assert book.bids[0] == (Decimal("16709.8"), Decimal("1.5"))
    assert len(book.asks) == 2
    assert set(balances) == {"BTC", "USDT"}  # ETH is zero
    assert balances["USDT"].used == Decimal("500")
    assert [(p.symbol, p.amount) for p in positions] == [("BTC/USDT", Decimal("0.5"))]


async def test_an_unknown_symbol_is_refused_before_any_request(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    before = len(binance.requests)

    with pytest.raises(OrderRejectedError, match="no market DOGE/USDT"):
        await exchange.fetch_ticker("DOGE/USDT")
    assert len(binance.requests) == before


# -- orders ------------------------------------------------------------------------------

async def test_create_fetch_and_cancel_a_limit_order(
        exchange: CcxtExchange, binance: FakeBinance, journal: OrderJournal) -> None:
    request = limit_buy()

    placed = await exchange.create_order(request)
    fetched = await exchange.fetch_order(placed.id, "BTC/USDT")
    open_orders = await exchange.fetch_open_orders()
    canceled = await exchange.cancel_order(placed.id, "BTC/USDT")

    sent = next(r for r in binance.requests if r.method == "POST")
    assert sent.params["newClientOrderId"] == request.client_order_id
    assert sent.params["quantity"] == "0.01"
    assert sent.params["price"] == "16000"
    assert sent.api_key == API_KEY
    assert placed.status == "open" and placed.client_order_id == request.client_order_id
    assert fetched.id == placed.id and fetched.price == Decimal("16000")
    assert [o.id for o in open_orders] == [placed.id]
    assert canceled.status == "canceled"
    intent = await journal.get(request.client_order_id)
    assert intent is not None and intent.state == "placed"
    assert intent.exchange_order_id == placed.id


async def test_orders_leave_the_daemons_decimal_context_as_it_was(
        exchange: CcxtExchange) -> None:
    """ccxt's precision helpers set half-up rounding and an underflow trap on the context
    they run in; the daemon's own context keeps half-to-even, so amounts read the same
    before and after the first order (and a backtest's requests match their recording)."""
    before = decimal.getcontext().copy()
    placed = await exchange.create_order(limit_buy())
    await exchange.cancel_order(placed.id, "BTC/USDT")
    await exchange.create_order(OrderRequest("BTC/USDT", "buy", "market", Decimal("0.01")))

    after = decimal.getcontext()
    assert (after.rounding, after.traps) == (before.rounding, before.traps)
    assert after.rounding == decimal.ROUND_HALF_EVEN
    assert format_amount(Decimal("338570.505"), "BTC") == "338,570.50 BTC"


async def test_a_market_order_reports_its_fill_and_fee(exchange: CcxtExchange) -> None:
    order = await exchange.create_order(
        OrderRequest("BTC/USDT", "buy", "market", Decimal("0.01")))

    assert order.status == "closed"
    assert order.filled == Decimal("0.01")
    assert order.average == Decimal("16709.9")
    assert order.fee == Decimal("0.167099") and order.fee_currency == "USDT"


async def test_the_account_moves_with_every_fill_and_reserves_for_resting_orders(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    async def held(currency: str) -> tuple[Decimal, Decimal]:
        balance = (await exchange.fetch_balances())[currency]
        return balance.free, balance.used

    assert await held("BTC") == (Decimal("0.5"), 0)
    assert await held("USDT") == (Decimal("9500"), Decimal("500"))

    bought = await exchange.create_order(
        OrderRequest("BTC/USDT", "buy", "market", Decimal("0.01")))
    # 0.01 BTC at 16,709.9 = 167.099 USDT, and the 0.1 % commission 0.167099 USDT.
    assert bought.fee == Decimal("0.167099")
    assert await held("BTC") == (Decimal("0.51"), 0)
    assert await held("USDT") == (Decimal("9332.733901"), Decimal("500"))

    sold = await exchange.create_order(
        OrderRequest("BTC/USDT", "sell", "market", Decimal("0.02")))
    assert sold.status == "closed"
    assert await held("BTC") == (Decimal("0.49"), 0)
    assert await held("USDT") == (Decimal("9332.733901") + Decimal("334.198")
                                  - Decimal("0.334198"), Decimal("500"))

    free_usdt = (await held("USDT"))[0]
    resting = await exchange.create_order(limit_buy("0.01", "16000"))  # locks 160 USDT
    selling = await exchange.create_order(
        OrderRequest("BTC/USDT", "sell", "limit", Decimal("0.1"), Decimal("18000")))
    assert await held("USDT") == (free_usdt - 160, Decimal("660"))
    assert await held("BTC") == (Decimal("0.39"), Decimal("0.1"))

    binance.fill(int(resting.id))  # 160 USDT spent, 0.16 USDT commission, 0.01 BTC in
    await exchange.cancel_order(selling.id, "BTC/USDT")  # the 0.1 BTC is free again
    assert await held("USDT") == (free_usdt - Decimal("160.16"), Decimal("500"))
    assert await held("BTC") == (Decimal("0.5"), 0)

    with pytest.raises(OrderRejectedError, match="insufficient funds"):
        await exchange.create_order(
            OrderRequest("BTC/USDT", "sell", "market", Decimal("0.6")))
    with pytest.raises(OrderRejectedError, match="insufficient funds"):
        await exchange.create_order(limit_buy("1", "16000"))  # 16,000 USDT: not there
    assert await held("BTC") == (Decimal("0.5"), 0)  # nothing moved
    assert await held("USDT") == (free_usdt - Decimal("160.16"), Decimal("500"))


async def test_the_intent_is_journaled_before_the_request_is_sent(
        exchange: CcxtExchange, binance: FakeBinance, journal: OrderJournal) -> None:
    request = limit_buy()
    seen_states: list[str | None] = []
    original = binance._create_order

    def spy(params: dict[str, str]) -> tuple[int, object]:
        # Runs inside the server while the request is in flight.
        import sqlite3

        with sqlite3.connect(journal._database.path) as connection:
            row = connection.execute("SELECT state FROM order_intents WHERE client_order_id = ?",
                                     (params["newClientOrderId"],)).fetchone()
        connection.close()
        seen_states.append(None if row is None else row[0])
        return original(params)

    binance._create_order = spy  # type: ignore[method-assign]
    await exchange.create_order(request)

    assert seen_states == ["sending"]


async def test_a_timeout_on_create_is_answered_by_a_lookup_not_a_second_order(
        exchange: CcxtExchange, binance: FakeBinance, journal: OrderJournal,
        sleep: RecordingSleep) -> None:
    binance.fail("POST", ORDER, "hang_after_processing")
    request = limit_buy()

    order = await exchange.create_order(request)

    assert binance.count("POST", ORDER) == 1
    lookups = [r for r in binance.requests if r.method == "GET" and r.path == ORDER]
    assert [r.params.get("origClientOrderId") for r in lookups] == [request.client_order_id]
    assert order.client_order_id == request.client_order_id
    assert order.status == "open"
    assert sleep.delays == [0.5]
    intent = await journal.get(request.client_order_id)
    assert intent is not None and intent.state == "placed"


async def test_a_lost_order_is_reported_unknown_and_never_resent(
        exchange: CcxtExchange, binance: FakeBinance, journal: OrderJournal) -> None:
    binance.fail("POST", ORDER, "hang")  # the exchange never got it
    request = limit_buy()

    with pytest.raises(ExchangeUnavailableError, match="NOT sent again"):
        await exchange.create_order(request)
    # Trying the same client order id again looks it up instead of sending it.
    with pytest.raises(OrderRejectedError, match="never sent twice"):
        await exchange.create_order(request)

    assert binance.count("POST", ORDER) == 1
    assert binance.count("GET", ORDER) == 3  # two lookups, then one more on the retry
    intent = await journal.get(request.client_order_id)
    assert intent is not None and intent.state == "unknown"


async def test_reusing_a_placed_client_order_id_returns_the_order(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    request = limit_buy()
    first = await exchange.create_order(request)

    again = await exchange.create_order(request)

    assert again.id == first.id
    assert binance.count("POST", ORDER) == 1


async def test_after_a_restart_lost_answers_are_reconciled(
        ccxt_config: CcxtExchangeConfig, database: Path, binance: FakeBinance,
        sleep: RecordingSleep) -> None:
    journal = await SqliteOrderJournal.open(database)
    exchange = await CcxtExchange.open(ccxt_config, allow_orders=True, journal=journal,
                                       environ=ENVIRON, sleep=sleep)
    request = limit_buy()
    binance.fail("POST", ORDER, "hang_after_processing")
    binance.fail("GET", ORDER, "bad_gateway", "bad_gateway")  # both lookups fail too
    try:
        with pytest.raises(ExchangeUnavailableError, match="NOT sent again"):
            await exchange.create_order(request)
    finally:
        await exchange.close()
        await journal.close()

    journal = await SqliteOrderJournal.open(database)
    reopened = await CcxtExchange.open(ccxt_config, allow_orders=True, journal=journal,
                                       environ=ENVIRON, sleep=sleep)
    try:
        intent = await journal.get(request.client_order_id)
    finally:
        await reopened.close()
        await journal.close()

    assert intent is not None and intent.state == "placed"
    assert binance.count("POST", ORDER) == 1


# -- errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("faults", [
    pytest.param(("disconnect", "disconnect"), id="network-error"),
    pytest.param(("hang",), id="timeout"),
    pytest.param(("rate_limit",), id="RateLimitExceeded"),
    pytest.param(("ddos_protection",), id="DDoSProtection"),
])
async def test_transient_read_failures_are_retried_with_backoff(
        exchange: CcxtExchange, binance: FakeBinance, sleep: RecordingSleep,
        faults: tuple[str, ...]) -> None:
    binance.fail("GET", TICKER, *faults)

    ticker = await exchange.fetch_ticker("BTC/USDT")

    assert ticker.last == Decimal("16709.9")
    assert binance.count("GET", TICKER) == len(faults) + 1
    assert sleep.delays == [0.5]


@pytest.mark.parametrize(("fault", "wording"), [
    ("disconnect", "unreachable"),
    ("hang", "timed out"),
    ("rate_limit", "rate limit exceeded"),
    ("ddos_protection", "DDoS protection"),
])
async def test_persistent_read_failures_become_exchange_unavailable(
        exchange: CcxtExchange, binance: FakeBinance, sleep: RecordingSleep,
        fault: str, wording: str) -> None:
    # aiohttp itself retries a dropped keep-alive connection once, so drops come in pairs.
    binance.fail("GET", TICKER, *[fault] * (6 if fault == "disconnect" else 3))

    with pytest.raises(ExchangeUnavailableError, match=wording) as caught:
        await exchange.fetch_ticker("BTC/USDT")

    assert "after 3 attempts" in str(caught.value)
    assert sleep.delays == [0.5, 1.0]
    assert not type(caught.value).__module__.startswith("ccxt")
    assert type(caught.value.__cause__).__module__.startswith("ccxt")


@pytest.mark.parametrize(("fault", "wording"), [
    ("insufficient_funds",
     "insufficient funds: Account has insufficient balance for requested action."),
    ("invalid_order", "invalid order: Filter failure: LOT_SIZE"),
    ("bad_symbol", "unknown symbol: Invalid symbol."),
])
async def test_refused_orders_become_readable_rejections(
        exchange: CcxtExchange, binance: FakeBinance, journal: OrderJournal,
        sleep: RecordingSleep, fault: str, wording: str) -> None:
    binance.fail("POST", ORDER, fault)
    request = limit_buy()

    with pytest.raises(OrderRejectedError) as caught:
        await exchange.create_order(request)

    assert str(caught.value) == (f"binance refused create limit buy 0.01 BTC/USDT @ 16000: "
                                 f"{wording}")
    assert binance.count("POST", ORDER) == 1
    assert sleep.delays == []
    intent = await journal.get(request.client_order_id)
    assert intent is not None and intent.state == "rejected"


async def test_canceling_a_filled_order_is_a_readable_rejection(
        exchange: CcxtExchange) -> None:
    order = await exchange.create_order(
        OrderRequest("BTC/USDT", "buy", "market", Decimal("0.01")))

    with pytest.raises(OrderRejectedError, match="no such order"):
        await exchange.cancel_order(order.id, "BTC/USDT")


# -- secrets and modes -------------------------------------------------------------------

async def test_secrets_never_appear_in_errors_or_reprs(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    binance.fail("GET", "/api/v3/account", "bad_gateway", "bad_gateway", "bad_gateway")

    with pytest.raises(ExchangeUnavailableError) as caught:
        await exchange.fetch_balances()

    for text in (str(caught.value), repr(caught.value), repr(exchange)):
        assert API_KEY not in text and SECRET not in text
        assert "signature=" not in text
    assert exchange.scrub(f"key {API_KEY} secret {SECRET}") == "key *** secret ***"


async def test_secrets_never_appear_in_ccxt_debug_logs(
        exchange: CcxtExchange, binance: FakeBinance, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="ccxt"):
        await exchange.fetch_balances()

    assert binance.requests[-1].api_key == API_KEY  # the request did carry the key
    assert "X-MBX-APIKEY" in caplog.text  # ccxt logged the headers...
    assert API_KEY not in caplog.text and SECRET not in caplog.text  # ...without the key


async def test_a_market_data_exchange_refuses_orders_and_reads_no_credentials(
        ccxt_config: CcxtExchangeConfig, binance: FakeBinance) -> None:
    exchange = await CcxtExchange.open(ccxt_config, environ={})
    try:
        ticker = await exchange.fetch_ticker("BTC/USDT")
        with pytest.raises(ConfigError, match='mode = "live"'):
            await exchange.create_order(limit_buy())
    finally:
        await exchange.close()

    assert ticker.last == Decimal("16709.9")
    assert binance.count("POST", ORDER) == 0


async def test_live_orders_need_the_credential_variables(
        ccxt_config: CcxtExchangeConfig, journal: OrderJournal) -> None:
    with pytest.raises(ConfigError, match="FAKE_BINANCE_SECRET is not set") as caught:
        CcxtExchange(ccxt_config, allow_orders=True, journal=journal,
                     environ={"FAKE_BINANCE_KEY": API_KEY})

    assert API_KEY not in str(caught.value)


def test_an_unknown_exchange_id_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no exchange 'nosuchexchange'"):
        CcxtExchange(CcxtExchangeConfig(exchange_id="nosuchexchange"))


async def test_sandbox_mode_uses_the_testnet_urls() -> None:
    exchange = CcxtExchange(CcxtExchangeConfig(exchange_id="binance", sandbox=True,
                                               client_settings={"timeout_on_exit": 0}))
    try:
        assert "testnet" in exchange._client.urls["api"]["public"]
        assert exchange.name == "binance testnet"
    finally:
        await exchange.close()


def test_verbose_is_refused_and_forced_off() -> None:
    # ccxt's verbose mode prints each request's headers, the API key among them, to stdout.
    with pytest.raises(ValidationError, match="verbose is not allowed"):
        CcxtExchangeConfig(client_settings={"verbose": True})
    config = CcxtExchangeConfig.model_construct(
        **{**CcxtExchangeConfig().model_dump(), "client_settings": {"verbose": True}})
    assert CcxtExchange(config)._client.verbose is False


async def test_the_amount_and_price_reach_the_exchange_as_given(
        exchange: CcxtExchange, binance: FakeBinance) -> None:
    order = await exchange.create_order(limit_buy("0.00123", "16000.5"))
    [placed] = binance.orders.values()
    assert (order.amount, order.price) == (Decimal("0.00123"), Decimal("16000.5"))
    assert Decimal(placed["origQty"]) == Decimal("0.00123")
    assert Decimal(placed["price"]) == Decimal("16000.5")


async def test_an_order_never_found_is_lost_after_ten_minutes(
        ccxt_config: CcxtExchangeConfig, database: Path, binance: FakeBinance,
        sleep: RecordingSleep) -> None:
    now = [datetime(2024, 1, 1, tzinfo=UTC)]
    journal = await SqliteOrderJournal.open(database)
    exchange = await CcxtExchange.open(ccxt_config, allow_orders=True, journal=journal,
                                       environ=ENVIRON, sleep=sleep, clock=lambda: now[0])
    try:
        binance.fail("POST", ORDER, "hang")  # the exchange never got it
        with pytest.raises(ExchangeUnavailableError):
            await exchange.create_order(limit_buy())
        await exchange.reconcile()
        still = len(await exchange.unresolved_orders())
        now[0] += timedelta(minutes=10)
        await exchange.reconcile()
        after = await exchange.unresolved_orders()
    finally:
        await exchange.close()
        await journal.close()
    assert still == 1 and after == []


def test_amounts_are_written_half_to_even_whatever_context_a_library_left() -> None:
    with decimal.localcontext() as context:
        context.rounding = decimal.ROUND_HALF_UP  # what ccxt leaves behind
        assert format_amount(Decimal("338570.505")) == "338,570.50"
        assert format_amount(Decimal("0.123456785")) == "0.12345678"
        assert format_price(Decimal("16751.125")) == "16,751.12"
        assert format_percent(Decimal("0.012345")) == "+1.23%"
