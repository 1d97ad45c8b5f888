"""The web page, in headless Chromium against a real daemon, shows the share of the desk's
prompt tokens the model's server served from its cache: today's, and each turn's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.operator.cdp import chromium_path, open_browser
from tests.operator.daemon_process import running_daemon
from tests.scripted_server import Reply, ScriptedServer, ToolCall

TOKEN = "web-cache-token-0123456789abcdef"

pytestmark = [
    pytest.mark.skipif(chromium_path() is None,
                       reason="chromium is not installed (scripts/ensure-test-tools.sh "
                              "installs it with apt-get as root)"),
    pytest.mark.slow,
]

_FIGURE = ("[...document.querySelectorAll('#desk-figures .figure')]"
           ".find(f => f.querySelector('dt').textContent === 'Cached prompt')"
           "?.querySelector('dd').textContent")


async def test_the_page_shows_the_desks_cache_share(scripted_server: ScriptedServer,
                                                    state_dir: Path) -> None:
    scripted_server.add(
        Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})],
              usage=(3000, 20), cached_tokens=0),
        Reply("BTC is flat; nothing to do.", usage=(3200, 10), cached_tokens=2944),
    )
    async with running_daemon(state_dir, scripted_server.base_url, token=TOKEN) as daemon:
        assert daemon.url is not None
        async with open_browser() as browser:
            await browser.command("Page.navigate",
                                  url=f"{daemon.url}?desk=alpha#token={TOKEN}&operator=erin")
            await browser.wait_for("document.body.dataset.live === 'true'", "a live stream")
            # Before any request there is no share to show.
            await browser.wait_for(f"{_FIGURE} === '–'", "an empty cache figure")
            await browser.evaluate("document.getElementById('message').focus()")
            await browser.command("Input.insertText", text="How is BTC?")
            for kind in ("keyDown", "keyUp"):
                await browser.command("Input.dispatchKeyEvent", type=kind, key="Enter",
                                      code="Enter", windowsVirtualKeyCode=13)
            # 2,944 of the turn's 6,200 prompt tokens came from the cache: 47%.
            await browser.wait_for(
                "document.getElementById('log').innerText.includes('47% cached')",
                "the turn's cache share")
            await browser.evaluate("location.reload()")
            await browser.wait_for(f"{_FIGURE} === '47%'", "today's cache share")
            assert not [line for line in browser.console if line.startswith("exception")], \
                browser.console
    scripted_server.assert_complete()
