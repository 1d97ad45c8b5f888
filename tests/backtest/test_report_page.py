"""report.html in headless Chromium (over the DevTools protocol), opened from disk as a user
would: the chart shows, the figures read right, a transcript opens on a click, a trade's
link leads to its decision, and the page asks the network for nothing."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.backtest.test_report import make_record
from tests.operator.cdp import Browser, chromium_path, open_browser
from trading_agent.backtest.report import CHART_SIZE, write_report

pytestmark = [
    pytest.mark.skipif(chromium_path() is None,
                       reason="chromium is not installed (scripts/ensure-test-tools.sh "
                              "installs it with apt-get as root)"),
    pytest.mark.slow,
]


@contextmanager
def _requests(browser: Browser) -> Iterator[list[str]]:
    """Collects the URL of every request the page sends (CDP Network events).

    The CDP helper keeps only console events as it reads replies; this wraps its event hook
    on this one browser to keep the network ones too.
    """
    urls: list[str] = []
    original = browser._note

    def note(message: dict[str, Any]) -> None:
        if message.get("method") == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
        original(message)

    browser._note = note  # type: ignore[method-assign]
    try:
        yield urls
    finally:
        browser._note = original  # type: ignore[method-assign]


async def _click(browser: Browser, selector: str) -> None:
    """A real left click in the middle of the element, scrolled into view first."""
    box = await browser.evaluate(
        f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
        " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
        " return {x: r.left + Math.min(r.width / 2, 40), y: r.top + r.height / 2}; })()")
    for kind in ("mousePressed", "mouseReleased"):
        await browser.command("Input.dispatchMouseEvent", type=kind, x=box["x"], y=box["y"],
                              button="left", clickCount=1)


async def _open(browser: Browser, page: Path) -> str:
    url = page.as_uri()  # tmp_path is absolute
    await browser.command("Page.navigate", url=url)
    await browser.wait_for(f"location.href === {json.dumps(url)} && "
                           "document.readyState === 'complete'", "the loaded report")
    return url


async def test_the_report_page_in_chromium(tmp_path: Path) -> None:
    out = tmp_path / "report"
    out.mkdir()
    figures = write_report(make_record(), out)
    total_return = f"{figures.total_return * 100:+.2f}%"
    async with open_browser() as browser:
        await browser.command("Network.enable")
        with _requests(browser) as urls:
            url = await _open(browser, out / "report.html")

            # The chart is decoded at its size.
            width, height = CHART_SIZE
            await browser.wait_for(
                "(() => { const i = document.querySelector('img.chart');"
                f" return i.complete && i.naturalWidth === {width}"
                f" && i.naturalHeight === {height}; }})()", "the decoded chart")
            # The figures table shows the total return.
            shown = await browser.evaluate(
                "document.querySelector('#figures tr[data-figure=total_return] td').innerText")
            assert shown == total_return
            assert "Total return" in await browser.evaluate(
                "document.getElementById('figures').innerText")

            # A transcript is hidden until its summary is clicked.
            transcript = "#decision-3 ol.transcript"
            visible = f"document.querySelector({json.dumps(transcript)}).checkVisibility()"
            assert await browser.evaluate(visible) is False
            assert "limit must be at most 1000" not in await browser.evaluate(
                "document.body.innerText")
            await _click(browser, "#decision-3 > summary")
            await browser.wait_for(visible, "the opened transcript")
            text = await browser.evaluate(
                f"document.querySelector({json.dumps(transcript)}).innerText")
            assert "limit must be at most 1000" in text and "TOOL RESULT · ERROR" in text
            # The model's <script> is shown as text, never run.
            await _click(browser, "#decision-4 > summary")
            await browser.wait_for("document.querySelector('#decision-4').open", "decision 4")
            assert '<script>alert("owned")</script>' in await browser.evaluate(
                "document.querySelector('#decision-4 ol.transcript').innerText")
            assert await browser.evaluate("document.scripts.length") == 0

            # A trade's link leads to the decision that placed it.
            await browser.evaluate("window.scrollTo(0, 0)")
            await _click(browser, "table.trades a[href='#decision-5']")
            await browser.wait_for("location.hash === '#decision-5'", "the decision's anchor")
            await browser.wait_for(
                "(() => { const d = document.getElementById('decision-5');"
                " const top = d.getBoundingClientRect().top;"
                " return document.querySelector(':target') === d"
                " && top >= -1 && top < innerHeight / 2; })()", "decision 5 scrolled to")
            await browser.screenshot(Path(os.environ.get("REPORT_SCREENSHOT_DIR",
                                                         str(tmp_path))) / "report-page.png")

            resources = await browser.evaluate(
                "performance.getEntriesByType('resource').map(e => e.name)")
            assert not browser.console, browser.console
        # The file itself and the chart's data URI, nothing else.
        assert url in urls
        others = [u for u in urls if u != url and not u.startswith("data:image/png;base64,")]
        assert others == [], others
        assert [r for r in resources if not r.startswith("data:")] == []

        # The check above would see a page that reached out (so it can fail).
        page = (out / "report.html").read_text()
        tampered = out / "tampered.html"
        tampered.write_text(page.replace(
            "</body>", '<img id="far" src="http://127.0.0.1:9/pixel.png"></body>'))
        with _requests(browser) as urls:
            await _open(browser, tampered)
            await browser.wait_for("document.getElementById('far').complete", "the far image")
            await browser.evaluate("1")  # reads the events still on the way
        assert "http://127.0.0.1:9/pixel.png" in urls
