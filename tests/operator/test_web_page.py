"""The web page in headless Chromium (driven over the DevTools protocol): a message sent from
the page reaches a real daemon's desk and the answer streams in; approvals by button."""

from __future__ import annotations

import os
import random
from pathlib import Path

import anyio
import pytest

from tests.operator.cdp import Browser, chromium_path, open_browser
from tests.operator.daemon_process import running_daemon
from tests.operator.harness import LoopDeskControl, build_control, running_api
from tests.scripted_server import Reply, ScriptedServer, ToolCall
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.config import OperatorConfig

TOKEN = "web-test-token-0123456789abcdef"

pytestmark = [
    pytest.mark.skipif(chromium_path() is None,
                       reason="chromium is not installed (scripts/ensure-test-tools.sh "
                              "installs it with apt-get as root)"),
    pytest.mark.slow,
]


async def _wander(control: LoopDeskControl, stop: anyio.Event) -> None:
    """Moves the desks' equity a little, as marks to market would."""
    walk = random.Random(7)
    while not stop.is_set():
        for desk in control.desks.values():
            desk.equity = round(desk.equity * (1 + walk.gauss(0.0004, 0.003)), 2)
        await anyio.sleep(0.02)


def _screenshot_dir(tmp_path: Path) -> Path:
    return Path(os.environ.get("OPERATOR_SCREENSHOT_DIR", str(tmp_path)))


async def _type(browser: Browser, text: str) -> None:
    await browser.evaluate("document.getElementById('message').focus()")
    await browser.command("Input.insertText", text=text)
    for kind in ("keyDown", "keyUp"):  # Enter sends, as a person would press it
        await browser.command("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                              windowsVirtualKeyCode=13)


async def test_a_message_from_the_page_reaches_the_desk_and_the_answer_streams(
        scripted_server: ScriptedServer, state_dir: Path, tmp_path: Path) -> None:
    scripted_server.add(Reply("Flat day so far: BTC holds 64,000 and I have no position. "
                              "Nothing to do until it breaks 64,500.", text_chunks=12,
                              chunk_delay=0.05))
    async with running_daemon(state_dir, scripted_server.base_url, token=TOKEN) as daemon:
        assert daemon.url is not None
        async with open_browser() as browser:
            await browser.command("Page.navigate",
                                  url=f"{daemon.url}?desk=alpha#token={TOKEN}&operator=erin")
            await browser.wait_for("document.body.dataset.live === 'true'", "a live stream")
            await browser.wait_for("document.querySelectorAll('.desk-card').length === 2",
                                   "two desks")
            await _type(browser, "Anything to do?")
            # Mid-stream, the page already shows part of the answer, and then all of it.
            await browser.wait_for("document.querySelector('.entry.streaming .text') !== null",
                                   "text streaming in")
            await browser.wait_for(
                "document.getElementById('log').innerText.includes('until it breaks 64,500.')",
                "the whole answer")
            await browser.wait_for("document.querySelector('.entry.streaming') === null",
                                   "the turn's end")
            await browser.wait_for(
                "document.getElementById('desk-state').textContent === 'idle'", "an idle desk")
            shot = await browser.screenshot(_screenshot_dir(tmp_path) / "operator-web-daemon.png")
            # Opened again, the page shows the same exchange from the daemon's stored
            # transcript.
            await browser.command("Page.reload")
            await browser.wait_for(
                "document.getElementById('log').innerText.includes('until it breaks 64,500.')",
                "the answer, from the transcript")
            history = await browser.evaluate("document.getElementById('log').innerText")
            assert "erin" in history and "Anything to do?" in history
            assert "[Message from" not in history  # the marker the model reads is not shown
            assert not [line for line in browser.console if line.startswith("exception")], \
                browser.console
    sent = scripted_server.requests[0].messages[-1]["content"]
    assert sent == "[Message from erin, a human operator]\nAnything to do?"
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
        await anyio.sleep(1.5)  # a minute of samples, compressed, for the chart
        assert endpoints.url is not None
        async with open_browser() as browser:
            await browser.command(
                "Page.navigate",
                url=f"{endpoints.url}?desk=btc-momentum#token={TOKEN}&operator=dana")
            await browser.wait_for("document.body.dataset.live === 'true'", "a live stream")
            await browser.wait_for("document.querySelectorAll('.desk-card').length === 3",
                                   "three desks")
            assert await browser.evaluate("location.hash") == ""  # the token left the URL

            await _type(browser, "How does BTC look?")
            await browser.wait_for(
                "document.getElementById('log').innerText.includes('pullback toward 63,400.')",
                "the streamed answer")
            await browser.wait_for("document.querySelector('.step-done') !== null",
                                   "the finished tool step")
            log = await browser.evaluate("document.getElementById('log').innerText")
            assert "How does BTC look?" in log and "starts a turn" in log
            assert "get_price" in log and "BTC/USDT last 64000" in log

            await _type(browser, "Buy 0.05 BTC now.")
            await browser.wait_for("document.querySelector('.approval') !== null",
                                   "the approval card")
            assert gate.orders == []
            await browser.evaluate("document.querySelector('.approval-reason').value = "
                                   "'within today\\'s budget'")
            stop.set()
            await anyio.sleep(0.3)
            await browser.evaluate("document.getElementById('log').scrollTop = 1e9")
            pending = await browser.screenshot(shots / "operator-web-approval.png")

            await browser.evaluate(
                "document.querySelector('.approval button[data-action=approve]').click()")
            await browser.wait_for(
                "document.getElementById('log').innerText.includes('the stop sits at 62,900')",
                "the answer after approval")
            await browser.wait_for("document.getElementById('approvals').hidden", "no approval")
            await browser.wait_for(
                "document.querySelector('.entry.streaming') === null", "the turn's end")
            await browser.wait_for(
                "document.getElementById('desk-state').textContent === 'idle'", "an idle desk")
            final = await browser.screenshot(shots / "operator-web.png")
            caption = await browser.evaluate(
                "document.getElementById('equity-caption').textContent")
            assert caption.startswith("Equity ")
            assert not [line for line in browser.console if line.startswith("exception")], \
                browser.console
    assert gate.orders == [{"symbol": "BTC/USDT", "side": "buy", "amount": 0.05,
                            "price": 64000.0}]
    sent = scripted_server.requests[0].messages[-1]["content"]
    assert sent == "[Message from dana, a human operator]\nHow does BTC look?"
    assert pending.stat().st_size > 10_000 and final.stat().st_size > 10_000
    print(f"screenshots: {pending} {final}")
    scripted_server.assert_complete()
