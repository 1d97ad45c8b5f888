"""Standing instructions on the web page, in headless Chromium (driven by Playwright)
against a real daemon: pin one, see who pinned it, remove it."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
from playwright.async_api import expect

from tests.daemon_config import write_daemon_config
from tests.operator.browser import needs_chromium, open_page
from tests.operator.harness import in_process_daemon
from tests.operator.test_web_page import _screenshot_dir
from tests.scripted_server import ScriptedServer
from trading_agent.operator.config import DEFAULT_TOKEN_ENV

TOKEN = "web-pins-token-0123456789abcdef"

pytestmark = [needs_chromium]

_RULE = "Never hold more than 0.1 BTC."


async def _pins(url: str) -> list[dict[str, object]]:
    async with httpx.AsyncClient(base_url=url, timeout=5,
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        response = await http.get("/api/desks/alpha/pins")
        assert response.status_code == 200, response.text
        return list(response.json()["pins"])


async def test_an_operator_pins_and_removes_an_instruction_on_the_page(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    config = write_daemon_config(tmp_path, scripted_server.base_url,
                                 operator={"tcp_address": "127.0.0.1:0"},
                                 desks={"alpha": {"tools": ["get_ticker"]}})
    async with in_process_daemon(config, {DEFAULT_TOKEN_ENV: TOKEN}) as running, \
            open_page() as tab:
        assert running.endpoints.url is not None
        url = running.endpoints.url.rstrip("/")
        page = tab.page
        await page.goto(f"{url}/?desk=alpha#token={TOKEN}&operator=erin")
        await expect(page.locator("#pins-summary")).to_have_text("none")
        await page.locator("#pin-text").fill(_RULE)
        await page.locator("#pin-add").click()
        pin = page.locator("#pin-list .pin")
        await expect(pin).to_have_count(1)
        await expect(pin.locator(".pin-text")).to_have_text(_RULE)
        # The name is the credential's (the page's token is the owner's), not the fragment's.
        await expect(pin.locator(".pin-meta")).to_contain_text("by owner")
        await expect(page.locator("#pins-summary")).to_have_text("1 sent in every request")
        await expect(page.locator("#log")).to_contain_text(f"owner pinned #1: {_RULE}")
        assert [(p["by"], p["text"]) for p in await _pins(url)] == [("owner", _RULE)]
        await page.screenshot(path=str(_screenshot_dir(tmp_path) / "pins.png"))

        await pin.get_by_role("button", name="Remove").click()
        await expect(pin).to_have_count(0)
        await expect(page.locator("#pins-summary")).to_have_text("none")
        with anyio.fail_after(5):
            assert await _pins(url) == []
        assert tab.errors == []
