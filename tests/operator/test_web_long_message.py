"""The web page says when a message was too long for the desk's model to read whole.

Headless Chromium, driven by Playwright, against a real daemon (``trading-agent run``), whose
desk ``alpha`` keeps a tiny recent budget: its model reads at most 256 characters of one
message.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from playwright.async_api import expect

from tests.operator.browser import needs_chromium, open_page
from tests.operator.daemon_process import running_daemon
from tests.operator.test_web_page import _type
from tests.scripted_server import Reply, ScriptedServer
from tests.waiting import wait_until

TOKEN = "web-long-token-0123456789abcdef"

pytestmark = [needs_chromium, pytest.mark.slow]


async def test_the_page_says_a_long_message_was_shortened(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("Noted."), Reply("Fine."))
    async with running_daemon(state_dir, scripted_server.base_url, token=TOKEN) as daemon:
        assert daemon.url is not None
        async with open_page() as tab:
            page = tab.page
            await page.goto(f"{daemon.url}?desk=alpha#token={TOKEN}&operator=erin")
            await expect(page.locator("body")).to_have_attribute("data-live", "true")
            # The desk is chosen once the page has read the desks: then the composer sends.
            await expect(page.locator("body")).to_contain_text("scripted-model · BTC/USDT",
                                                               use_inner_text=True)
            await _type(tab, "Closes: " + " ".join(["16751.3"] * 100))
            await expect(page.locator(".entry.you .tag").first).to_have_text(
                "starts a turn · shortened")
            await expect(page.locator(".note", has_text="Shortened")).to_contain_text(
                "The message is 807 characters; this desk's model reads at most 256")
            await expect(page.locator("#log")).to_contain_text("Noted.", use_inner_text=True)

            # The answer streams before its turn ends: the next message starts a turn of its
            # own only once the desk is idle again.
            async def idle() -> bool:
                async with httpx.AsyncClient(base_url=str(daemon.url), headers={
                        "Authorization": f"Bearer {TOKEN}"}) as client:
                    answer = await client.get("/api/desks/alpha")
                return bool(answer.json()["state"] == "idle")

            await wait_until(idle, "the first turn to end")
            # A short one is read whole: no tag, no note.
            await _type(tab, "Short now.")
            await expect(page.locator("#log")).to_contain_text("Fine.", use_inner_text=True)
            await expect(page.locator(".entry.you .tag")).to_have_text(
                ["starts a turn · shortened", "starts a turn"])
            await expect(page.locator(".note", has_text="Shortened")).to_have_count(1)
    sent = scripted_server.requests[0].messages[-1]["content"]
    assert "characters of this message were cut here" in sent
