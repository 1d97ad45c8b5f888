"""Headless Chromium for the browser tests: Playwright driving Debian's ``chromium``.

Playwright launches the system's browser (``executable_path``) and downloads nothing, so the
tests need only ``chromium`` (``scripts/ensure-test-tools.sh`` installs it) and skip, saying
so, without it. Tests wait on what the page shows (Playwright's ``expect``, or
:meth:`BrowserPage.wait_for` for a condition no locator states), never on sleeps.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from playwright.async_api import ConsoleMessage, Page, async_playwright, expect
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import TimeoutError as PlaywrightTimeoutError

__all__ = ["CHROMIUM", "WAIT_MS", "BrowserPage", "needs_chromium", "open_page"]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
"""Debian's chromium, when installed."""

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (scripts/ensure-test-tools.sh installs it with apt-get "
           "as root)")
"""Skips a test (or, as ``pytestmark``, a module) when there is no chromium to drive."""

WAIT_MS = 10_000
"""How long a wait for the page lasts before the test fails (``expect`` too)."""

expect.set_options(timeout=WAIT_MS)

_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
          "--disable-component-update", "--disable-sync", "--disable-extensions",
          "--disable-default-apps", "--hide-scrollbars", "--force-color-profile=srgb"]


@dataclass
class BrowserPage:
    """A page of a headless Chromium, with what it logged.

    Attributes:
        page: The Playwright page.
        console: The page's console messages, as ``console.TYPE: TEXT``.
        errors: Its uncaught exceptions.
    """

    page: Page
    console: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    async def wait_for(self, expression: str, what: str) -> Any:
        """Waits until a JavaScript expression is truthy and returns its value.

        Args:
            expression: The condition; one that throws (the page still loading, an element
                not there yet) counts as not yet.
            what: What the page should show, for the failure message.

        Raises:
            AssertionError: Not within :data:`WAIT_MS`, with the page's text and errors.
        """
        guarded = f"() => {{ try {{ return ({expression}); }} catch (e) {{ return false; }} }}"
        try:
            handle = await self.page.wait_for_function(guarded, timeout=WAIT_MS, polling=50)
        except PlaywrightTimeoutError:
            text = await self.page.locator("body").inner_text()
            raise AssertionError(f"the page never showed {what}; errors: {self.errors}; "
                                 f"console: {self.console}; text:\n{text}") from None
        return await handle.json_value()

    def _console(self, message: ConsoleMessage) -> None:
        self.console.append(f"console.{message.type}: {message.text}")

    def _error(self, error: PlaywrightError) -> None:
        self.errors.append(f"{error.name}: {error.message}")


@contextlib.asynccontextmanager
async def open_page(width: int = 1360, height: int = 880) -> AsyncIterator[BrowserPage]:
    """Starts headless Chromium in a fresh profile and yields a page; stops it after.

    Args:
        width: The viewport's width in CSS pixels.
        height: Its height.
    """
    assert CHROMIUM is not None, "mark the test needs_chromium"
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=_FLAGS)
        try:
            context = await browser.new_context(viewport={"width": width, "height": height},
                                                device_scale_factor=1)
            tab = BrowserPage(await context.new_page())
            tab.page.on("console", tab._console)
            tab.page.on("pageerror", tab._error)
            yield tab
        finally:
            await browser.close()
