"""The equity chart's figures: sampled at every fill as well as on the timer, ending at the
equity the desk's status (and the page's header) shows, and kept across a restart."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from playwright.async_api import expect

from tests.daemon_config import FAST_RESTARTS, write_daemon_config
from tests.operator.browser import needs_chromium, open_page
from tests.operator.harness import build_control, in_process_daemon, running_api, uds_client
from tests.operator.test_controls import OrderModel, tool_results_read
from tests.operator.test_web_page import HEADER_AND_CHART_AGREE
from tests.scripted_server import ScriptedServer
from trading_agent.agent.events import ToolResultReady
from trading_agent.daemon.events import OrderFilled
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.config import OperatorConfig

Points = list[list[float]]

_STILL_PRICES = {"replay": {"speed": 1}}
"""A replay at real time: no new candle (and so no new marks) while the test runs."""

_THREE_ORDERS = "market buy 0.01, market buy 0.02 and market sell 0.01"


async def _curve(client: httpx.AsyncClient, desk: str = "alpha") -> Points:
    response = await client.get(f"/api/desks/{desk}/equity")
    assert response.status_code == 200, response.text
    points: Points = response.json()["points"]
    return points


async def _curve_until(client: httpx.AsyncClient, done: Callable[[Points], bool],
                       what: str, desk: str = "alpha") -> Points:
    """A desk's equity curve once ``done`` holds for it (10 s at most)."""
    points: Points = []
    try:
        with anyio.fail_after(10):
            while not done(points := await _curve(client, desk)):  # noqa: ASYNC110
                await anyio.sleep(0.02)  # the curve is the daemon's state, asked over HTTP
    except TimeoutError:
        raise AssertionError(f"{desk}'s equity curve never showed {what}: {points}") from None
    return points


async def _status(client: httpx.AsyncClient, desk: str = "alpha") -> dict[str, Any]:
    response = await client.get(f"/api/desks/{desk}")
    assert response.status_code == 200, response.text
    status: dict[str, Any] = response.json()
    return status


def _fill(desk: str, order_id: str) -> OrderFilled:
    return OrderFilled(desk=desk, order_id=order_id, symbol="BTC/USDT", side="buy",
                       amount="0.01", price="64000", fee="0.64", fee_currency="USDT",
                       text=f"order {order_id} filled: buy 0.01 BTC on BTC/USDT at 64000")


def _placed(text: str, *, is_error: bool = False) -> ToolResultReady:
    return ToolResultReady(desk="alpha", call_id="c1", name="place_order", text=text,
                           is_error=is_error, image_count=0, duration=0.01)


async def _order_turn(client: httpx.AsyncClient, server: ScriptedServer, text: str) -> list[str]:
    """Sends desk alpha an operator message listing orders, waits for the end of its turn and
    returns the place_order results the model read in it."""
    before = len(tool_results_read(server))
    response = await client.post("/api/desks/alpha/messages",
                                 json={"text": text, "wait": True, "timeout": 10})
    assert response.status_code == 200, response.text
    assert response.json()["reply"]["ok"], response.json()
    return tool_results_read(server)[before:]


async def test_a_fill_is_sampled_at_once_and_the_curve_ends_at_the_status(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    config = OperatorConfig(equity_sample_seconds=3600)  # the timer samples at start only
    async with running_api(control, ApprovalBook(), config, state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        # The timer's first sample, then the status now.
        points = await _curve_until(client, lambda p: len(p) == 2, "the first sample")
        assert [p[1] for p in points] == [10_000.0, 10_000.0]

        # Marks move with no fill: the stored samples stay, the curve still ends at the status.
        control.desks["alpha"].equity = 10_004.5
        points = await _curve(client)
        assert [p[1] for p in points] == [10_000.0, 10_004.5]

        # A resting order filled on a candle: sampled at once, not in an hour.
        control.desks["alpha"].equity = 9_999.17
        control.event_bus.publish(_fill("alpha", "P1"))
        points = await _curve_until(client, lambda p: len(p) == 3, "the fill's sample")
        assert [p[1] for p in points] == [10_000.0, 9_999.17, 9_999.17]

        # A market order filled at once (its books announce it as any fill): sampled too.
        # Before it, place_order's answers of a resting order and a refusal, and another
        # desk's fill, which add no sample of alpha.
        control.desks["alpha"].equity = 9_998.5
        for event in (_placed("Order P2 placed and resting: buy limit 0.01 BTC on BTC/USDT"),
                      _placed("Error: Refused: order notional too large", is_error=True),
                      _fill("beta", "P3"),
                      _fill("alpha", "P4")):
            control.event_bus.publish(event)
        points = await _curve_until(client, lambda p: len(p) == 4, "the market fill's sample")
        assert [p[1] for p in points] == [10_000.0, 9_999.17, 9_998.5, 9_998.5]
        times = [p[0] for p in points]
        assert times == sorted(times)
        # beta's fill was sampled for beta.
        await _curve_until(client, lambda p: len(p) == 3, "its fill's sample", "beta")

        assert (await client.get("/api/desks/nobody/equity")).status_code == 404


async def test_after_fills_the_curve_ends_at_the_status_and_a_restart_keeps_it(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = OrderModel()
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS,
                                 exchange=_STILL_PRICES)
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        results = await _order_turn(client, scripted_server, _THREE_ORDERS)
        assert len(results) == 3 and all(" filled: " in r for r in results), results
        equity = (await _status(client))["equity"]
        assert 9_990 < equity < 10_000  # the fees paid on three fills
        # The last fill was sampled (the stored points, before the status's): the curve
        # ends with the status's figure twice.
        points = await _curve_until(
            client, lambda p: len(p) >= 3 and p[-2][1] == equity, "the last fill's sample")
        assert points[-1][1] == equity == (await _status(client))["equity"]
        assert points[0][1] == 10_000.0  # the first sample, before any order
        stored = points[:-1]

    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        points = await _curve(client)
        assert points[:len(stored)] == stored, \
            f"the history from before the restart is not all there: {stored} then {points}"
        assert points[-1][1] == (await _status(client))["equity"] == equity


@needs_chromium
@pytest.mark.slow
async def test_the_page_shows_the_same_equity_in_its_header_and_its_chart_after_fills(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = OrderModel()
    config = write_daemon_config(
        state_dir, scripted_server.base_url, daemon=FAST_RESTARTS, exchange=_STILL_PRICES,
        operator={"tcp_address": "127.0.0.1:0", "generate_token": True})
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client, open_page() as tab:
        page = tab.page
        token = running.endpoints.generated_token
        await page.goto(f"{running.endpoints.url}?desk=alpha#token={token}&operator=erin")
        await expect(page.locator("body")).to_have_attribute("data-live", "true")
        await expect(page.locator("#equity-caption")).to_have_text(
            "Equity 10,000.00  +0.00%  ·  range 10,000.00 – 10,000.00")

        results = await _order_turn(client, scripted_server, _THREE_ORDERS)
        assert len(results) == 3 and all(" filled: " in r for r in results), results
        equity = (await _status(client))["equity"]
        shown = f"{equity:,.2f}"
        assert shown != "10,000.00"
        # The header shows the desk's equity after the fills, and the chart ends there.
        await expect(page.locator("#desk-figures .figure:has(> dt:text-is('Equity')) > dd")) \
            .to_have_text(shown)
        assert await tab.wait_for(HEADER_AND_CHART_AGREE, "the same equity in the chart") \
            == shown
        caption = await page.locator("#equity-caption").text_content()
        assert caption is not None and caption.startswith(f"Equity {shown}  -0.")
        assert not tab.errors, tab.errors
