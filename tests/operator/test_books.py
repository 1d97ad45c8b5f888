"""What operators see of each desk's own books: the API's positions, orders, trades and
profit, the commands ``positions``, ``orders``, ``trades``, ``profit`` and ``desks``, chat's
``/positions``... and the cancel of one order.

A desk without books is the test daemon's (:mod:`tests.operator.harness`): every view is
empty, every figure zero, and it says so. The desks with books are the real daemon's paper
desks, their books in the state file (``store.desk_books``), filled by really noting orders,
placing them through the desk's risk policy on its paper exchange and observing the
exchange's answers.
"""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path

import pytest

from tests.daemon_config import FAST_RESTARTS, write_daemon_config
from tests.operator.command_line import run_cli
from tests.operator.harness import (
    InProcessDaemon,
    build_control,
    in_process_daemon,
    running_api,
    uds_client,
)
from tests.operator.test_controls import paper_orders
from tests.scripted_server import ScriptedServer
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.cli import _Chat
from trading_agent.operator.client import OperatorClient
from trading_agent.operator.config import OperatorConfig
from trading_agent.trading.desk_books import DeskBooks
from trading_agent.trading.exchange import Order, OrderRequest
from trading_agent.trading.risk import RiskPolicy

ZERO_SUMMARY = {"realized_today": "0", "realized_total": "0", "unrealized": "0",
                "fees_total": "0", "trades_closed": 0, "wins": 0, "open_trades": 0,
                "win_rate": None}





# --------------------------------------------------------------------------- without books


async def test_a_desk_without_books_shows_empty_views_and_zero_profit(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url, ["alpha", "beta"])
    async with running_api(control, ApprovalBook(), OperatorConfig(), state_dir) as (
            endpoints, _), uds_client(endpoints.socket_path) as client:
        positions = (await client.get("/api/desks/alpha/positions")).json()
        assert positions == {"desk": "alpha", "books": False, "positions": [], "markets": []}
        orders = (await client.get("/api/desks/alpha/orders")).json()
        assert orders == {"desk": "alpha", "books": False, "orders": []}
        trades = (await client.get("/api/desks/beta/trades",
                                   params={"since": "2024-05-01", "open": "1"})).json()
        assert trades == {"desk": "beta", "books": False, "trades": []}
        profit = (await client.get("/api/desks/alpha/profit",
                                   params={"period": "weekly"})).json()
        assert profit == {"desk": "alpha", "books": False, "period": "weekly",
                          "summary": ZERO_SUMMARY, "rows": []}
        status = (await client.get("/api/desks/alpha")).json()
        assert (status["realized_today"], status["unrealized"]) == (None, None)

        cancel = await client.post("/api/desks/alpha/orders/123/cancel",
                                   json={"operator": "ann"})
        assert cancel.status_code == 409, cancel.text
        assert cancel.json()["error"]["code"] == "cannot_cancel"
        assert "keeps no books" in cancel.json()["error"]["message"]


async def test_the_books_routes_refuse_an_unknown_desk_and_a_bad_day(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url, ["alpha", "beta"])
    async with running_api(control, ApprovalBook(), OperatorConfig(), state_dir) as (
            endpoints, _), uds_client(endpoints.socket_path) as client:
        for path in ("positions", "orders", "trades", "profit"):
            response = await client.get(f"/api/desks/gamma/{path}")
            assert response.status_code == 404, path
            assert response.json()["error"]["message"] == \
                "no desk named 'gamma'; desks: alpha, beta"
        response = await client.post("/api/desks/gamma/orders/1/cancel", json={})
        assert response.status_code == 404
        for since in ("2024-13-01", "yesterday", "2024-5-1", "2024-05-01T00:00"):
            response = await client.get("/api/desks/alpha/trades", params={"since": since})
            assert response.status_code == 400, since
            assert "YYYY-MM-DD" in response.json()["error"]["message"]
        response = await client.get("/api/desks/alpha/profit", params={"period": "hourly"})
        assert response.status_code == 400
        assert "daily or weekly" in response.json()["error"]["message"]


async def test_the_books_commands_say_what_a_desk_without_books_holds_and_refuse_bad_input(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url, ["alpha", "beta"])
    async with running_api(control, ApprovalBook(), OperatorConfig(), state_dir) as (
            endpoints, _):
        socket = endpoints.socket_path
        code, out, err = await run_cli(socket, "positions")
        assert code == 0, err
        assert out.splitlines() == ["No open positions.", "alpha keeps no books.",
                                    "beta keeps no books."]
        code, out, _ = await run_cli(socket, "orders", "alpha")
        assert (code, out.splitlines()) == (0, ["No open orders.", "alpha keeps no books."])
        code, out, _ = await run_cli(socket, "trades", "beta", "--open")
        assert (code, out.splitlines()) == (0, ["No open trades.", "beta keeps no books."])
        code, out, _ = await run_cli(socket, "profit", "--weekly")
        header, alpha, beta, _, none, *notes = out.splitlines()
        assert code == 0
        assert header.split() == ["DESK", "REALIZED", "TODAY", "REALIZED", "UNREALIZED",
                                  "FEES", "CLOSED", "WON", "WIN", "RATE", "OPEN"]
        assert alpha.split() == ["alpha", "0.00", "0.00", "0.00", "0.00", "0", "0", "-", "0"]
        assert beta.split()[0] == "beta" and none == "No fills yet."
        assert notes == ["alpha keeps no books.", "beta keeps no books."]

        code, out, _ = await run_cli(socket, "profit", "alpha", "--json")
        assert code == 0
        assert json.loads(out) == [{"desk": "alpha", "books": False, "period": "daily",
                                    "summary": ZERO_SUMMARY, "rows": []}]

        code, out, err = await run_cli(socket, "trades", "gamma")
        assert (code, out) == (2, "")
        assert "no desk named 'gamma'; desks: alpha, beta" in err
        code, out, err = await run_cli(socket, "trades", "alpha", "--since", "05/01/2024")
        assert (code, out) == (2, "")
        assert "--since must be a date as YYYY-MM-DD" in err
        code, _, err = await run_cli(socket, "cancel-order", "alpha", "123")
        assert code == 2 and "keeps no books" in err

        code, out, _ = await run_cli(socket, "desks")
        header, *rows = out.splitlines()
        assert "REALIZED TODAY" in header and "UNREALIZED" in header
        column = header.index("REALIZED TODAY")
        assert rows[0][column:].split()[:2] == ["-", "-"]


async def test_chat_books_commands_on_a_desk_without_books(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url, ["alpha"])
    async with running_api(control, ApprovalBook(), OperatorConfig(), state_dir) as (
            endpoints, group), OperatorClient(socket_path=endpoints.socket_path) as client:
        out = io.StringIO()
        chat = _Chat(client, "alpha", "ann", out)
        for command in ("/positions", "/orders", "/trades --open", "/profit --weekly"):
            await chat.handle(command, group)
        await chat.handle("/trades --since", group)
        await chat.handle("/help", group)
        text = out.getvalue()
        assert "No open positions." in text and "No open orders." in text
        assert "No trades." in text
        assert "Realized today 0.00, all time 0.00; unrealized 0.00; fees 0.00; 0 trade(s) " \
               "closed, 0 won, 0 open" in text
        assert text.count("alpha keeps no books.") == 4
        assert "Usage: /trades [--open] [--since YYYY-MM-DD]" in text
        assert "/positions" in text.split("Usage:")[1]  # the help names them


# --------------------------------------------------------------------------- with books


@asynccontextmanager
async def _daemon_with_books(state_dir: Path, model_url: str, **environ: str
                             ) -> AsyncIterator[tuple[InProcessDaemon, DeskBooks, RiskPolicy]]:
    """The real daemon; alpha's books and risk policy as the daemon built them."""
    operator = {"tcp_address": "127.0.0.1:0"} if environ else None
    config = write_daemon_config(state_dir, model_url, daemon=FAST_RESTARTS,
                                 desks=("alpha", "beta"),
                                 **({"operator": operator} if operator else {}))
    async with in_process_daemon(config, environ) as running:
        runtime = running.daemon.supervisor.runtime("alpha")
        assert runtime.risk is not None and runtime.books is not None
        yield running, runtime.books, runtime.risk


async def _trade(books: DeskBooks, risk: RiskPolicy, side: str, kind: str, amount: str,
                 price: str | None = None, turn: str = "turn-1") -> Order:
    """Places an order through alpha's risk policy, as a desk's place_order does (its
    exchange notes it in the books before sending and counts the answer)."""
    request = OrderRequest("BTC/USDT", side, kind, Decimal(amount),  # type: ignore[arg-type]
                           Decimal(price) if price else None, turn=turn)
    return await risk.place_order(request)


def _text(value: Decimal) -> str:
    return "0" if value == 0 else format(value.normalize(), "f")


async def test_positions_orders_trades_and_profit_as_the_api_and_the_commands_show_them(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    async with _daemon_with_books(state_dir, scripted_server.base_url) as (
            running, books, risk), uds_client(running.endpoints.socket_path) as client:
        bought = await _trade(books, risk, "buy", "market", "0.02")
        sold = await _trade(books, risk, "sell", "market", "0.01", turn="turn-2")
        resting = await _trade(books, risk, "buy", "limit", "0.01", "10000", turn="turn-3")
        assert (bought.status, sold.status, resting.status) == ("closed", "closed", "open")

        positions = (await client.get("/api/desks/alpha/positions")).json()
        assert positions["books"] is True
        [held] = positions["positions"]
        assert (held["symbol"], held["side"], held["amount"]) == ("BTC/USDT", "long", "0.01")
        assert held["entry_price"] == _text(bought.average or Decimal(0))
        mark = (await risk.exchange.fetch_ticker("BTC/USDT")).last
        assert held["mark"] == _text(mark)
        assert Decimal(held["unrealized"]) == (mark - bought.average) * Decimal("0.01")  # type: ignore[operator]

        orders = (await client.get("/api/desks/alpha/orders")).json()["orders"]
        assert [(o["order_id"], o["side"], o["type"], o["amount"], o["price"], o["turn"])
                for o in orders] == [(resting.id, "buy", "limit", "0.01", "10000", "turn-3")]

        [trade] = (await client.get("/api/desks/alpha/trades")).json()["trades"]
        assert (trade["side"], trade["amount"], trade["exited"], trade["open"],
                trade["opened_turn"]) == ("long", "0.02", "0.01", True, "turn-1")
        assert trade["exit_price"] == _text(sold.average or Decimal(0))
        profit = (await client.get("/api/desks/alpha/profit")).json()
        assert profit["summary"]["realized_today"] == profit["summary"]["realized_total"] \
            == trade["profit"]
        [today] = profit["rows"]
        assert (today["realized"], today["fills"]) == (trade["profit"], 2)
        status = (await client.get("/api/desks/alpha")).json()
        assert status["realized_today"] == trade["profit"]

        socket = running.endpoints.socket_path
        code, out, _ = await run_cli(socket, "positions", "alpha")
        header, row = out.splitlines()
        assert code == 0 and header.split()[:4] == ["DESK", "SYMBOL", "SIDE", "AMOUNT"]
        assert row.split()[:4] == ["alpha", "BTC/USDT", "long", "0.01"]
        code, out, _ = await run_cli(socket, "orders")
        assert resting.id in out and "beta keeps no books." not in out.split(resting.id)[0]
        code, out, _ = await run_cli(socket, "trades", "--open", "--since", "2020-01-01")
        assert code == 0 and "open" in out.splitlines()[1]

        metrics = (await client.get("/metrics")).text
        assert 'trading_agent_position_amount{desk="alpha",symbol="BTC/USDT"} 0.01' in metrics
        assert 'trading_agent_realized_profit{desk="alpha",symbol="BTC/USDT"}' in metrics

        # The cancel button's request: that order, on the exchange; then no order is open.
        cancelled = await client.post(f"/api/desks/alpha/orders/{resting.id}/cancel",
                                      json={"operator": "ann"})
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["order"]["status"] == "canceled"
        assert [o["status"] for o in await paper_orders(state_dir, "alpha")
                if o["id"] == resting.id] == ["canceled"]
        assert (await client.get("/api/desks/alpha/orders")).json()["orders"] == []
        again = await client.post(f"/api/desks/alpha/orders/{resting.id}/cancel", json={})
        assert again.status_code == 404
        assert again.json()["error"]["message"] == (
            f"desk alpha has no open order {resting.id!r}; its open orders: none")


async def test_the_web_page_shows_the_books_and_cancels_an_order_once_confirmed(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    from playwright.async_api import expect

    from tests.operator.browser import CHROMIUM, open_page
    from trading_agent.operator.config import DEFAULT_TOKEN_ENV

    if CHROMIUM is None:
        pytest.skip("no chromium (scripts/ensure-test-tools.sh installs it)")
    token = "books-web-token-0123456789abcdef"
    async with _daemon_with_books(state_dir, scripted_server.base_url,
                                  **{DEFAULT_TOKEN_ENV: token}) as (running, books, risk):
        url = running.endpoints.url
        assert url is not None
        await _trade(books, risk, "buy", "market", "0.02")
        await _trade(books, risk, "sell", "market", "0.01", turn="turn-2")
        resting = await _trade(books, risk, "buy", "limit", "0.01", "10000", turn="turn-3")
        async with open_page() as tab:
            page = tab.page
            await page.goto(f"{url}?desk=alpha#token={token}&operator=erin")
            await expect(page.locator("body")).to_have_attribute("data-live", "true")
            position = page.locator("#positions-table tbody tr[data-symbol='BTC/USDT']")
            await expect(position).to_contain_text("long")
            await expect(position).to_contain_text("0.01")
            await expect(page.locator("#trades-table tbody tr")).to_have_count(1)
            await expect(page.locator("#trades-table tbody tr")).to_contain_text("open")
            await expect(page.locator("#profit-table tbody tr")).to_have_count(1)
            order = page.locator(f"#orders-table tbody tr[data-order='{resting.id}']")
            await expect(order).to_contain_text("10000")

            await order.locator("[data-action=cancel-order]").click()
            confirm = page.locator("#order-confirm")
            await expect(confirm).to_contain_text("Cancel buy limit 0.01 BTC/USDT @ 10000")
            await confirm.locator("[data-action=keep-order]").click()
            await expect(page.locator(".note", has_text="not confirmed")).to_be_visible()
            assert [o["status"] for o in await paper_orders(state_dir, "alpha")
                    if o["id"] == resting.id] == ["open"]

            await order.locator("[data-action=cancel-order]").click()
            await confirm.locator("[data-action=confirm-cancel-order]").click()
            await expect(page.locator(".note", has_text=f"✋ order {resting.id}")).to_contain_text(
                "canceled")
            await expect(page.locator("#orders-table tbody")).to_contain_text("No open orders.")
        assert [o["status"] for o in await paper_orders(state_dir, "alpha")
                if o["id"] == resting.id] == ["canceled"]
