"""Webhooks: chosen events POSTed as signed JSON to the URLs an operator configured.

Each ``[[webhooks]]`` entry names the events it wants (see
:data:`~trading_agent.telemetry.config.WebhookEvent`). The daemon's bus hands them over
without ever waiting: each URL has a bounded queue of its own, and when a receiver is slow or
down its queue fills and new events for it are dropped, counted and logged, while the desks
and the other URLs go on.

**A delivery** is one POST of a JSON body::

    {"kind": "fill", "delivery_id": "3f0c...", "desk": "alpha", "at": 1717171717.25,
     "summary": "alpha: Order 7 filled: bought 0.01 BTC on BTC/USDT at 64,000.00 (market).",
     "event": {"type": "tool_result", "desk": "alpha", "turn": "...", ...}}

``event`` is the bus event as the store and the event stream show it. Configured secret
values are replaced by ``[REDACTED]`` wherever they appear in it.

**Headers**: ``Content-Type: application/json``; ``X-Trading-Agent-Event`` (the kind);
``X-Trading-Agent-Delivery`` (the same on every attempt of one delivery: a receiver drops
repeats by it); ``X-Trading-Agent-Timestamp`` (Unix seconds of this attempt); and
``X-Trading-Agent-Signature: sha256=<hex>``, the HMAC-SHA256, keyed with the secret from
``secret_env``, of ``<timestamp>.<body>`` (the timestamp header's text, a dot, then the raw
body bytes). A receiver recomputes it over the bytes it got, compares in constant time, and
refuses a timestamp more than five minutes from its clock, so a captured request cannot be
replayed later (:func:`verify_signature` does all three).

**Retries**: a 5xx, 408 or 429 answer, a timeout (``timeout_seconds`` per attempt) or a
connection that fails is tried again after ``first_backoff_seconds``, doubling each time up
to a minute (a ``Retry-After`` of at most a minute is honoured), until ``max_attempts``
attempts were made; then the delivery is logged as failed. Any other answer (a 4xx: the
receiver refuses it) is logged and not retried. Redirects are not followed.

Logs name a webhook by its URL's scheme and host only (many webhook URLs carry a credential
in their path), and never show a secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import anyio
import httpx
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from trading_agent.agent.event_bus import EventBus, Subscription
from trading_agent.agent.events import ErrorEvent, Event, EventsDropped
from trading_agent.daemon.events import (
    DeskPaused,
    KillSwitchChanged,
    PinsChanged,
    ReduceOnlyChanged,
    SpendAlert,
    StorageChanged,
)
from trading_agent.errors import ConfigError
from trading_agent.operator.events import ApprovalRequested
from trading_agent.telemetry.config import WebhookEvent, WebhookSettings

__all__ = ["DELIVERY_HEADER", "EVENT_HEADER", "SIGNATURE_HEADER", "TIMESTAMP_HEADER",
           "Delivery", "WebhookStats", "Webhooks", "open_webhooks", "sign", "verify_signature",
           "webhook_kind"]

_log = structlog.get_logger(__name__)

SIGNATURE_HEADER = "X-Trading-Agent-Signature"
TIMESTAMP_HEADER = "X-Trading-Agent-Timestamp"
DELIVERY_HEADER = "X-Trading-Agent-Delivery"
EVENT_HEADER = "X-Trading-Agent-Event"

_MAX_BACKOFF_SECONDS = 60.0
_RETRIED_STATUSES = frozenset({408, 429})
_SUBSCRIPTION_BUFFER = 10_000
_DROP_LOG_SECONDS = 10.0
"""A webhook's drops are logged at most this often (with the running count)."""
_DRAIN_SECONDS = 2.0
"""How long a stopping daemon spends sending what is queued (one attempt each)."""
_REDACTED = "[REDACTED]"
_ORDER_FILLED = "order_filled"
"""The type of a fill event on the bus: every fill a desk's books count, at once or later."""

Sleep = Callable[[float], Awaitable[None]]


def sign(secret: bytes, timestamp: str, body: bytes) -> str:
    """The signature header's value for one attempt.

    Args:
        secret: The webhook's secret.
        timestamp: The timestamp header's text (Unix seconds).
        body: The raw body.

    Returns:
        ``sha256=`` and the hex HMAC-SHA256 of ``<timestamp>.<body>``.
    """
    digest = hmac.new(secret, timestamp.encode("ascii") + b"." + body, hashlib.sha256)
    return "sha256=" + digest.hexdigest()


def verify_signature(secret: bytes, body: bytes, timestamp: str, signature: str, *,
                     now: float | None = None, tolerance_seconds: float = 300.0) -> bool:
    """What a receiver checks: the signature matches and the timestamp is recent.

    Args:
        secret: The shared secret.
        body: The body as received.
        timestamp: The ``X-Trading-Agent-Timestamp`` header.
        signature: The ``X-Trading-Agent-Signature`` header.
        now: The receiver's time (``time.time()`` by default).
        tolerance_seconds: How far the timestamp may be from ``now``.

    Returns:
        True when both hold.
    """
    try:
        sent_at = int(timestamp)
    except ValueError:
        return False
    now = time.time() if now is None else now
    if abs(now - sent_at) > tolerance_seconds:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


def webhook_kind(event: Event) -> WebhookEvent | None:
    """Which webhook event a bus event is, if any.

    Args:
        event: An event of the daemon's bus.

    Returns:
        Its kind, or None when no webhook can ask for it.
    """
    if event.type == _ORDER_FILLED:
        return "fill"
    if isinstance(event, ApprovalRequested):
        return "approval_requested"
    if isinstance(event, KillSwitchChanged):
        return "kill_switch"
    if isinstance(event, DeskPaused):
        return "desk_paused"
    if isinstance(event, ErrorEvent):
        return "error"
    if isinstance(event, SpendAlert):
        return "spend_alert"
    if isinstance(event, ReduceOnlyChanged):
        return "reduce_only"
    if isinstance(event, StorageChanged):
        return "storage"
    if isinstance(event, PinsChanged):
        return "pins_changed"
    return None


def _summary(kind: WebhookEvent, event: Event) -> str:
    """One readable line (a chat notifier can post it as it is)."""
    text = getattr(event, "text", None)
    if isinstance(event, ApprovalRequested):
        return (f"{event.desk}: {event.tool} waits for approval ({event.reason}); approve or "
                f"deny {event.approval_id}")
    if isinstance(event, DeskPaused):
        return f"{event.desk} paused by {event.by}: {event.reason}"
    if isinstance(event, ErrorEvent):
        return f"{event.desk}: {event.message}"
    if isinstance(text, str) and text:
        first = text.strip().splitlines()[0] if text.strip() else ""
        return first if event.desk == "*" else f"{event.desk}: {first}"
    return f"{event.desk}: {kind}"


@dataclass(frozen=True)
class Delivery:
    """One event to POST to one webhook.

    Attributes:
        kind: The webhook event.
        delivery_id: Sent on every attempt, so a receiver can drop repeats.
        event_id: The bus event's id (for the logs).
        body: The JSON body, as sent and signed.
    """

    kind: WebhookEvent
    delivery_id: str
    event_id: int
    body: bytes


@dataclass
class WebhookStats:
    """What happened to one webhook's events.

    Attributes:
        target: Its URL's scheme and host.
        delivered: Accepted by the receiver (a 2xx answer).
        failed: Given up: refused, or still failing after every attempt.
        dropped: Never sent: its queue was full.
        retries: Attempts after a first one failed.
    """

    target: str
    delivered: int = 0
    failed: int = 0
    dropped: int = 0
    retries: int = 0


@dataclass
class _Hook:
    settings: WebhookSettings
    secret: bytes
    stats: WebhookStats
    send: MemoryObjectSendStream[Delivery]
    receive: MemoryObjectReceiveStream[Delivery]
    last_drop_log: float = field(default=float("-inf"))


class _Failure(Exception):
    """One attempt failed; ``retry`` says whether another may succeed."""

    def __init__(self, reason: str, *, retry: bool, wait: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry = retry
        self.wait = wait


class Webhooks:
    """The daemon's webhooks, fed from a bus subscription.

    Run :meth:`run` as one of the daemon's services; :meth:`aclose` when it stops.

    Args:
        hooks: The ``[[webhooks]]`` settings.
        secrets: Each webhook's secret, in the same order.
        subscription: The bus subscription the events come from.
        redact: Secret values to replace in the payloads.
        client: The HTTP client (one of its own by default, closed by :meth:`aclose`).
        sleep: The backoff's sleep (tests pass one that records).
        clock: The signature's clock.
    """

    def __init__(self, hooks: Sequence[WebhookSettings], secrets: Sequence[bytes],
                 subscription: Subscription, *, redact: Collection[str] = (),
                 client: httpx.AsyncClient | None = None, sleep: Sleep = anyio.sleep,
                 clock: Callable[[], float] = time.time) -> None:
        if len(secrets) != len(hooks):
            raise ValueError("one secret per webhook")
        self.subscription = subscription
        self._hooks: list[_Hook] = []
        for settings, secret in zip(hooks, secrets, strict=True):
            send, receive = anyio.create_memory_object_stream[Delivery](settings.max_queued)
            self._hooks.append(_Hook(settings, secret, WebhookStats(settings.target()),
                                     send, receive))
        self._redact = sorted({s for s in redact if s}, key=len, reverse=True)
        self._own_client = client is None
        self._client = client if client is not None else httpx.AsyncClient(
            follow_redirects=False, headers={"User-Agent": "trading-agent-webhooks"})
        self._sleep = sleep
        self._clock = clock
        self._closed = False
        self._run_scope: anyio.CancelScope | None = None
        self._run_done = anyio.Event()

    @classmethod
    def on_bus(cls, hooks: Sequence[WebhookSettings], secrets: Sequence[bytes], bus: EventBus,
               **options: Any) -> Webhooks:
        """Subscribes to the events any of the webhooks wants.

        Args:
            hooks: The ``[[webhooks]]`` settings.
            secrets: Each webhook's secret, in the same order.
            bus: The daemon's bus.
            **options: ``redact``, ``client``, ``sleep``, ``clock`` (see the class).

        Returns:
            The webhooks, subscribed (events wait until :meth:`run` reads them).
        """
        wanted = {kind for hook in hooks for kind in hook.events}
        subscription = bus.subscribe("webhooks", max_buffer=_SUBSCRIPTION_BUFFER,
                                     accept=lambda e: webhook_kind(e) in wanted)
        return cls(hooks, secrets, subscription, **options)

    @property
    def stats(self) -> list[WebhookStats]:
        """Each webhook's counts, in config order."""
        return [hook.stats for hook in self._hooks]

    async def run(self) -> None:
        """Routes events to the webhooks' queues and delivers them, until :meth:`aclose`
        (a daemon service; it may be cancelled, or run again after a failure)."""
        done = self._run_done = anyio.Event()
        try:
            async with anyio.create_task_group() as group:
                self._run_scope = group.cancel_scope
                for hook in self._hooks:
                    group.start_soon(self._deliver_queue, hook)
                async for event in self.subscription:
                    self._route(event)
                # Closed by aclose(), which also closed the queues' sending ends: the
                # senders end once what is queued is sent (or aclose's deadline passes).
        finally:
            self._run_scope = None
            done.set()

    def _route(self, event: Event) -> None:
        """Puts an event in the queue of every webhook that wants it; never waits."""
        if isinstance(event, EventsDropped):
            _log.warning("webhook_events_missed", count=event.count,
                         reason="the webhooks' bus subscription fell behind")
            return
        kind = webhook_kind(event)
        if kind is None:
            return
        for hook in self._hooks:
            if kind not in hook.settings.events:
                continue
            try:
                hook.send.send_nowait(self._delivery(kind, event))
            except anyio.WouldBlock:
                hook.stats.dropped += 1
                now = self._clock()
                if now - hook.last_drop_log >= _DROP_LOG_SECONDS:
                    hook.last_drop_log = now
                    _log.warning("webhook_events_dropped", webhook=hook.stats.target,
                                 kind=kind, dropped_total=hook.stats.dropped,
                                 queued=hook.settings.max_queued,
                                 reason="the receiver is slower than the events come")

    def _delivery(self, kind: WebhookEvent, event: Event) -> Delivery:
        delivery_id = uuid.uuid4().hex
        payload = {"kind": kind, "delivery_id": delivery_id, "desk": event.desk,
                   "at": event.at, "summary": _summary(kind, event),
                   "event": event.to_dict()}
        body = json.dumps(self._redacted(payload), ensure_ascii=False,
                          separators=(",", ":"), default=str).encode("utf-8")
        return Delivery(kind, delivery_id, event.id, body)

    def _redacted(self, value: Any) -> Any:
        if isinstance(value, str):
            for secret in self._redact:
                value = value.replace(secret, _REDACTED)
            return value
        if isinstance(value, Mapping):
            return {k: self._redacted(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._redacted(v) for v in value]
        return value

    async def _deliver_queue(self, hook: _Hook) -> None:
        async for delivery in hook.receive:
            await self._deliver(hook, delivery, hook.settings.max_attempts)

    async def _deliver(self, hook: _Hook, delivery: Delivery, attempts: int) -> None:
        """Posts one delivery, retrying with backoff; logs how it ended."""
        settings = hook.settings
        for attempt in range(1, attempts + 1):
            try:
                await self._attempt(hook, delivery)
            except _Failure as failure:
                if not failure.retry or attempt == attempts:
                    hook.stats.failed += 1
                    _log.error("webhook_failed", webhook=hook.stats.target, kind=delivery.kind,
                               event_id=delivery.event_id, delivery_id=delivery.delivery_id,
                               attempts=attempt, error=failure.reason)
                    return
                delay = min(_MAX_BACKOFF_SECONDS,
                            settings.first_backoff_seconds * 2 ** (attempt - 1))
                if failure.wait is not None:
                    delay = max(delay, failure.wait)
                _log.warning("webhook_retry", webhook=hook.stats.target, kind=delivery.kind,
                             event_id=delivery.event_id, attempt=attempt, retry_in=delay,
                             error=failure.reason)
                hook.stats.retries += 1
                await self._sleep(delay)
            else:
                hook.stats.delivered += 1
                return

    async def _attempt(self, hook: _Hook, delivery: Delivery) -> None:
        """One POST, signed now.

        Raises:
            _Failure: It did not get a 2xx answer.
        """
        settings = hook.settings
        timestamp = str(int(self._clock()))
        headers = {"Content-Type": "application/json", EVENT_HEADER: delivery.kind,
                   DELIVERY_HEADER: delivery.delivery_id, TIMESTAMP_HEADER: timestamp,
                   SIGNATURE_HEADER: sign(hook.secret, timestamp, delivery.body)}
        response: httpx.Response | None = None
        try:
            with anyio.move_on_after(settings.timeout_seconds):
                response = await self._client.post(settings.url, content=delivery.body,
                                                   headers=headers,
                                                   timeout=settings.timeout_seconds)
        except httpx.TransportError as exc:  # refused, reset, DNS, TLS, httpx's own timeouts
            raise _Failure(self._describe(exc, settings), retry=True) from None
        except httpx.HTTPError as exc:
            raise _Failure(self._describe(exc, settings), retry=False) from None
        if response is None:
            raise _Failure(f"no answer within {settings.timeout_seconds:g} s", retry=True)
        status = response.status_code
        if 200 <= status < 300:
            return
        retry = status >= 500 or status in _RETRIED_STATUSES
        raise _Failure(f"the receiver answered {status}", retry=retry,
                       wait=_retry_after(response) if retry else None)

    @staticmethod
    def _describe(exc: Exception, settings: WebhookSettings) -> str:
        # httpx may quote the URL; its path may be a credential.
        text = str(exc).replace(settings.url, settings.target()) or "no detail"
        return f"{type(exc).__name__}: {text}"

    async def aclose(self, within: float = _DRAIN_SECONDS) -> None:
        """Stops reading; spends at most ``within`` seconds (a couple by default) sending
        what is queued, logs what is left, and closes the HTTP client.

        Args:
            within: The most the sending may take (a stopping daemon gives what is left of
                its ten seconds).
        """
        if self._closed:
            return
        self._closed = True
        self.subscription.close()
        while (event := self.subscription.get_nowait()) is not None:
            self._route(event)
        for hook in self._hooks:
            hook.send.close()  # a sender ends once its queue is empty
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(min(within, _DRAIN_SECONDS)):
                if self._run_scope is not None:  # run() is still going: its senders drain
                    await self._run_done.wait()
                else:  # run() was cancelled (the daemon stopped): one attempt each
                    for hook in self._hooks:
                        await self._drain(hook)
            if self._run_scope is not None:
                self._run_scope.cancel()
                await self._run_done.wait()
            for hook in self._hooks:
                left = hook.receive.statistics().current_buffer_used
                if left:
                    _log.warning("webhooks_not_sent", webhook=hook.stats.target, count=left,
                                 reason="the daemon stopped before they were sent")
                hook.receive.close()
            if self._own_client:
                await self._client.aclose()

    async def _drain(self, hook: _Hook) -> None:
        while True:
            try:
                delivery = hook.receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                return
            await self._deliver(hook, delivery, 1)


def _retry_after(response: httpx.Response) -> float | None:
    """A ``Retry-After`` (seconds or a date) of at most a minute; None otherwise."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    if seconds != seconds or seconds < 0 or seconds > _MAX_BACKOFF_SECONDS:  # NaN, past, long
        return None
    return seconds


def open_webhooks(hooks: Sequence[WebhookSettings], bus: EventBus, *,
                  environ: Mapping[str, str] | None = None, redact: Collection[str] = (),
                  **options: Any) -> Webhooks | None:
    """The daemon's webhooks, subscribed to its bus; None when none is configured.

    Args:
        hooks: The ``[[webhooks]]`` settings.
        bus: The daemon's bus.
        environ: Where the secrets are read (``os.environ`` by default).
        redact: Secret values to replace in the payloads (the log redactor's).
        **options: ``client``, ``sleep``, ``clock`` (see :class:`Webhooks`).

    Returns:
        The webhooks; run :meth:`Webhooks.run` as a service and await
        :meth:`Webhooks.aclose` on the way out.

    Raises:
        ConfigError: A webhook's ``secret_env`` is unset or empty.
    """
    if not hooks:
        return None
    environ = os.environ if environ is None else environ
    secrets: list[bytes] = []
    for index, hook in enumerate(hooks):
        value = environ.get(hook.secret_env, "")
        if not value:
            raise ConfigError(f"webhooks[{index}].secret_env: the environment variable "
                              f"{hook.secret_env} is not set or empty (the webhook to "
                              f"{hook.target()} signs with it)")
        secrets.append(value.encode("utf-8"))
    return Webhooks.on_bus(hooks, secrets, bus, redact=redact, **options)
