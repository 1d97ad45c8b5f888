"""The web page shows the model's reasoning dimmed and folded, apart from its answer.

Headless Chromium, driven by Playwright, against a real daemon (``trading-agent run``) whose
model streams ``reasoning_content`` before its answer, as DeepSeek's and vLLM's servers do.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.async_api import expect

from tests.operator.browser import needs_chromium, open_page
from tests.operator.daemon_process import running_daemon
from tests.operator.test_web_page import _type
from tests.scripted_server import ScriptedServer, SSEChunks

TOKEN = "web-thinking-token-0123456789abcdef"

pytestmark = [needs_chromium, pytest.mark.slow]


def _chunk(delta: dict[str, object], finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def test_thinking_is_folded_and_dimmed_and_opens_on_a_click(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(SSEChunks([
        _chunk({"reasoning_content": "The move is small; "}),
        _chunk({"reasoning_content": "the book is thin, so wait."}),
        _chunk({"content": "No trade for now."}), _chunk({}, "stop")], chunk_delay=0.05))
    async with running_daemon(state_dir, scripted_server.base_url, token=TOKEN) as daemon:
        assert daemon.url is not None
        async with open_page() as tab:
            page = tab.page
            await page.goto(f"{daemon.url}?desk=alpha#token={TOKEN}&operator=erin")
            await expect(page.locator("body")).to_have_attribute("data-live", "true")
            await expect(page.locator("body")).to_contain_text("scripted-model · BTC/USDT",
                                                               use_inner_text=True)
            await _type(tab, "Should we buy?")
            await expect(page.locator("#log")).to_contain_text("No trade for now.",
                                                               use_inner_text=True)
            fold = page.locator("details.thinking")
            await expect(fold).to_have_count(1)
            await expect(fold).not_to_have_attribute("open", "")
            await expect(fold.locator(".thinking-text")).to_be_hidden()
            await expect(fold.locator("summary")).to_have_text("Thinking")
            await fold.locator("summary").click()
            await expect(fold.locator(".thinking-text")).to_have_text(
                "The move is small; the book is thin, so wait.")
            # Dimmed: the page's muted colour, not the answer's.
            colours = await page.evaluate("""() => [
                getComputedStyle(document.querySelector('details.thinking')).color,
                getComputedStyle(document.querySelector('.bubble-desk .text')).color]""")
            assert colours[0] != colours[1]


async def test_a_turn_that_ends_without_an_answer_says_so_instead_of_thinking(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    # The demo model sometimes ends a turn with an empty answer: the bubble must not keep
    # saying "thinking…" after the turn ended.
    scripted_server.add(SSEChunks([_chunk({"content": ""}), _chunk({}, "stop")]))
    async with running_daemon(state_dir, scripted_server.base_url, token=TOKEN) as daemon:
        assert daemon.url is not None
        async with open_page() as tab:
            page = tab.page
            await page.goto(f"{daemon.url}?desk=alpha#token={TOKEN}&operator=erin")
            await expect(page.locator("body")).to_have_attribute("data-live", "true")
            await _type(tab, "Say nothing.")
            bubble = page.locator(".entry.desk .bubble-desk").last
            await expect(bubble).to_have_text("The turn ended without an answer.")
            await expect(page.locator(".entry.desk .meta .tag-dim")).to_contain_text("1 round")
            assert "thinking" not in (await bubble.inner_text()).lower()
