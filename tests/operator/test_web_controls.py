"""The operator's controls on the web page, in headless Chromium (driven by Playwright) against
a real daemon: pause
and resume with a reason, cancel a running turn at once, the kill switch of one desk and of
every desk (flattening only after a confirmation in the page), today's spend cap use, and the
control events in the desk's activity."""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from playwright.async_api import expect

from tests.daemon_config import write_daemon_config
from tests.operator.browser import BrowserPage, needs_chromium, open_page
from tests.operator.test_web_page import _screenshot_dir, _type
from tests.scripted_server import Reply, ScriptedServer
from trading_agent.app.services import Daemon, open_daemon
from trading_agent.daemon.events import ConfigReloaded
from trading_agent.operator.config import DEFAULT_TOKEN_ENV
from trading_agent.operator.events import ReconciliationReported
from trading_agent.settings import load_settings

TOKEN = "web-controls-token-0123456789abcdef"

pytestmark = [needs_chromium, pytest.mark.slow]

@contextlib.asynccontextmanager
async def _running(folder: Path, model_url: str) -> AsyncIterator[tuple[Daemon, str]]:
    """Two paper desks (alpha with a daily cap of a million tokens, the daemon five million)
    and the API on TCP with a token, opened as ``trading-agent run`` opens them; yields the
    daemon and the page's base URL."""
    path = write_daemon_config(
        folder, model_url, daemon={"spend": {"max_tokens_per_day": 5000000}},
        exchange={"mode": "paper", "feed": "replay"}, operator={"tcp_address": "127.0.0.1:0"},
        desks={"alpha": {"system_prompt": "You are alpha, a paper desk for BTC/USDT.",
                         "controls": {"max_tokens_per_day": 1000000},
                         "subagents": {"enabled": False}},
               "beta": {"system_prompt": "You are beta, a paper desk for BTC/USDT.",
                        "subagents": {"enabled": False}}})
    async with open_daemon(load_settings(path), environ={DEFAULT_TOKEN_ENV: TOKEN},
                           config_path=path) as daemon, \
            anyio.create_task_group() as group:
        group.start_soon(daemon.store.events.persist_events, daemon.store_subscription)
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


async def _open(tab: BrowserPage, url: str) -> None:
    """Opens the page on desk alpha as operator erin, and records what it posts."""
    page = tab.page
    await page.goto(f"{url}/?desk=alpha#token={TOKEN}&operator=erin")
    await expect(page.locator("body")).to_have_attribute("data-live", "true")
    await expect(page.locator(".desk-card")).to_have_count(2)
    await page.evaluate(
        "() => { window.posted = []; const pageFetch = window.fetch;"
        " window.fetch = (url, init) => {"
        " if (init && init.method === 'POST') window.posted.push([String(url), init.body]);"
        " return pageFetch(url, init); }; }")


async def _fill(tab: BrowserPage, selector: str, text: str) -> None:
    """Types into a field as a person would (its input events fire)."""
    await tab.page.locator(selector).focus()
    await tab.page.keyboard.insert_text(text)


async def _click(tab: BrowserPage, selector: str) -> None:
    await tab.page.locator(selector).click()


async def _log_has(tab: BrowserPage, text: str) -> None:
    await expect(tab.page.locator("#log")).to_contain_text(text, use_inner_text=True)


async def _notes(tab: BrowserPage, kind: str) -> list[str]:
    return await tab.page.locator(f"#log .note-{kind}").all_inner_texts()


async def _posted(tab: BrowserPage) -> list[list[str]]:
    return list(await tab.page.evaluate("window.posted"))


async def test_pause_resume_cancel_and_the_spend_cap_on_the_page(
        scripted_server: ScriptedServer, state_dir: Path, tmp_path: Path) -> None:
    release = threading.Event()
    scripted_server.add(
        Reply("BTC holds 64,000; nothing to do.", usage=(805_000, 5_000)),
        Reply("Looking at the order book", hold_until=release),
    )
    try:
        async with _running(state_dir, scripted_server.base_url) as (daemon, url), \
                open_page() as tab:
            page = tab.page
            await _open(tab, url)
            # A turn of 810,000 tokens: 81% of alpha's cap, 16% of the daemon's.
            await _type(tab, "Anything to do?")
            await _log_has(tab, "nothing to do.")
            await expect(page.locator("#log .note-warn", has_text="spend cap")).to_contain_text(
                "desk alpha's daily spend cap is 81% used: 810,000 of 1,000,000 tokens")
            await expect(page.locator("#desk-figures .figure-wide dd")).to_have_text(
                ["tokens 81% of 1,000,000", "daemon tokens 16% of 5,000,000"])
            card = page.locator(".desk-card[data-desk=alpha]")
            await expect(card).to_contain_text("tokens 81% of 1,000,000")
            await expect(card.locator(".spend").first).to_have_class(
                re.compile(r"\bspend-warn\b"))

            # Pause with a reason: the page and the API say so, and why.
            await _fill(tab, "#control-reason", "FOMC in ten minutes")
            await _click(tab, "#pause")
            await expect(page.locator("#desk-state")).to_have_text("paused")
            banner = page.locator("#desk-banners .banner-paused")
            await expect(banner).to_contain_text("FOMC in ten minutes")
            assert "paused by owner at " in await banner.inner_text()
            await expect(card.locator(".desk-card-note")).to_contain_text("FOMC in ten minutes")
            await _log_has(tab, "⏸ paused by owner until resumed: FOMC in ten minutes")
            status = await _get(url, "/api/desks/alpha")
            assert status["state"] == "paused"
            assert status["paused_reason"].startswith("paused by owner at ")
            assert "FOMC in ten minutes" in status["paused_reason"]
            await expect(page.locator("#pause")).to_have_text("Resume")
            shot = _screenshot_dir(tmp_path) / "operator-web-paused.png"
            await page.screenshot(path=shot)

            await _click(tab, "#pause")
            await expect(page.locator("#desk-state")).to_have_text("idle")
            await _log_has(tab, "▶ resumed by owner")
            await expect(banner).to_have_count(0)
            status = await _get(url, "/api/desks/alpha")
            assert (status["state"], status["paused_reason"]) == ("idle", "")

            # A turn that hangs on its model, cut at once.
            await _type(tab, "Check the book.")
            await expect(page.locator("#cancel-turn")).to_be_enabled()
            await _click(tab, "#cancel-now")
            await _click(tab, "#cancel-turn")
            await _log_has(tab, "✋ turn cancelled by owner (at once)")
            await expect(page.locator("#desk-state")).to_have_text("idle")
            assert ["/api/desks/alpha/cancel", '{"operator":"erin","now":true}'] in [
                [u.removeprefix(url), b] for u, b in await _posted(tab)]

            # What the daemon says on its own shows too: a reload (for every desk) and a
            # reconciliation with the exchange.
            daemon.event_bus.publish(ConfigReloaded(
                desk="*", ok=True, changes=("alpha: risk.max_order_notional 5000 -> 2500",)))
            daemon.event_bus.publish(ReconciliationReported(
                desk="alpha", exchange="binance",
                differences=("order 8812 (buy 0.01 BTC/USDT) is open on the exchange and "
                             "not in the journal",),
                adopted=("8812",)))
            await _log_has(tab, "Config reloaded: alpha: risk.max_order_notional 5000 -> 2500")
            await _log_has(tab, "⚖ binance differs from the journal (1): order 8812")
            assert "adopted: 8812" in (await _notes(tab, "warn"))[-1]
            assert not tab.errors, tab.errors
    finally:
        release.set()
    assert shot.stat().st_size > 10_000
    scripted_server.assert_complete()


async def test_the_kill_switch_on_the_page_and_flatten_only_once_confirmed(
        scripted_server: ScriptedServer, state_dir: Path, tmp_path: Path) -> None:
    async with _running(state_dir, scripted_server.base_url) as (_, url), \
            open_page() as tab:
        page = tab.page
        await _open(tab, url)

        # No reason, no kill switch: the page asks for one and sends nothing.
        await _click(tab, "#desk-controls [data-action=kill]")
        await expect(page.locator("#log .note-error")).to_contain_text(
            "Say why the kill switch goes on for desk alpha")
        [refusal] = await _notes(tab, "error")
        await expect(page.locator("#control-reason")).to_have_class(re.compile(r"\binvalid\b"))

        # One desk's switch, with a reason: red on the desk, listed by the API.
        await _fill(tab, "#control-reason", "the feed looks stale")
        await _click(tab, "#desk-controls [data-option=cancel_orders]")
        await _click(tab, "#desk-controls [data-action=kill]")
        banner = page.locator("#desk-banners .banner-kill")
        await expect(banner).to_be_visible()
        text = await banner.inner_text()
        assert text.startswith("⛔ Kill switch on: halted by owner at ")
        assert "the feed looks stale" in text
        card = await page.locator(".desk-card[data-desk=alpha] .desk-card-kill").inner_text()
        assert card.startswith("⛔ halted by owner at ") and card.endswith("the feed looks stale")
        await expect(page.locator(".desk-card[data-desk=beta] .desk-card-kill")).to_have_count(0)
        await expect(page.locator(
            "#log .note-kill", has_text=re.compile(r"kill switch ON \(alpha\): halted by owner")
        ).first).to_be_visible()
        [halt] = (await _get(url, "/api/kill-switch"))["halts"]
        assert (halt["scope"], halt["by"], halt["reason"]) == (
            "alpha", "owner", "the feed looks stale")
        await expect(page.locator("#desk-controls [data-action=kill]")).to_have_text(
            "Switch off (alpha)")

        # Every desk, flattening: the page asks first, and a no sends nothing.
        posts = len(await _posted(tab))
        await _fill(tab, "#kill-all [data-field=reason]", "exchange incident")
        await _click(tab, "#kill-all [data-option=flatten]")
        await _click(tab, "#kill-all [data-action=kill]")
        confirm = page.locator("#kill-all .confirm")
        await expect(confirm).to_be_visible()
        question = await confirm.inner_text()
        assert "Flatten closes every open position of every desk at market" in question
        assert "Flatten every desk now" in question
        await _click(tab, "#kill-all [data-action=keep-positions]")
        await expect(confirm).to_be_hidden()
        await _log_has(tab, "flattening every desk was not confirmed")
        assert len(await _posted(tab)) == posts
        assert [h["scope"] for h in (await _get(url, "/api/kill-switch"))["halts"]] == ["alpha"]

        # Asked again and confirmed: sent, with flatten.
        await _click(tab, "#kill-all [data-action=kill]")
        await expect(confirm).to_be_visible()
        shot = _screenshot_dir(tmp_path) / "operator-web-kill.png"
        await page.screenshot(path=shot)
        await _click(tab, "#kill-all [data-action=confirm-flatten]")
        every_desk = page.locator("#kill-all .kill-state")
        await expect(every_desk).to_be_visible()
        state = await every_desk.inner_text()
        assert state.startswith("⛔ halted by owner at ") and state.endswith("exchange incident")
        [(path, body)] = (await _posted(tab))[posts:]
        assert path.removeprefix(url) == "/api/kill-switch"
        assert body == ('{"on":true,"operator":"erin","reason":"exchange incident",'
                        '"cancel_orders":false,"flatten":true}')
        halts = (await _get(url, "/api/kill-switch"))["halts"]
        assert [h["scope"] for h in halts] == ["*", "alpha"]
        await expect(page.locator(".desk-card[data-desk=beta] .desk-card-kill")).to_have_text(
            re.compile(r"exchange incident$"), use_inner_text=True)
        assert await _notes(tab, "error") == [refusal]  # nothing failed meanwhile

        # alpha's own switch off: alpha stays halted by every desk's.
        await _click(tab, "#desk-controls [data-action=kill]")
        await expect(banner).to_have_text(
            re.compile(r"^⛔ Kill switch on \(every desk\): halted by owner"), use_inner_text=True)
        assert [h["scope"] for h in (await _get(url, "/api/kill-switch"))["halts"]] == ["*"]
        await expect(page.locator("#log .note-good",
                                  has_text="kill switch off (alpha)").first).to_be_visible()
        assert not tab.errors, tab.errors
    assert shot.stat().st_size > 10_000


async def test_the_reload_button_applies_a_good_config_and_shows_why_a_bad_one_is_refused(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    async with _running(state_dir, scripted_server.base_url) as (_, url), \
            open_page() as tab:
        await _open(tab, url)
        config = state_dir / "daemon.toml"
        text = config.read_text()
        config.write_text(text.replace("You are beta, a paper desk", "You are beta, a careful "
                                                                       "paper desk"))
        await _click(tab, "#reload")
        await _log_has(tab, "Config reloaded: desk beta: system_prompt changed; applies from "
                            "its next turn")
        config.write_text(text.replace('symbols = ["BTC/USDT"]', 'symbols = "BTC/USDT"', 1))
        await expect(tab.page.locator("#reload")).to_be_enabled()
        await _click(tab, "#reload")
        await _log_has(tab, "Config reload refused, nothing changed")
        refused = (await _notes(tab, "error"))[-1]
        desks = await _get(url, "/api/desks")

    assert "desks.alpha.symbols" in refused
    assert [d["name"] for d in desks["desks"]] == ["alpha", "beta"]
