"""Webhooks against a local receiver: signed, retried with backoff, never holding a desk up,
and only the events each URL asked for.

The receiver is a small HTTP server on 127.0.0.1 that checks every signature itself (with
``hmac``, not the code under test), can fail its first requests, and can hold requests to
play a slow receiver.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs

from tests.scripted_server import Reply, ScriptedServer, ToolCall
from tests.tools.conftest import LIMITS, PAPER, packaged_candles
from trading_agent.agent import AgentLoop, Conversation, EventBus, ToolCallExecutor, Trigger
from trading_agent.agent.events import ErrorEvent
from trading_agent.agent.tool_registry import ToolRegistry
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.daemon.events import (
    DeskPaused,
    KillSwitchChanged,
    PinsChanged,
    ReduceOnlyChanged,
    SpendAlert,
    order_filled,
)
from trading_agent.errors import ConfigError
from trading_agent.operator.events import ApprovalRequested
from trading_agent.store.desk_books import SqliteDeskBooks
from trading_agent.store.memory_notes import SqliteMemory
from trading_agent.store.paper_books import SqlitePaperBooks
from trading_agent.telemetry.config import WEBHOOK_EVENTS, WebhookSettings
from trading_agent.telemetry.webhooks import Webhooks, open_webhooks, verify_signature
from trading_agent.tools import register_trading_tools
from trading_agent.trading.booked_exchange import BookedExchange
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.replay import ReplayFeed
from trading_agent.trading.risk import RiskPolicy

SECRET = "whsec-4f1c9a7e2b"
SECRET_ENV = "TEST_WEBHOOK_SECRET"
SECRET_PATH = "/hooks/T012/B034/pathtoken9876"
"""A path that is itself a credential (as Slack's are): it must never be logged."""


# --------------------------------------------------------------------------- the receiver


@dataclass
class Received:
    """One request as the receiver saw it."""

    path: str
    headers: dict[str, str]
    body: bytes
    signature_ok: bool

    @property
    def payload(self) -> dict[str, Any]:
        return dict(json.loads(self.body))

    @property
    def kind(self) -> str:
        return str(self.payload["kind"])


@dataclass
class Receiver:
    """A webhook receiver on loopback.

    Attributes:
        fail_first: Answer this many requests with ``failure_status`` first.
        failure_status: The status of those answers.
        hold: When set, each request waits for it before answering.
        secret: What signatures are checked with.
    """

    fail_first: int = 0
    failure_status: int = 500
    hold: threading.Event | None = None
    secret: bytes = SECRET.encode()
    requests: list[Received] = field(default_factory=list)
    arrived: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                headers = {k.lower(): v for k, v in self.headers.items()}
                timestamp = headers.get("x-trading-agent-timestamp", "")
                expected = "sha256=" + hmac.new(receiver.secret, timestamp.encode() + b"." + body,
                                                hashlib.sha256).hexdigest()
                fresh = timestamp.isdigit() and abs(time.time() - int(timestamp)) < 300
                ok = fresh and hmac.compare_digest(
                    expected, headers.get("x-trading-agent-signature", ""))
                with receiver._lock:
                    receiver.requests.append(Received(self.path, headers, body, ok))
                    failing = len(receiver.requests) <= receiver.fail_first
                receiver.arrived.set()
                if receiver.hold is not None:
                    receiver.hold.wait(10)
                status = receiver.failure_status if failing else (200 if ok else 401)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{SECRET_PATH}"
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self.hold is not None:
            self.hold.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)

    async def wait_for(self, count: int) -> list[Received]:
        """Waits until ``count`` requests arrived."""
        await _until(lambda: len(self.requests) >= count, f"{count} requests")
        return list(self.requests)


async def _until(condition: Callable[[], bool], what: str, within: float = 5.0) -> None:
    """Polls ``condition`` until it holds."""
    try:
        with anyio.fail_after(within):
            while True:
                if condition():
                    return
                await anyio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    """Receivers a test starts (``receivers.append(Receiver(...))``); all closed after it."""
    started: list[Receiver] = []
    yield started
    for receiver in started:
        receiver.close()


def _start(receivers: list[Receiver], **options: Any) -> Receiver:
    receiver = Receiver(**options)
    receivers.append(receiver)
    return receiver


def _hook(url: str, events: list[str] | None = None, **options: Any) -> WebhookSettings:
    return WebhookSettings.model_validate({
        "url": url, "events": events or list(WEBHOOK_EVENTS), "secret_env": SECRET_ENV,
        "timeout_seconds": 2, **options})


class Sleeps:
    """The backoff's sleep: records each wait and returns at once."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        await anyio.lowlevel.checkpoint()


@asynccontextmanager
async def serving(webhooks: Webhooks | None) -> AsyncIterator[Webhooks]:
    """Runs webhooks as the daemon does (a service in a task group), closing them after."""
    assert webhooks is not None
    async with anyio.create_task_group() as group:
        group.start_soon(webhooks.run)
        try:
            yield webhooks
        finally:
            await webhooks.aclose()


def _kill_switch(on: bool = True) -> KillSwitchChanged:
    return KillSwitchChanged(desk="*", on=on, by="alice", reason="drill",
                             text="kill switch ON (every desk): by alice: drill")


# --------------------------------------------------------------------------- the tests


async def test_a_delivery_is_signed_with_the_secret_and_cannot_be_replayed(
        receivers: list[Receiver]) -> None:
    receiver = _start(receivers)
    bus = EventBus()
    async with serving(open_webhooks([_hook(receiver.url, ["kill_switch"])], bus,
                                     environ={SECRET_ENV: SECRET})):
        published = bus.publish(_kill_switch())
        (request,) = await receiver.wait_for(1)
    assert request.signature_ok
    assert request.path == SECRET_PATH
    headers = request.headers
    assert headers["content-type"] == "application/json"
    assert headers["x-trading-agent-event"] == "kill_switch"
    assert headers["x-trading-agent-signature"].startswith("sha256=")
    payload = request.payload
    assert payload["kind"] == "kill_switch"
    assert payload["delivery_id"] == headers["x-trading-agent-delivery"]
    assert payload["summary"] == "kill switch ON (every desk): by alice: drill"
    assert payload["event"] == {**published.to_dict()}

    # What a receiver checks: the right secret, the same bytes, a recent timestamp.
    timestamp, signature = headers["x-trading-agent-timestamp"], headers[
        "x-trading-agent-signature"]
    now = float(timestamp)
    assert verify_signature(SECRET.encode(), request.body, timestamp, signature, now=now)
    assert not verify_signature(b"another secret", request.body, timestamp, signature, now=now)
    assert not verify_signature(SECRET.encode(), request.body.replace(b"alice", b"mallory"),
                                timestamp, signature, now=now)
    assert not verify_signature(SECRET.encode(), request.body, timestamp, signature,
                                now=now + 3600)  # replayed an hour later
    assert not verify_signature(SECRET.encode(), request.body, str(int(now) + 1), signature,
                                now=now)  # a timestamp changed to look fresh


async def test_a_failing_receiver_is_retried_with_backoff_until_it_accepts(
        receivers: list[Receiver]) -> None:
    receiver = _start(receivers, fail_first=2)
    bus = EventBus()
    sleeps = Sleeps()
    with capture_logs() as logs:
        async with serving(open_webhooks(
                [_hook(receiver.url, max_attempts=4, first_backoff_seconds=0.5)], bus,
                environ={SECRET_ENV: SECRET}, sleep=sleeps)) as webhooks:
            bus.publish(_kill_switch())
            requests = await receiver.wait_for(3)
            await _until(lambda: webhooks.stats[0].delivered == 1, "the delivery")

    assert len(requests) == 3 and all(r.signature_ok for r in requests)
    assert len({r.headers["x-trading-agent-delivery"] for r in requests}) == 1
    assert sleeps.waits == [0.5, 1.0]  # doubling
    stats = webhooks.stats[0]
    assert (stats.delivered, stats.retries, stats.failed, stats.dropped) == (1, 2, 0, 0)
    retries = [line for line in logs if line["event"] == "webhook_retry"]
    assert [(r["attempt"], r["error"]) for r in retries] == [
        (1, "the receiver answered 500"), (2, "the receiver answered 500")]
    assert all(r["webhook"] == receiver.url.removesuffix(SECRET_PATH) for r in retries)
    _assert_no_secrets(logs)


async def test_it_gives_up_after_max_attempts_and_never_retries_a_refusal(
        receivers: list[Receiver]) -> None:
    down = _start(receivers, fail_first=100, failure_status=503)
    refusing = _start(receivers, fail_first=100, failure_status=400)
    bus = EventBus()
    sleeps = Sleeps()
    with capture_logs() as logs:
        async with serving(open_webhooks(
                [_hook(down.url, max_attempts=3), _hook(refusing.url, max_attempts=3),
                 _hook("http://127.0.0.1:9/nothing-listens", max_attempts=2)],
                bus, environ={SECRET_ENV: SECRET}, sleep=sleeps)) as webhooks:
            bus.publish(_kill_switch())
            await _until(lambda: sum(s.failed for s in webhooks.stats) == 3,
                         "three failures")

    assert len(down.requests) == 3
    assert len(refusing.requests) == 1
    failures = {line["webhook"]: line for line in logs if line["event"] == "webhook_failed"}
    assert failures[down.url.removesuffix(SECRET_PATH)]["attempts"] == 3
    assert failures[refusing.url.removesuffix(SECRET_PATH)]["error"] == (
        "the receiver answered 400")
    refused = failures["http://127.0.0.1:9"]
    assert refused["attempts"] == 2 and refused["error"].startswith("ConnectError")
    _assert_no_secrets(logs)


async def test_a_slow_receiver_never_holds_up_the_desks_or_the_other_webhooks(
        receivers: list[Receiver]) -> None:
    slow = _start(receivers, hold=threading.Event())
    fast = _start(receivers)
    bus = EventBus()

    def alert(index: int) -> SpendAlert:
        return SpendAlert(desk="alpha", scope="desk", measure="tokens", used=index, cap=100,
                          share=index / 100, text=f"alert {index}")

    with capture_logs() as logs:
        async with serving(open_webhooks(
                [_hook(slow.url, ["spend_alert"], max_queued=3),
                 _hook(fast.url, ["spend_alert"])],
                bus, environ={SECRET_ENV: SECRET})) as webhooks:
            bus.publish(alert(0))
            # The slow receiver now holds that request.
            await _until(slow.arrived.is_set, "the slow receiver's first request")
            started = time.perf_counter()
            for index in range(1, 41):
                bus.publish(alert(index))
            publishing = time.perf_counter() - started
            # The fast receiver gets all 41 while the slow one still holds the first.
            await fast.wait_for(41)
            assert len(slow.requests) == 1
            assert webhooks.stats[0].dropped == 40 - 3  # its queue holds 3 behind the held one
            assert webhooks.stats[1].dropped == 0
            # Released, the slow receiver gets the held one and the three queued, in order.
            assert slow.hold is not None
            slow.hold.set()
            received = await slow.wait_for(4)

    assert publishing < 0.5
    assert [r.payload["event"]["used"] for r in fast.requests] == list(range(41))
    assert [r.payload["event"]["used"] for r in received] == [0, 1, 2, 3]
    drops = [line for line in logs if line["event"] == "webhook_events_dropped"]
    assert len(drops) == 1 and drops[0]["webhook"] == slow.url.removesuffix(SECRET_PATH)
    assert drops[0]["dropped_total"] == 1  # logged at the first drop, then at most every 10 s


async def test_only_the_events_a_webhook_asked_for_arrive(
        receivers: list[Receiver], scripted_server: ScriptedServer, tmp_path: Path) -> None:
    fills = _start(receivers)
    everything = _start(receivers)
    bus = EventBus()
    async with serving(open_webhooks([_hook(fills.url, ["fill", "desk_paused"]),
                                      _hook(everything.url)], bus,
                                     environ={SECRET_ENV: SECRET})):
        await _a_desk_trades_and_the_daemon_alerts(bus, scripted_server, tmp_path)
        all_kinds = ["fill", "approval_requested", "kill_switch", "desk_paused", "spend_alert",
                     "error"]
        received = await everything.wait_for(len(all_kinds))
        chosen = await fills.wait_for(2)
        await anyio.sleep(0.1)  # nothing else comes

    assert [r.kind for r in received] == all_kinds
    assert [r.kind for r in fills.requests] == ["fill", "desk_paused"]
    fill = chosen[0].payload
    assert re.match(r"alpha: Order P\d filled: bought 0\.1 BTC on BTC/USDT at ", fill["summary"])
    assert fill["event"]["type"] == "order_filled" and fill["event"]["order_id"] == "P1"
    assert fill["event"]["amount"] == "0.1" and fill["event"]["fee_currency"] == "USDT"
    assert all(r.signature_ok for r in received + chosen)


async def _a_desk_trades_and_the_daemon_alerts(bus: EventBus, scripted_server: ScriptedServer,
                                               tmp_path: Path) -> None:
    """A desk's real turn on a paper exchange (a market buy fills at once, a limit order
    rests: not a fill, a ticker is read: not a fill), then what the daemon publishes."""
    scripted_server.add(
        Reply(tool_calls=[
            ToolCall("place_order", {"symbol": "BTC/USDT", "side": "buy", "type": "market",
                                     "amount": "0.1"}, id="buy"),
            ToolCall("place_order", {"symbol": "BTC/USDT", "side": "buy", "type": "limit",
                                     "amount": "0.01", "price": "15000"}, id="rest"),
            ToolCall("get_ticker", {"symbol": "BTC/USDT"}, id="look")]),
        Reply("Bought 0.1 BTC; a bid rests at 15,000."),
    )
    async with _paper_desk(tmp_path, scripted_server, bus) as loop:
        await loop.run_turn(Conversation("You trade BTC."), Trigger("tick", "moved"))
    bus.publish(ApprovalRequested(desk="alpha", approval_id="a1", call_id="c9",
                                  tool="place_order", arguments="{}", reason="a live order",
                                  notional=1600.0, expires_at=time.time() + 60))
    bus.publish(_kill_switch())
    bus.publish(DeskPaused(desk="alpha", by="spend cap", reason="daily tokens used up"))
    bus.publish(SpendAlert(desk="alpha", scope="desk", measure="tokens", used=90, cap=100,
                           share=0.9, text="alpha used 90% of its daily tokens"))
    bus.publish(ErrorEvent(desk="alpha", message="the model is unavailable",
                           error_type="BackendUnavailableError"))


async def test_a_secret_in_an_event_never_leaves_the_daemon(
        receivers: list[Receiver]) -> None:
    receiver = _start(receivers)
    bus = EventBus()
    api_key = "sk-live-0123456789abcdef"
    async with serving(open_webhooks([_hook(receiver.url, ["error"])], bus,
                                     environ={SECRET_ENV: SECRET}, redact={api_key})):
        bus.publish(ErrorEvent(desk="alpha", error_type="BackendError",
                               message=f"the server refused key {api_key}"))
        (request,) = await receiver.wait_for(1)

    assert api_key.encode() not in request.body
    assert request.payload["event"]["message"] == "the server refused key [REDACTED]"
    assert request.payload["summary"] == "alpha: the server refused key [REDACTED]"
    assert request.signature_ok


async def test_what_is_queued_when_the_daemon_stops_is_still_sent(
        receivers: list[Receiver]) -> None:
    receiver = _start(receivers)
    bus = EventBus()
    webhooks = open_webhooks([_hook(receiver.url, ["kill_switch"])], bus,
                             environ={SECRET_ENV: SECRET})
    assert webhooks is not None
    async with anyio.create_task_group() as group:  # the service runs, then is cancelled
        group.start_soon(webhooks.run)
        await anyio.lowlevel.checkpoint()
        group.cancel_scope.cancel()
    bus.publish(_kill_switch())  # in the last moment, after the services stopped
    await webhooks.aclose()

    assert [r.kind for r in receiver.requests] == ["kill_switch"]
    assert receiver.requests[0].signature_ok
    assert webhooks.stats[0].delivered == 1


def test_a_missing_secret_or_a_bad_setting_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=f"webhooks\\[0\\].secret_env: the environment "
                                          f"variable {SECRET_ENV} is not set") as raised:
        open_webhooks([_hook("https://hooks.example.com" + SECRET_PATH)], EventBus(),
                      environ={})
    assert SECRET_PATH not in str(raised.value)
    assert open_webhooks([], EventBus(), environ={}) is None
    with pytest.raises(ValidationError, match="http:// or https:// URL") as bad_url:
        _hook("ftp://hooks.example.com" + SECRET_PATH)
    assert SECRET_PATH not in str(bad_url.value).split("input_value")[0]
    with pytest.raises(ValidationError, match="fills"):
        _hook("https://hooks.example.com", ["fills"])
    with pytest.raises(ValidationError, match="not true or false"):
        _hook("https://hooks.example.com", max_attempts=True)


def _assert_no_secrets(logs: Sequence[Mapping[str, Any]]) -> None:
    text = json.dumps(logs, default=str)
    assert SECRET not in text
    assert "pathtoken9876" not in text


class _PaperDesk:
    """A loop whose tools trade on a paper exchange over the packaged candles."""

    def __init__(self, tmp_path: Path, server: ScriptedServer, bus: EventBus) -> None:
        self.tmp_path, self.server, self.bus = tmp_path, server, bus

    async def __aenter__(self) -> AgentLoop:
        feed = ReplayFeed({"BTC/USDT": list(packaged_candles())}, speed=0, start_offset=300)
        database = self.tmp_path / "desk.sqlite3"
        self.paper = await PaperExchange.open(PAPER, feed, await SqlitePaperBooks.open(database,
                                                                                       "alpha"))
        self.books = await SqliteDeskBooks.open(database, "alpha")
        # The desk's view of it, as the daemon builds it: every fill its books count is
        # announced on the bus.
        exchange = BookedExchange(self.paper, self.books)
        exchange.on_fill = lambda fill: self.bus.publish(order_filled("alpha", fill))
        self.memory = await SqliteMemory.open(database, "alpha", clock=feed.now)
        registry = register_trading_tools(
            ToolRegistry(), exchange=exchange, risk_policy=RiskPolicy(LIMITS, exchange),
            symbols=["BTC/USDT"], memory=self.memory)
        self.backend = OpenAICompatibleBackend(OpenAIBackendConfig(
            base_url=self.server.base_url, model="scripted-model", context_window=32_000,
            request_timeout=2.0))
        return AgentLoop("alpha", self.backend, ToolCallExecutor(registry), self.bus,
                         maximum_rounds=4)

    async def __aexit__(self, *exc: object) -> None:
        await self.backend.aclose()
        await self.memory.close()
        await self.books.close()
        await self.paper.close()


def _paper_desk(tmp_path: Path, server: ScriptedServer, bus: EventBus) -> _PaperDesk:
    return _PaperDesk(tmp_path, server, bus)


async def test_a_desk_going_into_reduce_only_and_out_reaches_a_webhook_that_asks_for_it(
        receivers: list[Receiver]) -> None:
    receiver = _start(receivers)
    bus = EventBus()
    async with serving(open_webhooks([_hook(receiver.url, ["reduce_only"])], bus,
                                     environ={SECRET_ENV: SECRET})):
        bus.publish(_kill_switch())  # not asked for
        bus.publish(ReduceOnlyChanged(
            desk="alpha", on=True, by="protection stoploss_guard",
            reason="3 round trips closed by their stop loss", until="2024-01-01T12:00:00+00:00",
            protection="stoploss_guard",
            text="REDUCE-ONLY ON (alpha): reduce-only by protection stoploss_guard at ..."))
        bus.publish(ReduceOnlyChanged(desk="alpha", on=False, by="ann", reason="x",
                                      text="reduce-only off (alpha) by ann; it was ..."))
        on, off = await receiver.wait_for(2)
    assert [r.kind for r in (on, off)] == ["reduce_only", "reduce_only"]
    assert on.payload["summary"] == ("alpha: REDUCE-ONLY ON (alpha): reduce-only by protection "
                                     "stoploss_guard at ...")
    assert on.payload["event"]["protection"] == "stoploss_guard"
    assert on.payload["event"]["until"] == "2024-01-01T12:00:00+00:00"
    assert off.payload["event"]["on"] is False and off.payload["event"]["by"] == "ann"


async def test_a_pin_put_on_and_taken_off_reaches_a_webhook_that_asks_for_pins_changed(
        receivers: list[Receiver]) -> None:
    receiver = _start(receivers)
    bus = EventBus()
    rule = "Never hold more than 0.1 BTC.\nClose everything before the FOMC."
    async with serving(open_webhooks([_hook(receiver.url, ["pins_changed"])], bus,
                                     environ={SECRET_ENV: SECRET})):
        bus.publish(_kill_switch())  # not asked for
        bus.publish(PinsChanged(desk="alpha", action="pinned", by="ann", pin_id=3,
                                pin_text=rule, pins=1,
                                text=f"ann pinned #3: {rule} (1 pin)"))
        bus.publish(PinsChanged(desk="alpha", action="unpinned", by="bob", pin_id=3,
                                pin_text=rule, pins=0,
                                text=f"bob unpinned #3 (pinned by ann): {rule} (0 pins)"))
        pinned, unpinned = await receiver.wait_for(2)
    assert [r.kind for r in (pinned, unpinned)] == ["pins_changed", "pins_changed"]
    assert pinned.payload["desk"] == "alpha"
    assert pinned.payload["summary"] == "alpha: ann pinned #3: Never hold more than 0.1 BTC."
    event = pinned.payload["event"]
    assert (event["action"], event["by"], event["desk"], event["pin_id"], event["pin_text"]) == (
        "pinned", "ann", "alpha", 3, rule)
    assert unpinned.payload["event"]["action"] == "unpinned"
    assert unpinned.payload["event"]["by"] == "bob" and unpinned.payload["event"]["pins"] == 0
