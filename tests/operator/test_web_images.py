"""Pictures on the web page, in headless Chromium against a real daemon: a pasted picture is
sent with the message and reaches the model sized to the desk's limits; a dropped file that
is no picture is refused by the daemon, the page says so, and nothing is stored; a file of
another kind is not attached at all."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image
from playwright.async_api import expect

from tests.agent.test_image_preparer import chart
from tests.operator.browser import BrowserPage, needs_chromium, open_page
from tests.operator.daemon_process import running_daemon
from tests.operator.test_web_page import _screenshot_dir, _type
from tests.scripted_server import Reply, ScriptedServer
from trading_agent.agent.image_preparer import ImageLimits
from trading_agent.operator.client import OperatorClient

TOKEN = "web-image-token-0123456789abcdef"

pytestmark = [needs_chromium, pytest.mark.slow]


def _file(data: bytes, name: str, media_type: str) -> str:
    """JavaScript for a DataTransfer holding one File built in the page from ``data``."""
    encoded = base64.b64encode(data).decode()
    return (f"(() => {{ const bytes = Uint8Array.from(atob({json.dumps(encoded)}), "
            f"(c) => c.charCodeAt(0)); const transfer = new DataTransfer(); "
            f"transfer.items.add(new File([bytes], {json.dumps(name)}, "
            f"{{ type: {json.dumps(media_type)} }})); return transfer; }})()")


async def _paste(tab: BrowserPage, data: bytes, name: str, media_type: str) -> None:
    await tab.page.evaluate(
        "document.getElementById('message').dispatchEvent(new ClipboardEvent('paste', "
        f"{{ clipboardData: {_file(data, name, media_type)}, bubbles: true, "
        "cancelable: true }))")


async def _drop(tab: BrowserPage, data: bytes, name: str, media_type: str) -> None:
    await tab.page.evaluate(
        "document.getElementById('composer').dispatchEvent(new DragEvent('drop', "
        f"{{ dataTransfer: {_file(data, name, media_type)}, bubbles: true, "
        "cancelable: true }))")


async def test_a_pasted_picture_is_sent_and_a_dropped_bad_one_is_refused(
        scripted_server: ScriptedServer, state_dir: Path, tmp_path: Path) -> None:
    scripted_server.add(Reply("The breakout held: I see no reason to act."))
    limit = ImageLimits().max_side  # this daemon's desks keep the default limits
    async with running_daemon(state_dir, scripted_server.base_url, token=TOKEN) as daemon:
        assert daemon.url is not None
        async with open_page() as tab:
            page = tab.page
            await page.goto(f"{daemon.url}?desk=alpha#token={TOKEN}&operator=erin")
            await expect(page.locator("body")).to_have_attribute("data-live", "true")

            await _paste(tab, chart(2400, 1200), "image.png", "image/png")
            await expect(page.locator(".attachment img")).to_have_count(1)
            await _type(tab, "Did the breakout hold?")
            await expect(page.locator(".entry.you .tag").first).to_have_text("starts a turn")
            await expect(page.locator("#log")).to_contain_text("no reason to act.",
                                                               use_inner_text=True)
            await expect(page.locator(".entry.you .bubble-pictures img")).to_have_count(1)
            await expect(page.locator("#attachments")).to_be_hidden()

            # Bytes that claim to be a PNG: the daemon refuses them; the page says why and
            # keeps the picture in the composer to remove or replace.
            await _drop(tab, b"this is not a picture", "broken.png", "image/png")
            await expect(page.locator(".attachment")).to_have_count(1)
            await _type(tab, "And this one?")
            refusal = page.locator(".note-error", has_text="Not sent")
            await expect(refusal).to_contain_text(
                "the picture was refused: not a readable picture: no known picture format")
            await expect(page.locator(".attachment")).to_have_count(1)
            shot = _screenshot_dir(tmp_path) / "operator-web-images.png"
            await page.screenshot(path=shot)

            # Not a picture at all: never attached, and the page says so.
            await _drop(tab, b"buy the dip", "notes.txt", "text/plain")
            await expect(page.locator(".note-error", has_text="Not attached")).to_contain_text(
                "notes.txt is not a PNG, JPEG, GIF or WebP picture (text/plain)")
            await expect(page.locator(".attachment")).to_have_count(1)
            # Opened again: the stored message names its picture; the refused one is not there.
            await page.reload()
            await expect(page.locator(".entry.you .picture-chip").first).to_have_text(
                "🖼 picture from owner (image.png)")
            history = await page.locator("#log").inner_text()
            assert "Did the breakout hold?" in history and "And this one?" not in history
            assert not tab.errors, tab.errors
        async with OperatorClient(socket_path=daemon.socket_path) as client:
            transcript = await client.transcript("alpha")

    [request] = scripted_server.requests
    content = request.messages[-1]["content"]
    assert content[0]["text"] == "[Message from owner, a human operator]\nDid the breakout hold?"
    url = content[1]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    with Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2]))) as sent:
        assert sent.size == (limit, limit // 2)  # 2400 × 1200, scaled to the longest side
    operator_messages = [m for m in transcript if m["kind"] == "operator"]
    assert [m["text"].split("\n")[-1] for m in operator_messages] == ["Did the breakout hold?"]
    [picture] = [b for b in operator_messages[0]["content"] if b["type"] == "image"]
    assert picture["description"] == "picture from owner (image.png)"
    assert shot.stat().st_size > 10_000
    scripted_server.assert_complete()
