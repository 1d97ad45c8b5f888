"""The web page's event stream outlives its ticket: when the stream drops after the ticket
expired, the browser's own reconnection is refused, and the page asks for a new ticket and
is live again (headless Chromium driven by Playwright, a real API on loopback)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.abc
import httpx
import pytest
from playwright.async_api import Response, expect

from tests.operator.browser import needs_chromium, open_page
from tests.operator.harness import build_control, running_api
from tests.scripted_server import Reply, ScriptedServer
from tests.waiting import wait_until
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.config import OperatorConfig

TOKEN = "web-test-token-0123456789abcdef"
TICKET_SECONDS = 2.0
"""The tickets' lifetime in this test (a minute in the daemon)."""

pytestmark = [needs_chromium, pytest.mark.slow]

_GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError)
"""How a relayed connection ends when either side goes."""


class _CuttableProxy:
    """A TCP relay on loopback in front of the API, whose connections the test can cut, as
    a network blip or a laptop's sleep would."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = 0
        self._scopes: set[anyio.CancelScope] = set()

    async def _relay(self, client: anyio.abc.SocketStream) -> None:
        with anyio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                async with client, await anyio.connect_tcp(*self.upstream) as server:
                    async def pump(source: anyio.abc.SocketStream,
                                   sink: anyio.abc.SocketStream) -> None:
                        with contextlib.suppress(*_GONE):
                            async for chunk in source:
                                await sink.send(chunk)
                        group.cancel_scope.cancel()

                    async with anyio.create_task_group() as group:
                        group.start_soon(pump, client, server)
                        group.start_soon(pump, server, client)
            except _GONE:
                pass
            finally:
                self._scopes.discard(scope)

    def cut(self) -> int:
        """Closes every connection open now; returns how many."""
        scopes = list(self._scopes)
        for scope in scopes:
            scope.cancel()
        return len(scopes)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[_CuttableProxy]:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as group:
            group.start_soon(listener.serve, self._relay)
            try:
                yield self
            finally:
                group.cancel_scope.cancel()


def _ticket(url: str) -> str:
    return parse_qs(urlsplit(url).query).get("ticket", [""])[0]


async def test_the_page_renews_its_stream_ticket_when_the_stream_reconnects_after_it_expired(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("BTC holds 64,000."))
    control, _ = build_control(scripted_server.base_url)
    config = OperatorConfig(tcp_address="127.0.0.1:0")
    async with running_api(control, ApprovalBook(), config, state_dir,
                           environ={"TRADING_AGENT_OPERATOR_TOKEN": TOKEN},
                           ticket_seconds=TICKET_SECONDS) as (endpoints, _), \
            httpx.AsyncClient(base_url=str(endpoints.url), timeout=10,
                              headers={"Authorization": f"Bearer {TOKEN}"}) as api:
        assert endpoints.tcp is not None
        async with _CuttableProxy(endpoints.tcp).running() as proxy, open_page() as tab:
            page = tab.page
            streams: list[tuple[str, int | None]] = []  # (ticket, status) of each attempt

            def on_response(response: Response) -> None:
                if urlsplit(response.url).path == "/api/events":
                    streams.append((_ticket(response.url), response.status))

            page.on("response", on_response)
            await page.goto(f"http://127.0.0.1:{proxy.port}/?desk=alpha#token={TOKEN}")
            await expect(page.locator("body")).to_have_attribute("data-live", "true")
            await wait_until(lambda: any(s == 200 for _, s in streams),
                             "the page's stream to open")
            # On a loaded machine the page's first ticket can expire before its stream
            # opens; the page then takes another at once: the ticket that matters is the
            # one the live stream holds.
            first_ticket = next(t for t, s in streams if s == 200)
            assert first_ticket, streams

            async def expired() -> bool:  # asked with the ticket alone, as the browser does
                async with httpx.AsyncClient(base_url=str(endpoints.url), timeout=10) as bare, \
                        bare.stream("GET", "/api/events",
                                    params={"ticket": first_ticket}) as answer:
                    return answer.status_code == 401

            await wait_until(expired, "the page's ticket to expire", within=10, step=0.1)
            assert await page.locator("body").get_attribute("data-live") == "true"

            cut_at = len(streams)
            assert proxy.cut() >= 1
            # The browser retries the same URL (refused: its ticket expired), then the page
            # asks for a new ticket and opens the stream with it.
            await wait_until(lambda: (first_ticket, 401) in streams[cut_at:],
                             "the browser's retry with the expired ticket to be refused",
                             within=15, step=0.05)
            await wait_until(lambda: any(t != first_ticket and s == 200
                                         for t, s in streams[cut_at:]),
                             "the page to open the stream with a new ticket", within=15,
                             step=0.05)
            await expect(page.locator("body")).to_have_attribute("data-live", "true")

            # Live for real: what happens now reaches the page.
            sent = await api.post("/api/desks/alpha/messages", json={"text": "How is BTC?"})
            assert sent.status_code in (200, 202), sent.text
            await expect(page.locator("#log")).to_contain_text("BTC holds 64,000.",
                                                               use_inner_text=True)
            assert not tab.errors, tab.errors
    scripted_server.assert_complete()
