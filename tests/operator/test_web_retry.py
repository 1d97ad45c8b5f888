"""The web page's retry button: the desk's last answer is struck out of what it is sent, and
its turn runs again.

Headless Chromium, driven by Playwright, against a real daemon (``trading-agent run``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.async_api import expect

from tests.operator.browser import needs_chromium, open_page
from tests.operator.daemon_process import running_daemon
from tests.operator.test_web_page import _type
from tests.scripted_server import Reply, ScriptedServer

TOKEN = "web-retry-token-0123456789abcdef"

pytestmark = [needs_chromium, pytest.mark.slow]


async def test_the_retry_button_runs_the_last_turn_again_and_strikes_out_its_answer(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("Buy everything now!"), Reply("Holding: the move is small."))
    async with running_daemon(state_dir, scripted_server.base_url, token=TOKEN) as daemon:
        assert daemon.url is not None
        async with open_page() as tab:
            page = tab.page
            address = f"{daemon.url}?desk=alpha#token={TOKEN}&operator=erin"
            await page.goto(address)
            await expect(page.locator("body")).to_have_attribute("data-live", "true")
            await expect(page.locator("body")).to_contain_text("scripted-model · BTC/USDT",
                                                               use_inner_text=True)
            await _type(tab, "Should we buy?")
            await expect(page.locator("#log")).to_contain_text("Buy everything now!",
                                                               use_inner_text=True)
            # The answer streams before its turn ends: retry once the page shows the end.
            await expect(page.locator("#log")).to_contain_text("1 round", use_inner_text=True)
            retry = page.locator("#retry-turn")
            await expect(retry).to_be_enabled()
            asked: list[str] = []  # what became of the page's retry request
            page.on("requestfinished", lambda request: asked.append(
                f"{request.method} {request.url}: finished") if "/retry" in request.url else None)
            page.on("requestfailed", lambda request: asked.append(
                f"{request.method} {request.url}: {request.failure}")
                if "/retry" in request.url else None)
            await retry.click()
            try:
                await expect(page.locator(".note", has_text="retried the last turn")
                             ).to_contain_text("owner retried the last turn: its answer "
                                               "(1 message) left what the desk is sent")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\nthe retry request: {asked or 'none finished'}\n"
                                     f"the daemon's log:\n"
                                     f"{daemon.log.read_text(errors='replace')[-4000:]}"
                                     ) from None
            await expect(page.locator("#log")).to_contain_text("Holding: the move is small.",
                                                               use_inner_text=True)
            # Read again from the store: the first answer is kept, struck out.
            await page.reload()
            await expect(page.locator(".entry.retracted")).to_contain_text(
                "Buy everything now!")
            await expect(page.locator(".entry.desk:not(.retracted)").last).to_contain_text(
                "Holding: the move is small.")
    assert sum("Should we buy?" in str(m.get("content"))
               for m in scripted_server.requests[1].messages) == 1
