"""Each live desk's own books, through the real daemon and the operator commands, on one
Binance account (the ccxt stand-in :class:`~tests.trading.binance_server.FakeBinance`, whose
balances move with every fill).

The account already holds the user's own coins. Two desks trading it each see, risk-check
and flatten only what their own orders bought: the user's bitcoin and the other desk's are
neither counted against a desk's limits nor sold by it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_config import write_daemon_config
from tests.operator.command_line import run_cli
from tests.operator.harness import InProcessDaemon, in_process_daemon, uds_client
from tests.scripted_server import Reply, ScriptedServer, ToolCall
from tests.trading.binance_server import FakeBinance
from tests.trading.conftest import API_KEY, ENVIRON, SECRET
from tests.waiting import wait_until
from trading_agent.errors import RiskLimitError
from trading_agent.trading.exchange import OrderRequest

ORDER = "/api/v3/order"
LAST = Decimal("16709.9")
"""FakeBinance's last price: where its market orders fill."""

LIMITS = {"max_order_notional": "1000", "max_position_notional": "1500"}
"""Each desk's limits: 1,500 USDT held at most, far below the user's own 1 BTC (16,710)."""


@pytest.fixture
async def binance() -> AsyncIterator[FakeBinance]:
    """The account: the user's own 1 BTC and 10,000 USDT, nothing locked."""
    server = FakeBinance(API_KEY, SECRET)
    await server.start()
    server.set_balance("BTC", "1.00000000")
    server.set_balance("USDT", "10000.00000000")
    try:
        yield server
    finally:
        await server.stop()


def _live_desk(name: str, binance: FakeBinance) -> dict[str, Any]:
    """A live desk on the fake Binance (ccxt feed and orders) with :data:`LIMITS`."""
    return {
        "system_prompt": f"You are the trading desk {name}.",
        "tools": ["place_order", "get_positions", "list_open_orders"],
        "risk": LIMITS,
        "exchange": {"mode": "live", "feed": "ccxt", "ccxt": {
            "exchange_id": "binance", "api_key_env": "FAKE_BINANCE_KEY",
            "secret_env": "FAKE_BINANCE_SECRET", "api_urls": binance.api_urls(),
            "options": {"fetchMarkets": {"types": ["spot"]}, "fetchCurrencies": False,
                        "fetchMargins": False},
            "client_settings": {"timeout_on_exit": 0}, "timeout_seconds": 2,
            "enable_rate_limit": False}}}


def _daemon_config(state_dir: Path, model_url: str, binance: FakeBinance,
                   desks: tuple[str, ...], **tables: Any) -> Path:
    return write_daemon_config(state_dir, model_url,
                               desks={name: _live_desk(name, binance) for name in desks},
                               **tables)



async def _cli(running: InProcessDaemon, *args: str) -> tuple[int, str, str]:
    """Runs ``trading-agent ARGS`` against the daemon's socket; exit code, stdout, stderr."""
    return await run_cli(running.endpoints.socket_path, *args, within=60)


async def _json(running: InProcessDaemon, *args: str) -> Any:
    code, out, err = await _cli(running, *args, "--json")
    assert code == 0, err
    return json.loads(out)


async def _held(running: InProcessDaemon, desk: str) -> dict[str, str]:
    """``trading-agent positions DESK --json``: the amount of each position, by symbol."""
    [books] = await _json(running, "positions", desk)
    assert books["desk"] == desk and books["books"] is True
    return {p["symbol"]: p["amount"] for p in books["positions"]}


def _btc(binance: FakeBinance) -> Decimal:
    free, locked = binance.balance("BTC")
    return free + locked


def _orders_sent(binance: FakeBinance) -> list[Mapping[str, str]]:
    return [r.params for r in binance.requests if r.method == "POST" and r.path == ORDER]


def _market(side: str, amount: str) -> OrderRequest:
    return OrderRequest("BTC/USDT", side, "market", Decimal(amount),  # type: ignore[arg-type]
                        turn="turn-1")


async def test_two_desks_on_one_account_each_count_risk_check_and_flatten_only_their_own(
        binance: FakeBinance, scripted_server: ScriptedServer, state_dir: Path) -> None:
    sell_too_much = {"symbol": "BTC/USDT", "side": "sell", "type": "market", "amount": "0.055"}
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", sell_too_much)]),
                        Reply("I may not sell that much."))
    config = _daemon_config(state_dir, scripted_server.base_url, binance, ("alpha", "beta"))
    async with in_process_daemon(config, ENVIRON) as running:
        supervisor = running.daemon.supervisor
        alpha, beta = supervisor.runtime("alpha").risk, supervisor.runtime("beta").risk
        assert alpha is not None and beta is not None
        # Each buy passes its desk's 1,500 USDT position limit: the account's 1 BTC (the
        # user's) is no desk's position.
        bought_alpha = await alpha.place_order(_market("buy", "0.05"))
        bought_beta = await beta.place_order(_market("buy", "0.03"))
        assert (bought_alpha.status, bought_beta.status) == ("closed", "closed")
        assert _btc(binance) == Decimal("1.08")

        assert await _held(running, "alpha") == {"BTC/USDT": "0.05"}
        assert await _held(running, "beta") == {"BTC/USDT": "0.03"}
        code, out, err = await _cli(running, "positions")
        assert code == 0, err
        rows = [line.split()[:4] for line in out.splitlines()[1:]]
        assert rows == [["alpha", "BTC/USDT", "long", "0.05"],
                        ["beta", "BTC/USDT", "long", "0.03"]]

        # The model asks alpha to sell more than alpha bought: refused before any operator
        # is asked (a live order waits for approval) and before the exchange sees it.
        code, out, err = await _cli(running, "send", "alpha", "Sell 0.055 BTC.", "--wait",
                                    "--timeout", "30")
        assert code == 0, err
        assert out.strip() == "I may not sell that much."
        refusal = scripted_server.requests[1].messages[-1]
        assert refusal["role"] == "tool"
        assert refusal["content"] == (
            "Error: Refused (own_position): this desk holds 0.05 BTC of BTC/USDT itself, and "
            "may sell at most 0.05 BTC; the account holds 1.08 BTC, but what this desk did not "
            "buy is not its to sell.")
        assert len(_orders_sent(binance)) == 2  # the two buys only
        scripted_server.assert_complete()

        code, out, err = await _cli(running, "kill-switch", "on", "--desk", "alpha",
                                    "--flatten", "--reason", "closing alpha")
        assert code == 0, err
        flattened = [line.strip() for line in out.splitlines() if line.startswith("  ")]
        [sold] = [params for params in _orders_sent(binance)[2:]]
        assert flattened == [f"alpha: order {28_003} sell 0.05 BTC/USDT at market (closed)"]
        assert (sold["side"], sold["type"], sold["quantity"]) == ("SELL", "MARKET", "0.05")
        # What remains on the account: the user's 1 BTC and beta's 0.03.
        assert _btc(binance) == Decimal("1.03")
        assert await _held(running, "alpha") == {}
        assert await _held(running, "beta") == {"BTC/USDT": "0.03"}
        [trade] = (await _json(running, "trades", "alpha"))[0]["trades"]
        assert (trade["amount"], trade["exited"], trade["open"], trade["exit_reason"]) == (
            "0.05", "0.05", False, "flatten")


async def _approve_next(client: Any, seen: set[str]) -> dict[str, Any]:
    """Approves the next order waiting for an operator, as the API's approve button does."""
    async def waiting() -> list[dict[str, Any]]:
        pending = (await client.get("/api/approvals")).json()["approvals"]
        return [p for p in pending if p["id"] not in seen]

    [pending] = await wait_until(waiting, "an order waiting for approval")
    seen.add(pending["id"])
    response = await client.post(f"/api/approvals/{pending['id']}/approve",
                                 json={"operator": "ann"})
    assert response.status_code == 200, response.text
    return dict(pending)


def _tool_result(server: ScriptedServer, request: int) -> str:
    message = server.requests[request].messages[-1]
    assert message["role"] == "tool"
    return str(message["content"])


def _next_candle(binance: FakeBinance) -> None:
    """A new 5-minute candle closes on the exchange (same prices: no tick moves)."""
    last = binance.klines[-1]
    step = 5 * 60 * 1000
    binance.klines.append([last[0] + step, *last[1:6], last[6] + step, *last[7:]])


@pytest.mark.slow  # it waits for the live feed's next poll (every 10 s)
async def test_an_approved_live_order_and_a_resting_one_filled_later_reach_every_books_view(
        binance: FakeBinance, scripted_server: ScriptedServer, state_dir: Path) -> None:
    from playwright.async_api import expect

    from tests.operator.browser import CHROMIUM, open_page
    from trading_agent.operator.config import DEFAULT_TOKEN_ENV

    if CHROMIUM is None:
        pytest.skip("no chromium (scripts/ensure-test-tools.sh installs it)")
    buy = {"symbol": "BTC/USDT", "side": "buy", "type": "market", "amount": "0.05"}
    dip = {"symbol": "BTC/USDT", "side": "buy", "type": "limit", "amount": "0.01",
           "price": "16000"}
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", buy)]), Reply("Bought."),
                        Reply(tool_calls=[ToolCall("place_order", dip)]), Reply("Resting."))
    scripted_server.responder = lambda request: Reply("Noted.")  # any later turn
    token = "books-live-token-0123456789abcdef"
    config = _daemon_config(state_dir, scripted_server.base_url, binance, ("alpha",),
                            operator={"tcp_address": "127.0.0.1:0"})
    approved: set[str] = set()
    async with in_process_daemon(config, ENVIRON | {DEFAULT_TOKEN_ENV: token}) as running, \
            uds_client(running.endpoints.socket_path) as client:
        code, _, err = await _cli(running, "send", "alpha", "Buy 0.05 BTC.")
        assert code == 0, err
        pending = await _approve_next(client, approved)
        assert (pending["desk"], pending["tool"]) == ("alpha", "place_order")
        assert pending["reason"] == "the desk trades live"
        await wait_until(lambda: len(scripted_server.requests) >= 2, "the order's result")
        assert _tool_result(scripted_server, 1).startswith(
            "Order 28001 filled: bought 0.05 BTC on BTC/USDT")
        [sent] = _orders_sent(binance)
        assert (sent["side"], sent["type"], sent["quantity"]) == ("BUY", "MARKET", "0.05")
        assert _btc(binance) == Decimal("1.05")

        fee = Decimal("0.05") * LAST * Decimal("0.001")  # FakeBinance's 0.1 %, in USDT
        [books] = await _json(running, "positions", "alpha")
        [position] = books["positions"]
        assert (position["symbol"], position["side"], position["amount"],
                position["entry_price"], position["fees"]) == (
            "BTC/USDT", "long", "0.05", "16709.9", f"{fee.normalize():f}")
        code, out, err = await _cli(running, "positions", "alpha")
        assert code == 0, err
        assert out.splitlines()[1].split()[:5] == ["alpha", "BTC/USDT", "long", "0.05",
                                                   "16709.9"]
        [trades] = await _json(running, "trades", "alpha")
        [trade] = trades["trades"]
        assert (trade["side"], trade["amount"], trade["entry_price"], trade["open"]) == (
            "long", "0.05", "16709.9", True)
        assert trade["opened_turn"]  # the turn whose approved call placed it
        code, out, err = await _cli(running, "trades", "alpha")
        assert code == 0 and "open" in out.splitlines()[1], err
        [profit] = await _json(running, "profit", "alpha")
        assert profit["summary"]["realized_total"] == f"{-fee.normalize():f}"
        assert (profit["summary"]["open_trades"], profit["summary"]["fees_total"]) == (
            1, f"{fee.normalize():f}")
        [today] = profit["rows"]
        assert today["fills"] == 1
        code, out, err = await _cli(running, "profit", "alpha")
        assert code == 0 and out.splitlines()[1].split()[0] == "alpha", err

        url = running.endpoints.url
        assert url is not None
        async with open_page() as tab:
            page = tab.page
            await page.goto(f"{url}?desk=alpha#token={token}&operator=erin")
            await expect(page.locator("body")).to_have_attribute("data-live", "true")
            position_row = page.locator("#positions-table tbody tr[data-symbol='BTC/USDT']")
            await expect(position_row).to_contain_text("long")
            await expect(position_row).to_contain_text("0.05")
            await expect(position_row).to_contain_text("16709.9")
            await expect(page.locator("#trades-table tbody tr")).to_have_count(1)
            await expect(page.locator("#trades-table tbody tr")).to_contain_text("open")
            await expect(page.locator("#profit-table tbody tr")).to_have_count(1)

            # A limit buy below the market: approved, it rests (its USDT locked).
            code, _, err = await _cli(running, "send", "alpha", "Buy 0.01 BTC at 16,000.")
            assert code == 0, err
            await _approve_next(client, approved)
            await wait_until(lambda: len(scripted_server.requests) >= 4, "the limit order")
            assert _tool_result(scripted_server, 3).startswith(
                "Order 28002 placed and resting: buy limit 0.01 BTC on BTC/USDT")
            assert binance.balance("USDT")[1] == 160
            [orders] = await _json(running, "orders", "alpha")
            assert [(o["order_id"], o["status"], o["filled"]) for o in orders["orders"]] == [
                ("28002", "open", "0")]
            resting = page.locator("#orders-table tbody tr[data-order='28002']")
            await expect(resting).to_contain_text("16000")

            # It fills while nobody looks; the next candle's look counts it.
            binance.fill(28002)
            _next_candle(binance)

            async def counted() -> bool:
                return await _held(running, "alpha") == {"BTC/USDT": "0.06"}

            await wait_until(counted, "the filled limit order in alpha's books", within=40)
            await expect(position_row).to_contain_text("0.06")
            await expect(page.locator("#orders-table tbody")).to_contain_text("No open orders.")
        [orders] = await _json(running, "orders", "alpha")
        assert orders["orders"] == []
        [trades] = await _json(running, "trades", "alpha")
        [trade] = trades["trades"]
        assert (trade["amount"], trade["open"]) == ("0.06", True)
        [profit] = await _json(running, "profit", "alpha")
        assert profit["rows"][0]["fills"] == 2
        # The resting fill's fee too: an order lookup carries none on Binance, so it was read
        # from the order's executions (FakeBinance's 0.1 % of 160 USDT).
        resting_fee = Decimal("0.01") * 16000 * Decimal("0.001")
        assert profit["summary"]["fees_total"] == f"{(fee + resting_fee).normalize():f}"
        assert _btc(binance) == Decimal("1.06")
        assert len(_orders_sent(binance)) == 2  # nothing placed but the two approved orders


async def _status(client: Any, desk: str) -> dict[str, Any]:
    response = await client.get(f"/api/desks/{desk}")
    assert response.status_code == 200, response.text
    return dict(response.json())


async def test_each_desks_equity_and_daily_loss_are_its_own_not_the_accounts(
        binance: FakeBinance, scripted_server: ScriptedServer, state_dir: Path) -> None:
    desks = {name: _live_desk(name, binance) | {"risk": LIMITS | {"max_daily_loss": "30"}}
             for name in ("alpha", "beta")}
    config = write_daemon_config(state_dir, scripted_server.base_url, desks=desks)
    async with in_process_daemon(config, ENVIRON) as running, \
            uds_client(running.endpoints.socket_path) as client:
        supervisor = running.daemon.supervisor
        alpha, beta = supervisor.runtime("alpha").risk, supervisor.runtime("beta").risk
        assert alpha is not None and beta is not None
        await alpha.place_order(_market("buy", "0.05"))
        await beta.place_order(_market("buy", "0.03"))
        fee_alpha = Decimal("0.05") * LAST * Decimal("0.001")
        fee_beta = Decimal("0.03") * LAST * Decimal("0.001")
        # Each desk's equity is its own books': the fee it paid, not the account's
        # 26,700 USDT (the user's bitcoin and dollars, and the other desk's coins).
        assert (await _status(client, "alpha"))["equity"] == pytest.approx(float(-fee_alpha))
        assert (await _status(client, "beta"))["equity"] == pytest.approx(float(-fee_beta))

        # Bitcoin falls 709.9 USDT: the user's own coin loses 709.9, alpha 35.5, beta 21.3.
        binance.set_price("16000.00000000")
        drop = LAST - 16000
        with pytest.raises(RiskLimitError) as refused:
            await alpha.check(_market("buy", "0.001"))
        assert refused.value.limit == "max_daily_loss"
        loss_alpha = Decimal("0.05") * drop + fee_alpha
        assert str(refused.value) == (
            f"Refused: daily loss {loss_alpha:.2f} USDT since 00:00 UTC reached max_daily_loss "
            "30.00 USDT; new orders are halted until 00:00 UTC on "
            f"{(alpha.exchange.now().date() + timedelta(days=1)).isoformat()}.")
        # Beta's check reads beta's loss alone: neither alpha's nor the user's coins'.
        passed = await beta.check(_market("buy", "0.001"))
        assert passed.daily_loss == Decimal("0.03") * drop + fee_beta
        assert supervisor.kill_switch.halt_for("beta") is None
        assert supervisor.kill_switch.halt_for("alpha") is not None

        # The desks view, the equity chart and the metrics show the same figure.
        [alpha_row] = [d for d in await _json(running, "desks") if d["name"] == "alpha"]
        assert alpha_row["equity"] == pytest.approx(float(-loss_alpha))
        points = (await client.get("/api/desks/alpha/equity")).json()["points"]
        assert points[-1][1] == pytest.approx(float(-loss_alpha))
        metrics = (await client.get("/metrics")).text
        [line] = [m for m in metrics.splitlines()
                  if m.startswith('trading_agent_equity{desk="beta"}')]
        assert float(line.split()[-1]) == pytest.approx(float(-(Decimal("0.03") * drop
                                                                + fee_beta)))


def _notices(server: ScriptedServer) -> list[str]:
    """The reconciliation notices the desks read, as the model received them."""
    return [str(request.messages[-1]["content"]) for request in server.requests
            if str(request.messages[-1].get("content", "")).startswith(
                "[Notice from the daemon] On start")]


@pytest.mark.slow  # two daemon starts on the fake exchange
async def test_fills_made_while_the_daemon_was_down_are_the_desks_and_a_deposit_nobodys(
        binance: FakeBinance, scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = lambda request: Reply("Noted.")
    config = _daemon_config(state_dir, scripted_server.base_url, binance, ("alpha", "beta"))
    async with in_process_daemon(config, ENVIRON) as running:
        supervisor = running.daemon.supervisor
        alpha, beta = supervisor.runtime("alpha").risk, supervisor.runtime("beta").risk
        assert alpha is not None and beta is not None
        resting_alpha = await alpha.place_order(OrderRequest(
            "BTC/USDT", "buy", "limit", Decimal("0.01"), Decimal("16000"), turn="turn-1"))
        resting_beta = await beta.place_order(OrderRequest(
            "BTC/USDT", "buy", "limit", Decimal("0.02"), Decimal("16100"), turn="turn-2"))
        assert (resting_alpha.status, resting_beta.status) == ("open", "open")
    assert _notices(scripted_server) == []  # the first start saw the account as it was

    # While the daemon is down both orders fill, and the user deposits 500 USDT.
    binance.fill(int(resting_alpha.id))
    binance.fill(int(resting_beta.id))
    free, locked = binance.balance("USDT")
    binance.set_balance("USDT", f"{free + 500:f}", f"{locked:f}")

    async with in_process_daemon(config, ENVIRON) as running:
        # Counted on start, before any candle: each fill is its own desk's.
        assert await _held(running, "alpha") == {"BTC/USDT": "0.01"}
        assert await _held(running, "beta") == {"BTC/USDT": "0.02"}
        [notice] = await wait_until(lambda: _notices(scripted_server), "the notice")
    spent = (Decimal("0.01") * 16000 * Decimal("1.001")
             + Decimal("0.02") * 16100 * Decimal("1.001")).normalize()  # 482.482
    lines = [line for line in notice.splitlines() if line.startswith("- ")]
    # The bitcoin bought is explained by the desks' fills: no line. Of the dollars, only
    # the deposit is reported, and it is no desk's.
    assert lines == [
        f"- The USDT balance is {10500 - spent:f} (+{500 - spent:f}); it was 10000 "
        f"when last seen at {lines[0].split('last seen at ')[1][:16]} UTC. The desks' own "
        f"fills since then explain {-spent:f}; +500 USDT was moved by no desk (a deposit, a "
        "withdrawal or a trade by hand?), and it is assigned to no desk."]
    assert _btc(binance) == Decimal("1.03")


async def test_a_risk_journal_from_before_desk_equity_does_not_trip_the_daily_loss(
        binance: FakeBinance, scripted_server: ScriptedServer, state_dir: Path) -> None:
    from datetime import UTC, date, datetime

    from trading_agent.store.database import Database
    from trading_agent.store.risk_records import COMPONENT, MIGRATIONS, SqliteRiskRecords
    from trading_agent.store.store import database_path

    config = _daemon_config(state_dir, scripted_server.base_url, binance, ("alpha", "beta"))
    # The journal as an older daemon left it this morning: the day started on the account's
    # value (the user's bitcoin and dollars, 26,709.9 USDT), and beta halted for the day.
    today = datetime.now(UTC).date().isoformat()
    old = await Database.open(database_path(state_dir / "state"), MIGRATIONS[:1], COMPONENT)
    try:
        await old.write(lambda connection: connection.executemany(
            "INSERT INTO risk_days (desk, day, start_equity, halted) VALUES (?, ?, ?, ?)",
            [("alpha", today, "26709.9", None),
             ("beta", today, "26709.9", "daily loss 600.00 USDT since 00:00 UTC reached "
                                        "max_daily_loss 500.00 USDT")]))
    finally:
        await old.close()

    async with in_process_daemon(config, ENVIRON) as running:
        supervisor = running.daemon.supervisor
        alpha, beta = supervisor.runtime("alpha").risk, supervisor.runtime("beta").risk
        assert alpha is not None and beta is not None
        # Alpha's equity by its books (0: no fill yet) is not compared with the account's
        # value of this morning: the day starts again on the new basis, and alpha trades.
        bought = await alpha.place_order(_market("buy", "0.01"))
        assert bought.status == "closed"
        assert supervisor.kill_switch.halt_for("alpha") is None
        # A halt of the day stands.
        with pytest.raises(RiskLimitError, match=r"daily loss 600\.00 USDT") as refused:
            await beta.check(_market("buy", "0.01"))
        assert refused.value.limit == "max_daily_loss"
        # As kept: each day now starts from the desk's own equity, on the books' basis.
        records = await SqliteRiskRecords.open(database_path(state_dir / "state"))
        try:
            for desk, halted in (("alpha", None), ("beta", "daily loss 600.00 USDT")):
                _, days = await records.load(desk, datetime.now(UTC), date.fromisoformat(today))
                [day] = days.values()
                assert (day.start_equity, day.basis) == (0, "books")
                assert (day.halted or "").startswith(halted or "")
        finally:
            await records.close()


@pytest.mark.slow  # two daemon starts on the fake exchange
async def test_a_fill_the_desk_saw_in_its_balances_is_not_reported_on_the_next_start(
        binance: FakeBinance, scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = lambda request: Reply("Noted.")
    config = _daemon_config(state_dir, scripted_server.base_url, binance, ("alpha",))
    async with in_process_daemon(config, ENVIRON) as running:
        venue = running.daemon.venues["alpha"]
        assert venue.risk is not None
        resting = await venue.risk.place_order(OrderRequest(
            "BTC/USDT", "buy", "limit", Decimal("0.01"), Decimal("16000"), turn="turn-1"))
        binance.fill(int(resting.id))
        # The desk reads the account's balances (get_balance) before any look at its order:
        # its fill is counted first, so the balances noted as seen already show it.
        balances = await venue.exchange.fetch_balances()
        assert balances["BTC"].total == Decimal("1.01")
        assert await _held(running, "alpha") == {"BTC/USDT": "0.01"}

    async with in_process_daemon(config, ENVIRON) as running:
        code, out, err = await _cli(running, "send", "alpha", "Anything new?", "--wait",
                                    "--timeout", "30")
        assert code == 0 and out.strip() == "Noted.", err
    # Nothing changed since the balances were seen but by the desk's fill: no notice.
    assert _notices(scripted_server) == []
