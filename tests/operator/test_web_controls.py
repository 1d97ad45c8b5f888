"""The operator's controls on the web page, in headless Chromium against a real daemon: pause
and resume with a reason, cancel a running turn at once, the kill switch of one desk and of
every desk (flattening only after a confirmation in the page), today's spend cap use, and the
control events in the desk's activity."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.operator.cdp import Browser, chromium_path, open_browser
from tests.operator.test_web_page import _screenshot_dir, _type
from tests.scripted_server import Reply, ScriptedServer
from trading_agent.daemon.events import ConfigReloaded
from trading_agent.daemon.wiring import Daemon, open_daemon
from trading_agent.operator.config import DEFAULT_TOKEN_ENV
from trading_agent.operator.events import ReconciliationReported
from trading_agent.settings import load_settings

TOKEN = "web-controls-token-0123456789abcdef"

pytestmark = [
    pytest.mark.skipif(chromium_path() is None,
                       reason="chromium is not installed (scripts/ensure-test-tools.sh "
                              "installs it with apt-get as root)"),
    pytest.mark.slow,
]

_CONFIG = """\
[daemon]
state_dir = "{state}"

[daemon.spend]
max_tokens_per_day = 5000000

[model]
provider = "openai"
base_url = "{model_url}"
model = "scripted-model"
context_window = 32000
request_timeout = 10

[exchange]
mode = "paper"
feed = "replay"

[operator]
tcp_address = "127.0.0.1:0"

[desks.alpha]
system_prompt = "You are alpha, a paper desk for BTC/USDT."
symbols = ["BTC/USDT"]

[desks.alpha.controls]
max_tokens_per_day = 1000000

[desks.alpha.subagents]
enabled = false

[desks.beta]
system_prompt = "You are beta, a paper desk for BTC/USDT."
symbols = ["BTC/USDT"]

[desks.beta.subagents]
enabled = false
"""


@contextlib.asynccontextmanager
async def _running(folder: Path, model_url: str) -> AsyncIterator[tuple[Daemon, str]]:
    """Two paper desks (alpha with a daily cap of a million tokens, the daemon five million)
    and the API on TCP with a token, opened as ``trading-agent run`` opens them; yields the
    daemon and the page's base URL."""
    path = folder / "daemon.toml"
    path.write_text(_CONFIG.format(state=folder / "state", model_url=model_url))
    async with open_daemon(load_settings(path), environ={DEFAULT_TOKEN_ENV: TOKEN},
                           config_path=path) as daemon, \
            anyio.create_task_group() as group:
        group.start_soon(daemon.store.persist_events, daemon.store_subscription)
        assert daemon.serve_api is not None
        endpoints = await group.start(daemon.serve_api)
        await group.start(daemon.supervisor.run)
        assert endpoints.url is not None
        try:
            yield daemon, endpoints.url.rstrip("/")
        finally:
            group.cancel_scope.cancel()


async def _get(url: str, path: str) -> Any:
    async with httpx.AsyncClient(base_url=url, timeout=5,
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        response = await http.get(path)
        assert response.status_code == 200, response.text
        return response.json()


async def _open(browser: Browser, url: str) -> None:
    """Opens the page on desk alpha as operator erin, and records what it posts."""
    await browser.command("Page.navigate", url=f"{url}/?desk=alpha#token={TOKEN}&operator=erin")
    await browser.wait_for("document.body.dataset.live === 'true'", "a live stream")
    await browser.wait_for("document.querySelectorAll('.desk-card').length === 2", "two desks")
    await browser.evaluate(
        "window.posted = []; const pageFetch = window.fetch; window.fetch = (url, init) => {"
        " if (init && init.method === 'POST') window.posted.push([String(url), init.body]);"
        " return pageFetch(url, init); }; true")


async def _fill(browser: Browser, selector: str, text: str) -> None:
    """Types into a field as a person would (its input events fire)."""
    await browser.evaluate(f"document.querySelector({selector!r}).focus()")
    await browser.command("Input.insertText", text=text)


async def _click(browser: Browser, selector: str) -> None:
    await browser.evaluate(f"document.querySelector({selector!r}).click()")


def _log_has(text: str) -> str:
    return f"document.getElementById('log').innerText.includes({text!r})"


async def _notes(browser: Browser, kind: str) -> list[str]:
    return list(await browser.evaluate(
        f"[...document.querySelectorAll('#log .note-{kind}')].map((n) => n.innerText)"))


async def test_pause_resume_cancel_and_the_spend_cap_on_the_page(
        scripted_server: ScriptedServer, state_dir: Path, tmp_path: Path) -> None:
    release = threading.Event()
    scripted_server.add(
        Reply("BTC holds 64,000; nothing to do.", usage=(805_000, 5_000)),
        Reply("Looking at the order book", hold_until=release),
    )
    try:
        async with _running(state_dir, scripted_server.base_url) as (daemon, url), \
                open_browser() as browser:
            await _open(browser, url)
            # A turn of 810,000 tokens: 81% of alpha's cap, 16% of the daemon's.
            await _type(browser, "Anything to do?")
            await browser.wait_for(_log_has("nothing to do."), "the answer")
            alert = await browser.wait_for(
                "[...document.querySelectorAll('#log .note-warn')].map((n) => n.innerText)"
                ".find((t) => t.includes('spend cap')) || ''", "the spend alert")
            assert "desk alpha's daily spend cap is 81% used: 810,000 of 1,000,000 tokens" \
                in alert
            figure = await browser.wait_for(
                "((t) => t.includes('81%') && t)([...document.querySelectorAll("
                "'#desk-figures .figure-wide dd')].map((d) => d.textContent).join(' | '))",
                "today's spend in the desk's figures")
            assert figure == "tokens 81% of 1,000,000 | daemon tokens 16% of 5,000,000"
            card = await browser.evaluate(
                "document.querySelector('.desk-card[data-desk=alpha]').innerText")
            assert "tokens 81% of 1,000,000" in card
            assert await browser.evaluate(
                "document.querySelector('.desk-card[data-desk=alpha] .spend')"
                ".classList.contains('spend-warn')")

            # Pause with a reason: the page and the API say so, and why.
            await _fill(browser, "#control-reason", "FOMC in ten minutes")
            await _click(browser, "#pause")
            await browser.wait_for(
                "document.getElementById('desk-state').textContent === 'paused'", "paused")
            banner = await browser.wait_for(
                "document.querySelector('#desk-banners .banner-paused')?.innerText",
                "the pause banner")
            assert "paused by erin at " in banner and "FOMC in ten minutes" in banner
            assert "FOMC in ten minutes" in await browser.evaluate(
                "document.querySelector('.desk-card[data-desk=alpha] .desk-card-note')"
                ".innerText")
            await browser.wait_for(_log_has("⏸ paused by erin until resumed: FOMC in ten "
                                            "minutes"), "the pause in the log")
            status = await _get(url, "/api/desks/alpha")
            assert status["state"] == "paused"
            assert status["paused_reason"].startswith("paused by erin at ")
            assert "FOMC in ten minutes" in status["paused_reason"]
            assert await browser.evaluate("document.getElementById('pause').textContent") \
                == "Resume"
            shot = await browser.screenshot(
                _screenshot_dir(tmp_path) / "operator-web-paused.png")

            await _click(browser, "#pause")
            await browser.wait_for(
                "document.getElementById('desk-state').textContent === 'idle'", "resumed")
            await browser.wait_for(_log_has("▶ resumed by erin"), "the resume in the log")
            assert await browser.evaluate(
                "document.querySelector('#desk-banners .banner-paused')") is None
            status = await _get(url, "/api/desks/alpha")
            assert (status["state"], status["paused_reason"]) == ("idle", "")

            # A turn that hangs on its model, cut at once.
            await _type(browser, "Check the book.")
            await browser.wait_for("!document.getElementById('cancel-turn').disabled",
                                   "a running turn to cancel")
            await _click(browser, "#cancel-now")
            await _click(browser, "#cancel-turn")
            await browser.wait_for(_log_has("✋ turn cancelled by erin (at once)"),
                                   "the cancel in the log")
            await browser.wait_for(
                "document.getElementById('desk-state').textContent === 'idle'", "an idle desk")
            assert ["/api/desks/alpha/cancel", '{"operator":"erin","now":true}'] in [
                [u.removeprefix(url), b] for u, b in await browser.evaluate("window.posted")]

            # What the daemon says on its own shows too: a reload (for every desk) and a
            # reconciliation with the exchange.
            daemon.event_bus.publish(ConfigReloaded(
                desk="*", ok=True, changes=("alpha: risk.max_order_notional 5000 -> 2500",)))
            daemon.event_bus.publish(ReconciliationReported(
                desk="alpha", exchange="binance",
                differences=("order 8812 (buy 0.01 BTC/USDT) is open on the exchange and "
                             "not in the journal",),
                adopted=("8812",)))
            await browser.wait_for(_log_has("Config reloaded: alpha: risk.max_order_notional "
                                            "5000 -> 2500"), "the reload")
            await browser.wait_for(_log_has("⚖ binance differs from the journal (1): order "
                                            "8812"), "the reconciliation")
            assert "adopted: 8812" in (await _notes(browser, "warn"))[-1]
            assert not [line for line in browser.console if line.startswith("exception")], \
                browser.console
    finally:
        release.set()
    assert shot.stat().st_size > 10_000
    scripted_server.assert_complete()


async def test_the_kill_switch_on_the_page_and_flatten_only_once_confirmed(
        scripted_server: ScriptedServer, state_dir: Path, tmp_path: Path) -> None:
    async with _running(state_dir, scripted_server.base_url) as (_, url), \
            open_browser() as browser:
        await _open(browser, url)

        # No reason, no kill switch: the page asks for one and sends nothing.
        await _click(browser, "#desk-controls [data-action=kill]")
        refusal = await browser.wait_for(
            "[...document.querySelectorAll('#log .note-error')].map((n) => n.innerText)"
            ".join()", "the request for a reason")
        assert "Say why the kill switch goes on for desk alpha" in refusal
        assert await browser.evaluate(
            "document.getElementById('control-reason').classList.contains('invalid')")

        # One desk's switch, with a reason: red on the desk, listed by the API.
        await _fill(browser, "#control-reason", "the feed looks stale")
        await _click(browser, "#desk-controls [data-option=cancel_orders]")
        await _click(browser, "#desk-controls [data-action=kill]")
        banner = await browser.wait_for(
            "document.querySelector('#desk-banners .banner-kill')?.innerText",
            "the kill switch banner")
        assert banner.startswith("⛔ Kill switch on: halted by erin at ")
        assert "the feed looks stale" in banner
        card = await browser.evaluate(
            "document.querySelector('.desk-card[data-desk=alpha] .desk-card-kill').innerText")
        assert card.startswith("⛔ halted by erin at ") and card.endswith("the feed looks stale")
        assert await browser.evaluate(
            "document.querySelector('.desk-card[data-desk=beta] .desk-card-kill')") is None
        await browser.wait_for(
            "[...document.querySelectorAll('#log .note-kill')].some((n) => "
            "n.innerText.includes('kill switch ON (alpha): halted by erin'))",
            "the kill switch in the log")
        [halt] = (await _get(url, "/api/kill-switch"))["halts"]
        assert (halt["scope"], halt["by"], halt["reason"]) == (
            "alpha", "erin", "the feed looks stale")
        assert await browser.evaluate(
            "document.querySelector('#desk-controls [data-action=kill]').textContent") \
            == "Switch off (alpha)"

        # Every desk, flattening: the page asks first, and a no sends nothing.
        posts = len(await browser.evaluate("window.posted"))
        await _fill(browser, "#kill-all [data-field=reason]", "exchange incident")
        await _click(browser, "#kill-all [data-option=flatten]")
        await _click(browser, "#kill-all [data-action=kill]")
        question = await browser.wait_for(
            "!document.querySelector('#kill-all .confirm').hidden && "
            "document.querySelector('#kill-all .confirm').innerText", "the confirmation")
        assert "Flatten closes every open position of every desk at market" in question
        assert "Flatten every desk now" in question
        await _click(browser, "#kill-all [data-action=keep-positions]")
        await browser.wait_for("document.querySelector('#kill-all .confirm').hidden",
                               "the confirmation gone")
        await browser.wait_for(_log_has("flattening every desk was not confirmed"),
                               "the note that nothing was sent")
        assert len(await browser.evaluate("window.posted")) == posts
        assert [h["scope"] for h in (await _get(url, "/api/kill-switch"))["halts"]] == ["alpha"]

        # Asked again and confirmed: sent, with flatten.
        await _click(browser, "#kill-all [data-action=kill]")
        await browser.wait_for("!document.querySelector('#kill-all .confirm').hidden",
                               "the confirmation again")
        shot = await browser.screenshot(_screenshot_dir(tmp_path) / "operator-web-kill.png")
        await _click(browser, "#kill-all [data-action=confirm-flatten]")
        state = await browser.wait_for(
            "!document.querySelector('#kill-all .kill-state').hidden && "
            "document.querySelector('#kill-all .kill-state').innerText", "every desk halted")
        assert state.startswith("⛔ halted by erin at ") and state.endswith("exchange incident")
        [(path, body)] = (await browser.evaluate("window.posted"))[posts:]
        assert path.removeprefix(url) == "/api/kill-switch"
        assert body == ('{"on":true,"operator":"erin","reason":"exchange incident",'
                        '"cancel_orders":false,"flatten":true}')
        halts = (await _get(url, "/api/kill-switch"))["halts"]
        assert [h["scope"] for h in halts] == ["*", "alpha"]
        await browser.wait_for(
            "document.querySelector('.desk-card[data-desk=beta] .desk-card-kill')"
            "?.innerText.endsWith('exchange incident')", "beta halted with every desk")
        assert await _notes(browser, "error") == [refusal]  # nothing failed meanwhile

        # alpha's own switch off: alpha stays halted by every desk's.
        await _click(browser, "#desk-controls [data-action=kill]")
        await browser.wait_for(
            "document.querySelector('#desk-banners .banner-kill')?.innerText"
            ".startsWith('⛔ Kill switch on (every desk): halted by erin')",
            "alpha halted by every desk's switch only")
        assert [h["scope"] for h in (await _get(url, "/api/kill-switch"))["halts"]] == ["*"]
        await browser.wait_for(
            "[...document.querySelectorAll('#log .note-good')].some((n) => "
            "n.innerText.includes('kill switch off (alpha)'))",
            "the switch off in the log")
        assert not [line for line in browser.console if line.startswith("exception")], \
            browser.console
    assert shot.stat().st_size > 10_000


async def test_the_reload_button_applies_a_good_config_and_shows_why_a_bad_one_is_refused(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    async with _running(state_dir, scripted_server.base_url) as (_, url), \
            open_browser() as browser:
        await _open(browser, url)
        config = state_dir / "daemon.toml"
        text = config.read_text()
        config.write_text(text.replace("You are beta, a paper desk", "You are beta, a careful "
                                                                       "paper desk"))
        await _click(browser, "#reload")
        await browser.wait_for(_log_has("Config reloaded: desk beta: system_prompt changed; "
                                        "applies from its next turn"), "the reload")
        config.write_text(text.replace('symbols = ["BTC/USDT"]', 'symbols = "BTC/USDT"', 1))
        await browser.wait_for("!document.getElementById('reload').disabled",
                               "the first reload to finish")
        await _click(browser, "#reload")
        await browser.wait_for(_log_has("Config reload refused, nothing changed"),
                               "the refusal")
        refused = (await _notes(browser, "error"))[-1]
        desks = await _get(url, "/api/desks")

    assert "desks.alpha.symbols" in refused
    assert [d["name"] for d in desks["desks"]] == ["alpha", "beta"]
