"""The web page, in headless Chromium against a real daemon, shows the share of the desk's
prompt tokens the model's server served from its cache: today's, and each turn's."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.async_api import expect

from tests.operator.browser import needs_chromium, open_page
from tests.operator.daemon_process import running_daemon
from tests.operator.test_web_page import _type
from tests.scripted_server import Reply, ScriptedServer, ToolCall

TOKEN = "web-cache-token-0123456789abcdef"

pytestmark = [needs_chromium, pytest.mark.slow]

_FIGURE = "#desk-figures .figure:has(> dt:text-is('Cached prompt')) > dd"
"""The desk's "Cached prompt" figure."""


async def test_the_page_shows_the_desks_cache_share(scripted_server: ScriptedServer,
                                                    state_dir: Path) -> None:
    scripted_server.add(
        Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})],
              usage=(3000, 20), cached_tokens=0),
        Reply("BTC is flat; nothing to do.", usage=(3200, 10), cached_tokens=2944),
    )
    async with running_daemon(state_dir, scripted_server.base_url, token=TOKEN) as daemon:
        assert daemon.url is not None
        async with open_page() as tab:
            page = tab.page
            await page.goto(f"{daemon.url}?desk=alpha#token={TOKEN}&operator=erin")
            await expect(page.locator("body")).to_have_attribute("data-live", "true")
            # Before any request there is no share to show.
            await expect(page.locator(_FIGURE)).to_have_text("–")
            await _type(tab, "How is BTC?")
            # 2,944 of the turn's 6,200 prompt tokens came from the cache: 47%.
            await expect(page.locator("#log")).to_contain_text("47% cached",
                                                               use_inner_text=True)
            await page.reload()
            await expect(page.locator(_FIGURE)).to_have_text("47%")
            assert not tab.errors, tab.errors
    scripted_server.assert_complete()
