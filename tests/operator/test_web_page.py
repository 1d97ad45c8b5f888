"""The web page in headless Chromium (driven by Playwright): a message sent from the page
reaches a real daemon's desk and the answer streams in; approvals by button; the equity chart
ends at the figure the header shows."""

from __future__ import annotations

import os
import random
from pathlib import Path

import anyio
import httpx
import pytest
from playwright.async_api import expect

from tests.operator.browser import BrowserPage, needs_chromium, open_page
from tests.operator.daemon_process import running_daemon
from tests.operator.harness import LoopDeskControl, build_control, running_api
from tests.scripted_server import Reply, ScriptedServer, ToolCall
from tests.waiting import wait_until
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.config import OperatorConfig

TOKEN = "web-test-token-0123456789abcdef"

pytestmark = [needs_chromium, pytest.mark.slow]

HEADER_AND_CHART_AGREE = (
    "((figure) => figure && document.getElementById('equity-caption').textContent"
    ".startsWith(`Equity ${figure} `) && figure)([...document.querySelectorAll("
    "'#desk-figures .figure')].find((f) => f.querySelector('dt').textContent === 'Equity')"
    "?.querySelector('dd').textContent)")
"""The equity the header shows, once the chart's caption names the same figure."""


async def _wander(control: LoopDeskControl, stop: anyio.Event) -> None:
    """Moves the desks' equity a little, as marks to market would."""
    walk = random.Random(7)
    while not stop.is_set():
        for desk in control.desks.values():
            desk.equity = round(desk.equity * (1 + walk.gauss(0.0004, 0.003)), 2)
        await anyio.sleep(0.02)


async def _equity_points(url: str, desk: str, count: int) -> None:
    """Waits until the desk's equity chart has ``count`` samples."""
    async with httpx.AsyncClient(base_url=url, timeout=5,
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        async def enough() -> bool:
            answer = await client.get(f"/api/desks/{desk}/equity")
            return len(answer.json()["points"]) >= count
        await wait_until(enough, f"{count} equity samples of {desk}")


def _screenshot_dir(tmp_path: Path) -> Path:
    return Path(os.environ.get("OPERATOR_SCREENSHOT_DIR", str(tmp_path)))


async def _type(tab: BrowserPage, text: str) -> None:
    """Types a message into the composer and presses Enter, as a person sends one: once the
    page shows which desk it goes to (before that, Enter keeps the text in the box; on a busy
    machine the desks' list can come after the live stream)."""
    await expect(tab.page.locator(".desk-card.selected")).to_have_count(1)
    await tab.page.locator("#message").focus()
    await tab.page.keyboard.insert_text(text)
    await tab.page.keyboard.press("Enter")


async def test_a_message_from_the_page_reaches_the_desk_and_the_answer_streams(
        scripted_server: ScriptedServer, state_dir: Path, tmp_path: Path) -> None:
    scripted_server.add(Reply("Flat day so far: BTC holds 64,000 and I have no position. "
                              "Nothing to do until it breaks 64,500.", text_chunks=12,
                              chunk_delay=0.05))
    async with running_daemon(state_dir, scripted_server.base_url, token=TOKEN) as daemon:
        assert daemon.url is not None
        async with open_page() as tab:
            page = tab.page
            await page.goto(f"{daemon.url}?desk=alpha#token={TOKEN}&operator=erin")
            await expect(page.locator("body")).to_have_attribute("data-live", "true")
            await expect(page.locator(".desk-card")).to_have_count(2)
            await _type(tab, "Anything to do?")
            # Mid-stream, the page already shows part of the answer, and then all of it.
            await expect(page.locator(".entry.streaming .text").first).to_be_attached()
            await expect(page.locator("#log")).to_contain_text("until it breaks 64,500.",
                                                               use_inner_text=True)
            await expect(page.locator(".entry.streaming")).to_have_count(0)
            await expect(page.locator("#desk-state")).to_have_text("idle")
            shot = _screenshot_dir(tmp_path) / "operator-web-daemon.png"
            await page.screenshot(path=shot)
            # Opened again, the page shows the same exchange from the daemon's stored
            # transcript.
            await page.reload()
            await expect(page.locator("#log")).to_contain_text("until it breaks 64,500.",
                                                               use_inner_text=True)
            history = await page.locator("#log").inner_text()
            assert "owner" in history and "Anything to do?" in history
            assert "[Message from" not in history  # the marker the model reads is not shown
            assert not tab.errors, tab.errors
    sent = scripted_server.requests[0].messages[-1]["content"]
    assert sent == "[Message from owner, a human operator]\nAnything to do?"
    assert shot.stat().st_size > 10_000
    scripted_server.assert_complete()


async def test_the_page_approves_a_held_order(scripted_server: ScriptedServer,
                                                   state_dir: Path, tmp_path: Path) -> None:
    order = {"symbol": "BTC/USDT", "side": "buy", "amount": 0.05, "price": 64_000}
    scripted_server.add(
        Reply(tool_calls=[ToolCall("get_price", {"symbol": "BTC/USDT"})]),
        Reply("BTC trades at 64,000, up 1.2% on the day. The book is thin above 64,500, "
              "so I would add only on a pullback toward 63,400.", text_chunks=14,
              chunk_delay=0.04),
        Reply(tool_calls=[ToolCall("place_order", order)]),
        Reply("Bought 0.05 BTC at 64,000 (3,200.00 USDT); the stop sits at 62,900.",
              text_chunks=6, chunk_delay=0.03),
    )
    book_desks: dict[str, str] = {}
    book = ApprovalBook(timeout_seconds=120, is_live=lambda desk: book_desks.get(desk) == "live")
    control, gate = build_control(scripted_server.base_url, ("btc-momentum", "eth-carry",
                                                            "sol-scalper"), approvals=book)
    control.desks["btc-momentum"].mode = "live"
    book_desks["btc-momentum"] = "live"
    control.desks["eth-carry"].equity = 25_400.0
    control.desks["sol-scalper"].equity = 4_870.0
    config = OperatorConfig(tcp_address="127.0.0.1:0", equity_sample_seconds=0.05)
    shots = _screenshot_dir(tmp_path)
    stop = anyio.Event()
    async with running_api(control, book, config, state_dir, environ={
            "TRADING_AGENT_OPERATOR_TOKEN": TOKEN}) as (endpoints, group):
        group.start_soon(_wander, control, stop)
        assert endpoints.url is not None
        await _equity_points(endpoints.url, "btc-momentum", 30)  # a minute, compressed
        async with open_page() as tab:
            page = tab.page
            await page.goto(f"{endpoints.url}?desk=btc-momentum#token={TOKEN}&operator=dana")
            await expect(page.locator("body")).to_have_attribute("data-live", "true")
            await expect(page.locator(".desk-card")).to_have_count(3)
            assert await page.evaluate("location.hash") == ""  # the token left the URL

            await _type(tab, "How does BTC look?")
            await expect(page.locator("#log")).to_contain_text("pullback toward 63,400.",
                                                               use_inner_text=True)
            await expect(page.locator(".step-done").first).to_be_attached()
            log = await page.locator("#log").inner_text()
            assert "How does BTC look?" in log and "starts a turn" in log
            assert "get_price" in log and "BTC/USDT last 64000" in log

            await _type(tab, "Buy 0.05 BTC now.")
            await expect(page.locator(".approval")).to_have_count(1)
            assert gate.orders == []
            await page.locator(".approval-reason").fill("within today's budget")
            stop.set()
            await tab.wait_for(HEADER_AND_CHART_AGREE, "the chart to settle on the header's "
                                                       "equity")
            await page.evaluate("document.getElementById('log').scrollTop = 1e9")
            pending = shots / "operator-web-approval.png"
            await page.screenshot(path=pending)

            await page.locator(".approval button[data-action=approve]").click()
            await expect(page.locator("#log")).to_contain_text("the stop sits at 62,900",
                                                               use_inner_text=True)
            await expect(page.locator("#approvals")).to_be_hidden()
            await expect(page.locator(".entry.streaming")).to_have_count(0)
            await expect(page.locator("#desk-state")).to_have_text("idle")
            final = shots / "operator-web.png"
            await page.screenshot(path=final)
            # The chart ends at the equity the header shows.
            figure = await tab.wait_for(HEADER_AND_CHART_AGREE, "the header's equity in the "
                                                                "chart's caption")
            assert figure != "–"
            assert not tab.errors, tab.errors
    assert gate.orders == [{"symbol": "BTC/USDT", "side": "buy", "amount": 0.05,
                            "price": 64000.0}]
    sent = scripted_server.requests[0].messages[-1]["content"]
    assert sent == "[Message from owner, a human operator]\nHow does BTC look?"
    assert pending.stat().st_size > 10_000 and final.stat().st_size > 10_000
    print(f"screenshots: {pending} {final}")
    scripted_server.assert_complete()


async def test_a_viewer_sees_the_desk_but_no_control_its_role_lacks(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    order = {"symbol": "BTC/USDT", "side": "buy", "amount": 0.05, "price": 64_000}
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", order)]),
                        Reply("Not bought: the order was refused."))
    book = ApprovalBook(timeout_seconds=120, is_live=lambda desk: True)
    control, gate = build_control(scripted_server.base_url, ("alpha",), approvals=book)
    config = OperatorConfig.model_validate({
        "tcp_address": "127.0.0.1:0",
        "operators": [{"name": "vera", "role": "viewer", "token_env": "VIEWER_TOKEN"}]})
    viewer = "viewer-token-0123456789abcdef"
    async with running_api(control, book, config, state_dir, environ={
            "TRADING_AGENT_OPERATOR_TOKEN": TOKEN, "VIEWER_TOKEN": viewer}) as (endpoints, _):
        assert endpoints.url is not None
        async with httpx.AsyncClient(base_url=endpoints.url, timeout=5, headers={
                "Authorization": f"Bearer {TOKEN}"}) as owner:
            sent = await owner.post("/api/desks/alpha/messages", json={"text": "Buy 0.05 BTC."})
            assert sent.status_code == 202, sent.text
        async with open_page() as tab:
            page = tab.page
            await page.goto(f"{endpoints.url}?desk=alpha#token={viewer}")
            await expect(page.locator("body")).to_have_attribute("data-live", "true")
            await expect(page.locator("body")).to_have_attribute("data-role", "viewer")
            await expect(page.locator("#whoami")).to_have_text("vera · viewer")
            # The approval waiting shows, without its buttons; the desk's figures show,
            # without pause, the composer, the kill switches or reload.
            await expect(page.locator(".approval")).to_have_count(1)
            await expect(page.locator(".approval")).to_be_visible()
            await expect(page.locator(".approval button[data-action=approve]")).to_be_hidden()
            await expect(page.locator(".approval button[data-action=deny]")).to_be_hidden()
            await expect(page.locator("#desk-name")).to_have_text("alpha")
            for hidden in ("#pause", "#composer", "#kill-all", "#reload", "#kill-desk"):
                await expect(page.locator(hidden)).to_be_hidden()
            # The operators' actions panel lists the owner's message.
            await page.locator("#audit summary").click()
            await expect(page.locator("#audit-list")).to_contain_text("owner send alpha")
            assert not tab.errors, tab.errors
        async with httpx.AsyncClient(base_url=endpoints.url, timeout=5, headers={
                "Authorization": f"Bearer {TOKEN}"}) as owner:
            [approval] = (await owner.get("/api/approvals")).json()["approvals"]
            denied = await owner.post(f"/api/approvals/{approval['id']}/deny", json={})
            assert denied.status_code == 200
            await control.wait_turns("alpha", 1)
    assert gate.orders == []
