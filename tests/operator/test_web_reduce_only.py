"""Reduce-only on the web page, in headless Chromium (Playwright) against a real daemon: the
control puts the selected desk in reduce-only with the reason typed, the badge and the
banner say who set it and why, the desk's card carries the badge, and the control lifts it;
a protection's reduce-only, set while the page is open, shows the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.async_api import expect

from tests.operator.browser import needs_chromium, open_page
from tests.operator.test_web_controls import _click, _fill, _get, _log_has, _open, _running
from tests.scripted_server import ScriptedServer

pytestmark = [needs_chromium, pytest.mark.slow]


async def test_the_page_switches_reduce_only_and_shows_its_badge(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    async with _running(state_dir, scripted_server.base_url) as (daemon, url), \
            open_page() as tab:
        page = tab.page
        await _open(tab, url)
        badge = page.locator("#desk-reduce-only")
        await expect(badge).to_be_hidden()
        await expect(page.locator("#reduce-only")).to_have_text("Reduce-only")

        await _fill(tab, "#control-reason", "FOMC at 18:00")
        await _click(tab, "#reduce-only")
        await expect(badge).to_be_visible()
        await expect(badge).to_have_text("reduce-only")
        banner = page.locator("#desk-banners .banner-reduce-only")
        await expect(banner).to_contain_text("Reduce-only: reduce-only by owner at ")
        await expect(banner).to_contain_text(": FOMC at 18:00 (until an operator switches it "
                                             "off)")
        card = page.locator(".desk-card[data-desk=alpha] .badge-reduce-only")
        await expect(card).to_have_count(1)
        await expect(page.locator(".desk-card[data-desk=beta] .badge-reduce-only")
                     ).to_have_count(0)
        await _log_has(tab, "REDUCE-ONLY ON (alpha): reduce-only by owner")
        status = await _get(url, "/api/desks/alpha")
        assert status["reduce_only"]["by"] == "owner"
        assert status["reduce_only"]["reason"] == "FOMC at 18:00"

        await expect(page.locator("#reduce-only")).to_have_text("Lift reduce-only")
        await _click(tab, "#reduce-only")
        await expect(badge).to_be_hidden()
        await expect(banner).to_have_count(0)
        await _log_has(tab, "reduce-only off (alpha) by owner")
        assert (await _get(url, "/api/desks/alpha"))["reduce_only"] is None

        # Set elsewhere (a protection, a spend cap, the CLI): the page shows it from the event.
        await daemon.supervisor.set_reduce_only(True, desk="alpha", by="spend cap",
                                                reason="the daily cap is used up")
        await expect(badge).to_be_visible()
        await expect(banner).to_contain_text("reduce-only by spend cap at ")
