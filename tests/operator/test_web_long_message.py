"""The web page says when a message was too long for the desk's model to read whole.

Headless Chromium against a real daemon (``trading-agent run``), whose desk ``alpha`` keeps a
tiny recent budget: its model reads at most 256 characters of one message.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.operator.cdp import chromium_path, open_browser
from tests.operator.daemon_process import running_daemon
from tests.operator.test_web_page import _type
from tests.scripted_server import Reply, ScriptedServer

TOKEN = "web-long-token-0123456789abcdef"

pytestmark = [
    pytest.mark.skipif(chromium_path() is None,
                       reason="chromium is not installed (scripts/ensure-test-tools.sh "
                              "installs it with apt-get as root)"),
    pytest.mark.slow,
]


async def test_the_page_says_a_long_message_was_shortened(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("Noted."), Reply("Fine."))
    async with running_daemon(state_dir, scripted_server.base_url, token=TOKEN) as daemon:
        assert daemon.url is not None
        async with open_browser() as browser:
            await browser.command("Page.navigate",
                                  url=f"{daemon.url}?desk=alpha#token={TOKEN}&operator=erin")
            await browser.wait_for("document.body.dataset.live === 'true'", "a live stream")
            # The desk is chosen once the page has read the desks: then the composer sends.
            await browser.wait_for(
                "document.body.innerText.includes('scripted-model · BTC/USDT')", "the desk")
            await _type(browser, "Closes: " + " ".join(["16751.3"] * 100))
            tag = await browser.wait_for(
                "document.querySelector('.entry.you .tag')?.textContent?.includes('shortened')"
                " && document.querySelector('.entry.you .tag').textContent", "the tag")
            assert tag == "starts a turn · shortened"
            note = await browser.wait_for(
                "[...document.querySelectorAll('.note')].map((n) => n.innerText)"
                ".find((t) => t.includes('Shortened')) || ''", "the note")
            assert "The message is 807 characters; this desk's model reads at most 256" in note
            await browser.wait_for(
                "document.getElementById('log').innerText.includes('Noted.')", "the answer")
            # A short one is read whole: no tag, no note.
            await _type(browser, "Short now.")
            await browser.wait_for(
                "document.getElementById('log').innerText.includes('Fine.')", "the answer")
            tags = await browser.evaluate(
                "[...document.querySelectorAll('.entry.you .tag')].map((t) => t.textContent)")
            assert tags == ["starts a turn · shortened", "starts a turn"]
    sent = scripted_server.requests[0].messages[-1]["content"]
    assert "characters of this message were cut here" in sent
