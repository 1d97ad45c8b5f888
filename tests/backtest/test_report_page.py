"""report.html in headless Chromium (driven by Playwright), opened from disk as a user would:
the chart shows, the figures read right, a transcript opens on a click, a trade's and a fill's
links lead to their decisions, and the page asks the network for nothing."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.async_api import Request, expect

from tests.backtest.test_report import make_record
from tests.operator.browser import BrowserPage, needs_chromium, open_page
from trading_agent.backtest.report import CHART_SIZE, write_report

pytestmark = [needs_chromium, pytest.mark.slow]


@contextmanager
def _requests(tab: BrowserPage) -> Iterator[list[str]]:
    """Collects the URL of every request the page sends while the block runs."""
    urls: list[str] = []

    def note(request: Request) -> None:
        urls.append(request.url)

    tab.page.on("request", note)
    try:
        yield urls
    finally:
        tab.page.remove_listener("request", note)


async def _click(tab: BrowserPage, selector: str) -> None:
    """A real left click on the element, scrolled into view first (near its left edge, where
    a summary's text is)."""
    target = tab.page.locator(selector)
    await target.scroll_into_view_if_needed()
    box = await target.bounding_box()
    assert box is not None, f"{selector} is not shown"
    await target.click(position={"x": min(box["width"] / 2, 40), "y": box["height"] / 2})


async def _open(tab: BrowserPage, page: Path) -> str:
    url = page.as_uri()  # tmp_path is absolute
    await tab.page.goto(url)
    await tab.wait_for(f"location.href === {json.dumps(url)} && "
                       "document.readyState === 'complete'", "the loaded report")
    return url


async def test_the_report_page_in_chromium(tmp_path: Path) -> None:
    out = tmp_path / "report"
    out.mkdir()
    record = make_record()
    figures = write_report(record, out)
    total_return = f"{figures.total_return * 100:+.2f}%"
    async with open_page() as tab:
        page = tab.page
        with _requests(tab) as urls:
            url = await _open(tab, out / "report.html")

            # The chart is decoded at its size.
            width, height = CHART_SIZE
            await tab.wait_for(
                "(() => { const i = document.querySelector('img.chart');"
                f" return i.complete && i.naturalWidth === {width}"
                f" && i.naturalHeight === {height}; }})()", "the decoded chart")
            # The figures table shows the total return.
            await expect(page.locator("#figures tr[data-figure=total_return] td")).to_have_text(
                total_return, use_inner_text=True)
            await expect(page.locator("#figures")).to_contain_text("Total return",
                                                                   use_inner_text=True)

            # A transcript is hidden until its summary is clicked.
            transcript = page.locator("#decision-3 ol.transcript")
            await expect(transcript).to_be_hidden()
            assert "limit must be at most 1000" not in await page.locator("body").inner_text()
            await _click(tab, "#decision-3 > summary")
            await expect(transcript).to_be_visible()
            text = await transcript.inner_text()
            assert "limit must be at most 1000" in text and "TOOL RESULT · ERROR" in text
            # The model's <script> is shown as text, never run.
            await _click(tab, "#decision-4 > summary")
            await expect(page.locator("#decision-4")).to_have_attribute("open", "")
            assert '<script>alert("owned")</script>' in await page.locator(
                "#decision-4 ol.transcript").inner_text()
            assert await page.evaluate("document.scripts.length") == 0

            # Each round trip shows its profit; a fill's link leads to the decision that
            # placed it, a trade's to the decisions that opened and closed it.
            first = record.trades[0]
            await expect(page.locator("table.trades tr[data-trade='1']")).to_contain_text(
                str(first.profit), use_inner_text=True)
            await _click(tab, "table.fills a[href='#decision-12']")
            await tab.wait_for("location.hash === '#decision-12'", "the fill's decision")
            await page.evaluate("window.scrollTo(0, 0)")
            await _click(tab, "table.trades a[href='#decision-5']")
            await tab.wait_for("location.hash === '#decision-5'", "the decision's anchor")
            await tab.wait_for(
                "(() => { const d = document.getElementById('decision-5');"
                " const top = d.getBoundingClientRect().top;"
                " return document.querySelector(':target') === d"
                " && top >= -1 && top < innerHeight / 2; })()", "decision 5 scrolled to")
            await page.screenshot(path=Path(os.environ.get("REPORT_SCREENSHOT_DIR",
                                                           str(tmp_path))) / "report-page.png")

            resources = await page.evaluate(
                "performance.getEntriesByType('resource').map(e => e.name)")
            assert not tab.console and not tab.errors, (tab.console, tab.errors)
        # The file itself and the chart's data URI, nothing else.
        assert url in urls
        others = [u for u in urls if u != url and not u.startswith("data:image/png;base64,")]
        assert others == [], others
        assert [r for r in resources if not r.startswith("data:")] == []

        # The check above would see a page that reached out (so it can fail).
        report = (out / "report.html").read_text()
        tampered = out / "tampered.html"
        tampered.write_text(report.replace(
            "</body>", '<img id="far" src="http://127.0.0.1:9/pixel.png"></body>'))
        with _requests(tab) as urls:
            await _open(tab, tampered)
            await tab.wait_for("document.getElementById('far').complete", "the far image")
        assert "http://127.0.0.1:9/pixel.png" in urls
