"""The fleet's message bus on NATS JetStream: every desk's events, desk inboxes, requests.

The daemons of a fleet share its desks (each desk held by one daemon, through a lease) and
reach each other here. For a prefix ``P`` (``trading_agent`` by default; another lets
several fleets share one NATS server):

- **Events**: every desk's events on ``P.events.<desk>``, kept in the stream ``P_events``
  (bounded by age and bytes, the oldest dropped first). Every daemon reads that one stream,
  so an event has the same id on every daemon: its stream sequence.
  :meth:`FleetBus.publish_event` never waits: a bounded queue, then core NATS into the
  stream's subject with ``Nats-Msg-Id: <daemon>:<event id>``, so that what a reconnect sends
  again is kept once. When NATS is down, events past the bound are dropped and counted.
- **Desk inboxes**: operator messages and triggers for a desk on ``P.inbox.<desk>``, kept in
  the work-queue stream ``P_inbox`` until the desk's holder acknowledges them. The sender's
  message id is the ``Nats-Msg-Id``, so a resend within the duplicate window is dropped by
  the server. One durable pull consumer per desk (``desk_<desk>``): a new holder resumes
  where the old one left, and what was delivered but never acknowledged comes again.
- **Requests** that need the holder's answer (status, pause, cancel...): core NATS
  request/reply on ``P.control.<desk>``, served by the holder in a queue group, so one daemon
  answers even while two overlap during a handover.
- **Releases**: ``P.released`` says which desks a daemon just gave up, so the others take
  them now instead of at their next look.

Everything published here is sealed with the fleet's key and checked where it is received
(:mod:`trading_agent.fleet.sealing`): a request, an answer, an inbox message, an event or a
release that fails is refused (logged once a minute per kind), so a client of the NATS
server without the key is obeyed by no daemon, shown on no page, and cannot answer in a
holder's place. (What the bodies say is checked by the desk's holder,
:class:`~trading_agent.fleet.control.DeskService`.)

Errors::

    TradingAgentError
    ├── ConfigError                connect(): NATS unreachable at the URL, JetStream off, or
    │                              the streams refuse these settings
    └── FleetError                 the fleet's bus failed
        ├── FleetUnavailableError  a message was not kept, or an ack not confirmed
        └── DeskUnreachable        no daemon answered a request for a desk
"""

from __future__ import annotations

import asyncio
import math
import re
import ssl
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import anyio.abc
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from trading_agent.errors import ConfigError, TradingAgentError
from trading_agent.fleet.sealing import SEAL_HEADER, RefusalLog, Sealer, SealRefused
from trading_agent.jsontext import json_bytes, json_loads

__all__ = [
    "BusOptions",
    "ControlHandler",
    "DeskInbox",
    "DeskUnreachable",
    "FleetBus",
    "FleetError",
    "FleetEvent",
    "FleetUnavailableError",
    "InboxMessage",
    "Served",
]

_log = structlog.get_logger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""Desk names and the prefix: one subject token, a valid stream and consumer name."""

_MSG_ID = "Nats-Msg-Id"
_DAEMON = "Trading-Agent-Daemon"
_CONTROL_GROUP = "holders"
_REPLY_PREFIX = "_INBOX."
"""Answers go only to NATS inboxes (the subject is sealed with the request): a request
replayed with another reply subject fails its seal, and none can turn a holder's answer
into a message on the fleet's own subjects."""
_STATUS = "Status"
_NO_RESPONDERS = "503"
_STREAM_RACES = frozenset({10058, 10059, 10065})
"""JetStream's error codes that daemons setting a stream up at once meet: the stream exists
with other settings (name in use), is not found yet, or is being made (subjects overlap)."""
_STREAM_ATTEMPTS = 6
"""How often a stream is tried in that race (0.75 s of waits in all) before it is refused."""

_NATS_FAILURES = (nats.errors.Error, TimeoutError, OSError)
"""What a NATS call raises when NATS is down or slow (JetStream's errors are among them)."""

_LEFT = ("the desk left the daemon that was answering (handed over, its lease lost, or "
         "that daemon stopping); ask again")
"""The answer to a request cut short because its daemon let the desk go."""

ControlHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
"""Answers a request for a desk this daemon holds."""


class FleetError(TradingAgentError):
    """The fleet's bus failed."""


class FleetUnavailableError(FleetError):
    """A message could not be kept or an acknowledgement not confirmed: NATS is down, slow,
    or refused it.

    Args:
        message: What happened.
        kept: For a message sent: False when it certainly was not kept (NATS was not
            connected, or refused it), None when it may have been (sent, never confirmed).
            Sending it again with the same message id is safe either way: the stream and
            the desk's holder keep it once.
    """

    def __init__(self, message: str, kept: bool | None = None) -> None:
        super().__init__(message)
        self.kept = kept


class DeskUnreachable(FleetError):
    """No daemon answered a request for a desk: none holds it now, or its holder is slow.

    Args:
        desk: The desk asked about.
        reason: Why, readable by an operator.
    """

    def __init__(self, desk: str, reason: str) -> None:
        super().__init__(f"desk {desk}: {reason}")
        self.desk = desk
        self.reason = reason


@dataclass(frozen=True)
class BusOptions:
    """How the bus keeps and moves messages; every daemon of a fleet should use the same.

    Attributes:
        events_max_age: Seconds an event is kept in the stream.
        events_max_bytes: The most bytes of events kept; the oldest go first.
        inbox_max_age: Seconds a message waits for a desk's holder before it is dropped.
        inbox_max_bytes: The most bytes of waiting messages; past it a send is refused
            (never an older message dropped).
        duplicate_window: Seconds within which a resend of a message id is dropped.
        ack_wait: Seconds a delivered inbox message may go unacknowledged before it is
            delivered again (to the same holder, or the next).
        inbox_poll: Seconds one wait for an inbox message lasts before the next.
        replicas: Copies of each stream in a NATS cluster.
        max_waiting_events: Events held while NATS is slow or down; past it they are dropped.
        reconnect_buffer_bytes: Bytes the NATS client holds while reconnecting.
        connect_timeout: Seconds to reach NATS at the start.
        request_timeout: Seconds a JetStream call (a send, an ack, a page) may take.
        reconnect_wait: Seconds between attempts to reach NATS again after losing it.
        close_timeout: Seconds spent sending what is left when the bus closes.
        ping_interval: Seconds between the client's pings of the server. A connection that
            leaves ``max_outstanding_pings`` of them unanswered for another interval is
            taken as dead, and made again (its subscriptions with it): a frozen peer, a
            half-open socket or a reader that stopped are survived within about
            ``ping_interval * (max_outstanding_pings + 1)`` seconds, not nats-py's six
            minutes.
        max_outstanding_pings: Pings left unanswered before the connection is made again.
        seal_window: Seconds a live message's seal may be off from the receiver's clock
            (what a stream kept may be off from its storing by ``duplicate_window``).
    """

    events_max_age: float = 86_400.0
    events_max_bytes: int = 1 << 30
    inbox_max_age: float = 7 * 86_400.0
    inbox_max_bytes: int = 256 << 20
    duplicate_window: float = 120.0
    ack_wait: float = 30.0
    inbox_poll: float = 5.0
    replicas: int = 1
    max_waiting_events: int = 10_000
    reconnect_buffer_bytes: int = 2 << 20
    connect_timeout: float = 5.0
    request_timeout: float = 5.0
    reconnect_wait: float = 2.0
    close_timeout: float = 2.0
    ping_interval: float = 5.0
    max_outstanding_pings: int = 2
    seal_window: float = 60.0


@dataclass(frozen=True, slots=True)
class FleetEvent:
    """One event from the fleet's stream.

    Attributes:
        seq: Its stream sequence: its id on every daemon, increasing.
        desk: The desk it is about.
        daemon: The daemon that published it.
        data: The event as published.
    """

    seq: int
    desk: str
    daemon: str
    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Outgoing:
    subject: str
    payload: bytes
    headers: dict[str, str]


class FleetBus:
    """This daemon's connection to the fleet's NATS. Open it with :meth:`connect`.

    Attributes:
        daemon_id: This daemon, as its events and messages name it.
        prefix: The fleet's subjects and streams start with it.
        events_dropped: Events :meth:`publish_event` could not send, over the bus's life.
    """

    def __init__(self, nc: Client, js: JetStreamContext, daemon_id: str, prefix: str,
                 options: BusOptions, group: anyio.abc.TaskGroup, sealer: Sealer) -> None:
        self._nc = nc
        self._sealer = sealer
        self.refusals = RefusalLog()
        self._js = js
        self.daemon_id = daemon_id
        self.prefix = prefix
        self._options = options
        self._group = group
        self._events_stream = f"{prefix}_events"
        self._inbox_stream = f"{prefix}_inbox"
        self._outgoing, self._outgoing_receive = \
            anyio.create_memory_object_stream[_Outgoing](options.max_waiting_events)
        self._pump_done = anyio.Event()
        self.events_dropped = 0
        self._dropping = 0  # dropped since the last event sent

    @classmethod
    @asynccontextmanager
    async def connect(cls, url: str, daemon_id: str, *, prefix: str = "trading_agent",
                      options: BusOptions | None = None, user: str | None = None,
                      password: str | None = None, token: str | None = None,
                      credentials_file: str | None = None, tls: ssl.SSLContext | None = None,
                      key: bytes) -> AsyncIterator[FleetBus]:
        """Connects to NATS and sets the fleet's streams up; closes it all on exit.

        Several daemons may connect at once: the streams are created when missing and their
        limits updated to these options otherwise. While the bus is open, losing NATS is
        survived: the client reconnects for ever.

        Args:
            url: ``nats://HOST:PORT`` (several, comma-separated, for a cluster).
            daemon_id: This daemon.
            prefix: The fleet's subjects and streams start with it.
            options: Limits and timeouts.
            user: The NATS user (``password`` with it), over any the URL names.
            password: That user's password.
            token: A NATS token, instead of a user.
            credentials_file: A NATS credentials file (JWT and nkey seed), instead.
            tls: The TLS context for ``tls://`` URLs (the CA to trust, a client certificate).
            key: The fleet's shared key: what this daemon publishes is sealed with it, and
                what it receives is refused unless sealed with it.

        Yields:
            The bus.

        Raises:
            ConfigError: NATS cannot be reached at ``url``, has no JetStream, or refuses these
                stream settings (the message names the URL, never its password).
            ValueError: ``prefix`` or ``daemon_id`` is not usable, or ``key`` is too short.
        """
        options = options or BusOptions()
        _check_name("prefix", prefix)
        sealer = Sealer(key, window=options.seal_window,
                        stored_window=max(options.duplicate_window, options.seal_window))
        if not daemon_id or not daemon_id.isprintable() or daemon_id != daemon_id.strip():
            raise ValueError(f"daemon id {daemon_id!r}: printable, no surrounding spaces")
        servers = [part.strip() for part in url.split(",") if part.strip()]
        shown = ",".join(_without_password(server) for server in servers)
        nc = await _open_connection(servers, shown, daemon_id, options, {
            "user": user, "password": password, "token": token,
            "user_credentials": credentials_file, "tls": tls})
        try:
            js = nc.jetstream(timeout=options.request_timeout)
            await _set_up_streams(js, prefix, options, shown)
            async with anyio.create_task_group() as group:
                bus = cls(nc, js, daemon_id, prefix, options, group, sealer)
                group.start_soon(bus._pump_events)
                try:
                    yield bus
                finally:
                    await bus._finish(group)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(options.close_timeout):
                await _close_quietly(nc)

    # ------------------------------------------------------------------ events

    def publish_event(self, desk: str, event: dict[str, Any]) -> None:
        """Sends a desk's event to the fleet's stream, without waiting; never raises.

        The event's ``id`` (this daemon's event id) makes its ``Nats-Msg-Id``, so a copy
        sent again is kept once. An event that cannot go (NATS down past the bound, not
        JSON, too large, a bad desk name) is dropped, counted in :attr:`events_dropped` and
        logged.

        Args:
            desk: The desk it is about.
            event: The event, JSON-ready, with its ``id``.
        """
        if not _NAME.match(desk):
            self._count_dropped(f"bad desk name {desk!r}")
            return
        try:
            payload = json_bytes(event)
        except (TypeError, ValueError) as exc:
            self._count_dropped(f"not JSON: {exc}")
            return
        if len(payload) > self._nc.max_payload:
            self._count_dropped(f"{len(payload)} bytes, past NATS's {self._nc.max_payload}")
            return
        headers = {_DAEMON: self.daemon_id}
        if event.get("id") is not None:
            headers[_MSG_ID] = f"{self.daemon_id}:{event['id']}"
        try:
            self._outgoing.send_nowait(_Outgoing(self._subject("events", desk), payload,
                                                 headers))
        except anyio.WouldBlock:
            self._count_dropped(f"{self._options.max_waiting_events} events already wait "
                                f"for NATS")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._count_dropped("the bus is closed")

    @property
    def is_connected(self) -> bool:
        """Whether NATS is reachable now (False while the client reconnects)."""
        return self._nc.is_connected

    @property
    def events_waiting(self) -> int:
        """Events queued by :meth:`publish_event`, not yet handed to the NATS client."""
        return self._outgoing.statistics().current_buffer_used

    async def events(self, after: int | None = None, *,
                     desk: str | None = None) -> AsyncGenerator[FleetEvent, None]:
        """Every desk's events from every daemon, in the stream's order, until closed.

        Subscribes when first iterated. Close it (``contextlib.aclosing``) to let go of the
        subscription at once.

        Args:
            after: None: the events published from now on. A sequence: every event still
                kept after it, then the live ones (a viewer that reconnects).
            desk: Only this desk's events.

        Yields:
            The events.

        Raises:
            FleetUnavailableError: The subscription could not be made.
        """
        config = None
        policy = DeliverPolicy.NEW
        if after is not None:
            config = ConsumerConfig(opt_start_seq=max(after, 0) + 1)
            policy = DeliverPolicy.BY_START_SEQUENCE
        subject = self._subject("events", "*" if desk is None else _checked_desk(desk))
        try:
            sub = await self._js.subscribe(subject, stream=self._events_stream, config=config,
                                           deliver_policy=policy, ordered_consumer=True)
        except _NATS_FAILURES as exc:
            raise FleetUnavailableError(f"cannot follow the fleet's events: "
                                        f"{_describe(exc)}") from exc
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=None)
                except nats.errors.ConnectionClosedError:
                    return
                event = self._event_from(msg)
                if event is not None:
                    yield event
        finally:
            with anyio.CancelScope(shield=True):
                await _unsubscribe_quietly(sub)

    async def events_between(self, after: int, limit: int,
                             desk: str | None = None) -> list[FleetEvent]:
        """A page of kept events after a sequence, oldest first (a viewer catching up).

        Args:
            after: The last sequence the reader has.
            limit: The most events returned.
            desk: Only this desk's events.

        Returns:
            Up to ``limit`` events with sequences past ``after``; fewer when no more are kept.

        Raises:
            FleetUnavailableError: NATS could not be asked.
            ValueError: ``limit`` is below 1.
        """
        if limit < 1:
            raise ValueError(f"limit {limit}: at least 1")
        subject = self._subject("events", "*" if desk is None else _checked_desk(desk))
        name = f"page_{uuid.uuid4().hex}"
        config = ConsumerConfig(
            durable_name=name, deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(after, 0) + 1, filter_subject=subject,
            ack_policy=AckPolicy.NONE, inactive_threshold=60.0, mem_storage=True,
            num_replicas=1)
        events: list[FleetEvent] = []
        sub: JetStreamContext.PullSubscription | None = None
        try:
            info = await self._js.add_consumer(self._events_stream, config)
            kept = info.num_pending or 0  # refused ones among them: counted, not returned
            if kept:
                sub = await self._js.pull_subscribe_bind(name, stream=self._events_stream)
            while sub is not None and kept and len(events) < limit:
                try:
                    msgs = await sub.fetch(min(limit - len(events), kept),
                                           timeout=self._options.request_timeout)
                except TimeoutError:
                    break  # the rest aged out meanwhile
                kept -= len(msgs)
                for msg in msgs:
                    event = self._event_from(msg)
                    if event is not None:
                        events.append(event)
        except _NATS_FAILURES as exc:
            raise FleetUnavailableError(f"cannot read the fleet's kept events: "
                                        f"{_describe(exc)}") from exc
        finally:
            with anyio.CancelScope(shield=True):
                if sub is not None:
                    await _unsubscribe_quietly(sub)
                await self._delete_consumer_quietly(self._events_stream, name)
        return events

    async def last_event_sequence(self) -> int:
        """The sequence of the newest event in the stream (0 when it never had one).

        Raises:
            FleetUnavailableError: NATS could not be asked.
        """
        try:
            info = await self._js.stream_info(self._events_stream)
        except _NATS_FAILURES as exc:
            raise FleetUnavailableError(f"cannot read the fleet's event stream: "
                                        f"{_describe(exc)}") from exc
        return info.state.last_seq

    # ------------------------------------------------------------------ desk inboxes

    async def send_to_desk(self, desk: str, message_id: str, payload: dict[str, Any]) -> bool:
        """Keeps a message for a desk until its holder (now or later) acknowledges it.

        Returns once JetStream has stored it. A resend of ``message_id`` within the
        duplicate window is dropped by the server, even after the first was handled.

        Args:
            desk: The desk.
            message_id: The message's id, unique to it.
            payload: The message, JSON-ready.

        Returns:
            True when kept now; False when that id was kept before (this one dropped).

        Raises:
            FleetUnavailableError: It may not be kept (NATS down or slow, the inbox full);
                its ``kept`` says whether it certainly was not. Sending it again with the
                same id is safe.
            ValueError: A bad desk name or message id.
        """
        _checked_desk(desk)
        if not message_id or not message_id.isprintable() or len(message_id) > 256:
            raise ValueError(f"message id {message_id!r}: 1 to 256 printable characters")
        data = json_bytes(payload)
        subject = self._subject("inbox", desk)
        if not self._nc.is_connected:  # else the client would hold it, and maybe send it
            raise FleetUnavailableError(f"desk {desk}: message {message_id} was not kept: "
                                        f"NATS is not connected", kept=False)
        try:
            ack = await self._js.publish(
                subject, data, timeout=self._options.request_timeout,
                stream=self._inbox_stream,
                headers={_MSG_ID: message_id, _DAEMON: self.daemon_id,
                         SEAL_HEADER: self._sealer.seal(subject, data, message_id)})
        except nats.js.errors.APIError as exc:  # the server answered: not kept
            raise FleetUnavailableError(f"desk {desk}: message {message_id} was not kept: "
                                        f"{_describe(exc)}", kept=False) from exc
        except _NATS_FAILURES as exc:
            raise FleetUnavailableError(
                f"desk {desk}: message {message_id} may or may not be kept, its storing was "
                f"not confirmed ({_describe(exc)}); sending it again with the same id is "
                f"safe: it is kept once") from exc
        return not ack.duplicate

    async def inbox(self, desk: str) -> DeskInbox:
        """The messages for a desk this daemon holds, each until acknowledged.

        The desk's consumer is durable: a new holder resumes where the last one left off,
        and what it was given but never acknowledged comes again (at once when it closed
        its inbox, else after ``ack_wait``).

        Args:
            desk: The desk.

        Returns:
            The inbox; iterate it, ``await message.ack()`` each message once handled, and
            close it when the desk is lost or handed over.

        Raises:
            FleetUnavailableError: NATS could not be reached.
        """
        _checked_desk(desk)
        inbox = DeskInbox(desk, self._js, self._inbox_stream, self._consumer_config(desk),
                          self._options, self._sealer, self.refusals)
        await inbox._open()
        return inbox

    def _consumer_config(self, desk: str) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=f"desk_{desk}", filter_subject=self._subject("inbox", desk),
            deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self._options.ack_wait, max_deliver=-1)

    # ------------------------------------------------------------------ requests

    async def serve_control(self, desk: str, handler: ControlHandler) -> Served:
        """Answers the requests for a desk this daemon holds, until stopped.

        Each request runs in a task of its own, so a slow one holds no other back. A
        handler that raises answers ``{"error": "..."}``; serving goes on.

        Args:
            desk: The desk.
            handler: Takes a request, returns the answer (both JSON objects).

        Returns:
            What to stop when the desk is lost or handed over.

        Raises:
            FleetUnavailableError: NATS could not be reached.
        """
        _checked_desk(desk)
        try:
            sub = await self._nc.subscribe(self._subject("control", desk), queue=_CONTROL_GROUP)
        except _NATS_FAILURES as exc:
            raise FleetUnavailableError(f"desk {desk}: cannot serve its requests: "
                                        f"{_describe(exc)}") from exc
        await self._flush_quietly()  # the server knows of us before serve_control returns
        in_flight = _InFlight()
        scope: anyio.CancelScope = await self._group.start(self._serve_requests, desk, sub,
                                                           handler, in_flight)
        return Served(desk, sub, scope, in_flight)

    async def _serve_requests(self, desk: str, sub: Subscription, handler: ControlHandler,
                              in_flight: _InFlight, *,
                              task_status: anyio.abc.TaskStatus[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            async with anyio.create_task_group() as answering:
                while True:
                    try:
                        msg = await sub.next_msg(timeout=None)
                    except nats.errors.ConnectionClosedError:
                        return
                    in_flight.count += 1
                    answering.start_soon(self._answer_counted, desk, msg, handler, in_flight)

    async def _answer_counted(self, desk: str, msg: Msg, handler: ControlHandler,
                              in_flight: _InFlight) -> None:
        try:
            await self._answer(desk, msg, handler)
        finally:
            in_flight.done()

    async def _answer(self, desk: str, msg: Msg, handler: ControlHandler) -> None:
        answer: dict[str, Any]
        try:
            if not msg.reply.startswith(_REPLY_PREFIX):
                raise SealRefused("bad_reply", f"answers go to {_REPLY_PREFIX}* only")
            self._sealer.check(msg.subject, msg.data, _header(msg, SEAL_HEADER), msg.reply)
        except SealRefused as exc:
            self.refusals.refused("control request", msg.subject, exc)
            return  # no answer: the asker learns nothing, and no subject gets a sealed reply
        try:
            request = json_loads(msg.data)
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError:
            answer = {"error": "the request is not a JSON object"}
        else:
            try:
                answer = await handler(request)
            except anyio.get_cancelled_exc_class():
                # This daemon let the desk go, or is stopping: the asker hears it now instead
                # of waiting its whole timeout (an hour for a turn's answer) for nothing.
                with anyio.CancelScope(shield=True), \
                        anyio.move_on_after(self._options.request_timeout):
                    await self._send_answer(desk, msg, {"error": _LEFT})
                raise
            except Exception as exc:  # the requester reads it; serving goes on
                _log.warning("fleet_request_failed", desk=desk, op=request.get("op"),
                             exc_info=exc)
                answer = {"error": f"{type(exc).__name__}: {exc}"}
        await self._send_answer(desk, msg, answer)

    async def _send_answer(self, desk: str, msg: Msg, answer: dict[str, Any]) -> None:
        try:
            data = json_bytes(answer)
        except (TypeError, ValueError) as exc:
            data = json_bytes({"error": f"the answer is not JSON: {exc}"})
        try:
            await self._nc.publish(msg.reply, data,
                                   headers={SEAL_HEADER: self._sealer.seal(msg.reply, data)})
        except _NATS_FAILURES as exc:
            _log.warning("fleet_answer_lost", desk=desk, error=_describe(exc))

    async def request_control(self, desk: str, request: dict[str, Any],
                              timeout: float = 5.0,  # noqa: ASYNC109 - the NATS request's own
                              ) -> dict[str, Any]:
        """Asks the daemon holding a desk, and waits for its answer.

        Args:
            desk: The desk.
            request: The request, a JSON object.
            timeout: Seconds to wait for the answer.

        Returns:
            The holder's answer; ``{"error": "..."}`` when its handler failed.

        Raises:
            DeskUnreachable: No daemon serves the desk now, none answered in time, NATS
                cannot be reached, or the answer was not sealed with the fleet's key (a
                client that joined the holders' queue group answered, and was refused).
            FleetError: The answer is not a JSON object.
        """
        _checked_desk(desk)
        msg = await self._ask(desk, json_bytes(request), timeout)
        try:
            self._sealer.check(msg.subject, msg.data, _header(msg, SEAL_HEADER))
        except SealRefused as exc:
            self.refusals.refused("answer", msg.subject, exc)
            raise DeskUnreachable(desk, f"an answer came that the fleet did not seal, and was "
                                        f"refused ({exc.reason}): a client of the NATS server "
                                        f"may be answering in the holder's place") from exc
        try:
            answer = json_loads(msg.data)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise FleetError(f"desk {desk}: its holder answered with something other than a "
                             f"JSON object")
        return answer

    async def _ask(self, desk: str, data: bytes, timeout: float) -> Msg:  # noqa: ASYNC109
        """Publishes a request sealed with its reply subject, and waits for the first
        answer (unchecked)."""
        subject = self._subject("control", desk)
        inbox = self._nc.new_inbox()
        try:
            sub = await self._nc.subscribe(inbox, max_msgs=1)
            try:
                await self._nc.publish(subject, data, reply=inbox, headers={
                    SEAL_HEADER: self._sealer.seal(subject, data, inbox)})
                msg = await sub.next_msg(timeout=timeout)
            finally:
                with anyio.CancelScope(shield=True):
                    await _unsubscribe_quietly(sub)
        except TimeoutError as exc:
            raise DeskUnreachable(desk, f"no answer within {timeout:g} s") from exc
        except _NATS_FAILURES as exc:
            raise DeskUnreachable(desk, f"NATS cannot be reached ({_describe(exc)})") from exc
        if _header(msg, _STATUS) == _NO_RESPONDERS:
            raise DeskUnreachable(desk, "no daemon serves it now")
        return msg

    # ------------------------------------------------------------------ releases

    async def announce_released(self, desks: Iterable[str]) -> None:
        """Tells the other daemons that this one just let desks go, so they take them now.

        A hint: when it is lost, they take the desks at their next look.

        Args:
            desks: The desks given up.
        """
        names = [_checked_desk(desk) for desk in desks]
        if not names:
            return
        subject = self._subject("released")
        data = json_bytes({"daemon": self.daemon_id, "desks": names})
        try:
            await self._nc.publish(subject, data,
                                   headers={SEAL_HEADER: self._sealer.seal(subject, data)})
            await self._nc.flush(timeout=math.ceil(self._options.request_timeout))
        except _NATS_FAILURES as exc:
            _log.warning("fleet_release_not_announced", desks=names, error=_describe(exc))

    async def released(self) -> AsyncGenerator[str, None]:
        """The desks any daemon (this one too) announces it let go, as it says so.

        Yields:
            Desk names.
        """
        sub = await self._nc.subscribe(self._subject("released"))
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=None)
                except nats.errors.ConnectionClosedError:
                    return
                try:
                    self._sealer.check(msg.subject, msg.data, _header(msg, SEAL_HEADER))
                except SealRefused as exc:
                    self.refusals.refused("release", msg.subject, exc)
                    continue
                try:
                    desks = json_loads(msg.data)["desks"]
                except (ValueError, KeyError, TypeError):
                    continue
                for desk in desks if isinstance(desks, list) else []:
                    if isinstance(desk, str):
                        yield desk
        finally:
            with anyio.CancelScope(shield=True):
                await _unsubscribe_quietly(sub)

    # ------------------------------------------------------------------ inside

    def _subject(self, kind: str, desk: str | None = None) -> str:
        return f"{self.prefix}.{kind}" if desk is None else f"{self.prefix}.{kind}.{desk}"

    async def _pump_events(self) -> None:
        """Hands queued events to the NATS client, one at a time, in order."""
        try:
            async with self._outgoing_receive:
                async for item in self._outgoing_receive:
                    # Sealed as it goes, not as it was queued: the seal's time is checked
                    # against the time the stream keeps it.
                    headers = {**item.headers, SEAL_HEADER: self._sealer.seal(
                        item.subject, item.payload, item.headers.get(_MSG_ID, ""))}
                    try:
                        await self._nc.publish(item.subject, item.payload, headers=headers)
                    except _NATS_FAILURES as exc:
                        self._count_dropped(_describe(exc))
                    else:
                        if self._dropping:
                            _log.info("fleet_events_flowing", dropped=self._dropping)
                            self._dropping = 0
        finally:
            self._pump_done.set()

    def _event_from(self, msg: Msg) -> FleetEvent | None:
        """The event a stream message carries; None (logged) when it is refused or
        unreadable."""
        seq = msg.metadata.sequence.stream
        desk = msg.subject.rsplit(".", 1)[-1]
        try:
            self._sealer.check(msg.subject, msg.data, _header(msg, SEAL_HEADER),
                               _header(msg, _MSG_ID) or "",
                               stored_at=msg.metadata.timestamp.timestamp())
            data = json_loads(msg.data)
            if isinstance(data, dict) and data.get("desk", desk) != desk:
                raise SealRefused("desk_mismatch", f"an event of desk {desk} names another")
        except SealRefused as exc:
            self.refusals.refused("event", msg.subject, exc)
            return None
        except ValueError:
            data = None
        if not isinstance(data, dict):
            _log.warning("fleet_event_unreadable", subject=msg.subject, seq=seq)
            return None
        return FleetEvent(seq=seq, desk=desk, daemon=_header(msg, _DAEMON) or "", data=data)

    def _count_dropped(self, reason: str) -> None:
        self.events_dropped += 1
        self._dropping += 1
        if self._dropping == 1 or math.log10(self._dropping).is_integer():
            _log.warning("fleet_events_dropped", dropped=self._dropping,
                         dropped_total=self.events_dropped, reason=reason)

    async def _finish(self, group: anyio.abc.TaskGroup) -> None:
        """Sends what is queued (for a while), then stops the bus's tasks."""
        self._outgoing.close()
        with anyio.CancelScope(shield=True), anyio.move_on_after(self._options.close_timeout):
            await self._pump_done.wait()
            await self._nc.flush(timeout=math.ceil(self._options.close_timeout))
        group.cancel_scope.cancel()

    async def _flush_quietly(self) -> None:
        with suppress(*_NATS_FAILURES):  # else the subscription is sent again on reconnect
            await self._nc.flush(timeout=math.ceil(self._options.request_timeout))

    async def _delete_consumer_quietly(self, stream: str, name: str) -> None:
        with suppress(*_NATS_FAILURES):  # else its inactive threshold removes it
            await self._js.delete_consumer(stream, name)


class _InFlight:
    """How many of a desk's requests are being answered."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = anyio.Event()

    def done(self) -> None:
        self.count -= 1
        self._changed.set()
        self._changed = anyio.Event()

    async def none_left(self) -> None:
        while self.count:
            await self._changed.wait()


class Served:
    """The requests of a desk served by this daemon; :meth:`stop` when it lets the desk go."""

    def __init__(self, desk: str, sub: Subscription, scope: anyio.CancelScope,
                 in_flight: _InFlight) -> None:
        self.desk = desk
        self._sub = sub
        self._scope = scope
        self._in_flight = in_flight

    async def stop(self, grace: float = 0.0) -> None:
        """Stops taking requests; those being answered get ``grace`` seconds to end (a desk
        handed over: the answers its last turn gave go out), then are cancelled, their askers
        told that the desk left. Idempotent."""
        with anyio.CancelScope(shield=True):
            await _unsubscribe_quietly(self._sub)
            with anyio.move_on_after(grace):
                await self._in_flight.none_left()
        self._scope.cancel()


class InboxMessage:
    """A message from a desk's inbox.

    Attributes:
        message_id: The id its sender gave it.
        payload: The message.
        delivered: How many times it has been delivered (2 or more: a holder got it before
            and never acknowledged it, so it may have been handled).
    """

    __slots__ = ("_inbox", "_msg", "_seq", "delivered", "message_id", "payload")

    def __init__(self, message_id: str, payload: dict[str, Any], delivered: int, seq: int,
                 msg: Msg, inbox: DeskInbox) -> None:
        self.message_id = message_id
        self.payload = payload
        self.delivered = delivered
        self._seq = seq
        self._msg = msg
        self._inbox = inbox

    async def ack(self) -> None:
        """Says it is handled: once this returns, the message never comes again. (After
        its inbox closed, the message went back to the desk's next holder and this does
        nothing.)

        Raises:
            FleetUnavailableError: The server did not confirm; the message may come again.
        """
        try:
            await self._msg.ack_sync(timeout=self._inbox._timeout)
        except nats.errors.MsgAlreadyAckdError:
            pass
        except _NATS_FAILURES as exc:
            raise FleetUnavailableError(
                f"desk {self._inbox.desk}: the ack of message {self.message_id} was not "
                f"confirmed ({_describe(exc)}); it may come again") from exc
        self._inbox._unacked.pop(self._seq, None)

    def __repr__(self) -> str:
        return (f"InboxMessage(message_id={self.message_id!r}, delivered={self.delivered}, "
                f"desk={self._inbox.desk!r})")


class DeskInbox:
    """A desk's inbox as its holder reads it. Get one from :meth:`FleetBus.inbox`.

    Iterate it for the messages, oldest first; the iteration ends when the inbox is closed
    (from this task or another) or the bus closes. Usable as ``async with``.

    Args:
        desk: The desk.
        js: JetStream.
        stream: The inbox stream.
        config: The desk's durable consumer.
        options: Poll and ack timeouts.
        sealer: Checks each message's seal.
        refusals: Where refused messages are logged.
    """

    def __init__(self, desk: str, js: JetStreamContext, stream: str, config: ConsumerConfig,
                 options: BusOptions, sealer: Sealer, refusals: RefusalLog) -> None:
        self.desk = desk
        self._sealer = sealer
        self._refusals = refusals
        self._js = js
        self._stream = stream
        self._config = config
        self._poll = options.inbox_poll
        self._timeout = options.request_timeout
        self._sub: JetStreamContext.PullSubscription | None = None
        self._unacked: dict[int, Msg] = {}
        self._closed = False
        self._waiting = anyio.CancelScope()
        self._failing = False

    async def _open(self) -> None:
        durable = self._config.durable_name
        assert durable is not None
        try:
            await self._js.add_consumer(self._stream, self._config)
            self._sub = await self._js.pull_subscribe_bind(durable, stream=self._stream)
        except _NATS_FAILURES as exc:
            raise FleetUnavailableError(f"desk {self.desk}: cannot open its inbox: "
                                        f"{_describe(exc)}") from exc

    def __aiter__(self) -> DeskInbox:
        return self

    async def __anext__(self) -> InboxMessage:
        while not self._closed:
            msg = await self._next_msg()
            if msg is None:
                continue
            if self._closed:  # closed while it came: the next holder has it at once
                await _quietly(msg.nak())
                break
            seq = msg.metadata.sequence.stream
            message_id = _header(msg, _MSG_ID)
            try:
                self._sealer.check(msg.subject, msg.data, _header(msg, SEAL_HEADER),
                                   message_id or "",
                                   stored_at=msg.metadata.timestamp.timestamp())
                payload = json_loads(msg.data)
                if not isinstance(payload, dict):
                    raise ValueError("not an object")
            except SealRefused as exc:
                self._refusals.refused("inbox message", msg.subject, exc)
                await _quietly(msg.term())  # never delivered again
                continue
            except ValueError:
                _log.warning("fleet_inbox_message_unreadable", desk=self.desk, seq=seq)
                await _quietly(msg.term())
                continue
            self._unacked[seq] = msg
            return InboxMessage(message_id or f"seq-{seq}", payload,
                                msg.metadata.num_delivered, seq, msg, self)
        raise StopAsyncIteration

    async def _next_msg(self) -> Msg | None:
        """One wait for a message; None when none came (or after a failure, a pause)."""
        assert self._sub is not None
        with anyio.CancelScope() as self._waiting:
            if self._closed:
                return None
            try:
                msgs = await self._sub.fetch(1, timeout=self._poll)
            except TimeoutError:
                return None
            except nats.errors.ConnectionClosedError:
                self._closed = True
                return None
            except _NATS_FAILURES as exc:
                if not self._failing:
                    _log.warning("fleet_inbox_failing", desk=self.desk, error=_describe(exc))
                self._failing = True
                await anyio.sleep(self._poll)
                await _quietly(self._js.add_consumer(self._stream, self._config))
                return None
            if self._failing:
                _log.info("fleet_inbox_flowing", desk=self.desk)
                self._failing = False
            return msgs[0]
        return None  # closed meanwhile

    async def close(self) -> None:
        """Stops reading: what was delivered and not acknowledged goes back at once to the
        next holder. The desk's consumer stays; idempotent."""
        if self._closed and self._sub is None:
            return
        self._closed = True
        self._waiting.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(self._timeout):
            for msg in list(self._unacked.values()):
                await _quietly(msg.nak())
            self._unacked.clear()
            if self._sub is not None:
                await _unsubscribe_quietly(self._sub)
        self._sub = None

    async def __aenter__(self) -> DeskInbox:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


# ---------------------------------------------------------------------- helpers


def _check_name(what: str, name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"{what} {name!r}: 1 to 64 letters, digits, '_' or '-'")
    return name


def _checked_desk(desk: str) -> str:
    return _check_name("desk", desk)


def _header(msg: Msg, name: str) -> str | None:
    return (msg.headers or {}).get(name)


def _without_password(url: str) -> str:
    """The URL as logs and errors may show it: a password or token replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(an unreadable URL)"
    if "@" not in parts.netloc:
        return url
    userinfo, host = parts.netloc.rsplit("@", 1)
    user = userinfo.split(":", 1)[0] + ":***" if ":" in userinfo else "***"
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, nats.js.errors.APIError) and exc.description:
        return str(exc.description)
    return str(exc) or type(exc).__name__


async def _quietly(call: Awaitable[object]) -> None:
    with suppress(*_NATS_FAILURES):
        await call


async def _unsubscribe_quietly(
        sub: Subscription | JetStreamContext.PullSubscription) -> None:
    try:
        await sub.unsubscribe()
    except (*_NATS_FAILURES, ValueError):
        pass  # closed already, or the connection is gone


async def _close_quietly(nc: Client) -> None:
    with suppress(*_NATS_FAILURES):
        await nc.close()


class _NotTls(ssl.SSLError):
    """A ``tls://`` server that answered in plain text."""

    def __str__(self) -> str:
        return str(self.args[0])


class _Client(Client):
    """nats-py's client, surviving a late PONG, and whose flush follows what it sent.

    It also refuses to speak plain text to a ``tls://`` server.

    ``flush()`` sends a PING and waits for its PONG; on timeout it cancels the future but
    leaves it queued, and when the PONG comes after all (a daemon woken from SIGSTOP, a
    server or network stalled longer than the timeout), ``_process_pong`` sets the result of
    the cancelled future: ``InvalidStateError`` ends the client's read loop for good while
    the client still says it is connected, so every request times out and no message is
    read (issue 30). Here that PONG is matched to its cancelled PING and dropped.
    """

    def _connect_command(self) -> bytes:
        """Refuses, before any credential is sent, a ``tls://`` server that did not ask for
        TLS: nats-py would go on in plain text (a man in the middle's first trick)."""
        server = self._current_server
        if server is not None and server.uri.scheme == "tls" \
                and not self._server_info.get("tls_required") \
                and not self.options["tls_handshake_first"]:
            if self._transport is not None:
                self._transport.close()  # type: ignore[no-untyped-call]  # left open by nats-py
            raise _NotTls("the server does not require TLS although the URL is tls:// (nothing "
                          "was sent to it; configure TLS on the server)")
        return super()._connect_command()

    async def _send_ping(self, future: asyncio.Future[Any] | None = None) -> None:
        """Sends what waits for the flusher task (a SUB) before the PING: nats-py writes the
        PING straight to the socket, so a flush's PONG could come before the server had read
        a subscription made just before it, and a request sent then found no responder."""
        if self._pending and self.is_connected and self._transport is not None:
            self._transport.writelines(self._pending)
            self._pending = []
            self._pending_data_size = 0
        await super()._send_ping(future)

    async def _process_pong(self) -> None:
        if self._pongs:
            future = self._pongs.pop(0)
            if not future.done():  # cancelled: the flush that sent its PING gave up
                future.set_result(True)
            self._pongs_received += 1
            self._pings_outstanding = 0


async def _open_connection(servers: list[str], shown: str, daemon_id: str,
                           options: BusOptions, credentials: dict[str, Any]) -> Client:
    """Connects, failing fast when NATS is absent, then reconnects for ever once in."""
    nc = _Client()
    failures: list[BaseException] = []  # before the first connection: told in the error
    attempt = anyio.CancelScope()

    async def on_error(exc: Exception) -> None:
        if not nc.is_connected and not nc.is_reconnecting and not nc.is_closed:
            failures.append(exc)
            if isinstance(exc, ssl.SSLError):
                attempt.cancel()  # nats-py tries a server that fails TLS again for ever
        elif not nc.is_reconnecting:  # each failed attempt while reconnecting: not logged
            _log.warning("fleet_nats_error", url=shown, error=_describe(exc))

    async def on_disconnected() -> None:
        if not nc.is_closed:
            _log.warning("fleet_nats_disconnected", url=shown)

    async def on_reconnected() -> None:
        _log.info("fleet_nats_reconnected", url=shown)

    try:
        with attempt:
            await nc.connect(
                servers=servers, name=f"trading-agent {daemon_id}", error_cb=on_error,
                disconnected_cb=on_disconnected, reconnected_cb=on_reconnected,
                connect_timeout=max(1, math.ceil(options.connect_timeout)),
                max_reconnect_attempts=1, reconnect_time_wait=0,
                ping_interval=max(1, math.ceil(options.ping_interval)),
                max_outstanding_pings=options.max_outstanding_pings,
                pending_size=options.reconnect_buffer_bytes,
                **{name: value for name, value in credentials.items() if value is not None})
        if attempt.cancelled_caught:
            raise ConnectionError("TLS failed")
    except (*_NATS_FAILURES, ValueError) as exc:
        with suppress(Exception):  # nats-py 2.9 trips over a client that never connected
            await nc.close()
        cause = _describe(failures[-1] if failures else exc)
        raise ConfigError(f"fleet: cannot reach NATS at {shown}: {cause}") from exc
    # Once in, losing NATS is survived: reconnect for ever (read at each attempt).
    nc.options["max_reconnect_attempts"] = -1
    nc.options["reconnect_time_wait"] = options.reconnect_wait
    nc.options["ping_interval"] = options.ping_interval  # read at each ping: may be < 1 s
    return nc


async def _set_up_streams(js: JetStreamContext, prefix: str, options: BusOptions,
                          shown: str) -> None:
    try:
        await js.account_info()
    except nats.js.errors.ServiceUnavailableError as exc:
        raise ConfigError(f"fleet: the NATS server at {shown} has no JetStream (start it "
                          f"with -js)") from exc
    except _NATS_FAILURES as exc:
        raise ConfigError(f"fleet: JetStream at {shown} cannot be used: "
                          f"{_describe(exc)}") from exc
    common: dict[str, Any] = {"storage": StorageType.FILE, "num_replicas": options.replicas,
                              "duplicate_window": options.duplicate_window}
    streams = [
        StreamConfig(name=f"{prefix}_events", subjects=[f"{prefix}.events.*"],
                     description="every desk's events, for every daemon's viewers",
                     retention=RetentionPolicy.LIMITS, discard=DiscardPolicy.OLD,
                     max_age=options.events_max_age, max_bytes=options.events_max_bytes,
                     **common),
        StreamConfig(name=f"{prefix}_inbox", subjects=[f"{prefix}.inbox.*"],
                     description="operator messages and triggers, until a desk's holder "
                                 "takes them",
                     retention=RetentionPolicy.WORK_QUEUE, discard=DiscardPolicy.NEW,
                     max_age=options.inbox_max_age, max_bytes=options.inbox_max_bytes,
                     **common),
    ]
    for config in streams:
        try:
            await _add_or_update(js, config)
        except _NATS_FAILURES as exc:
            raise ConfigError(f"fleet: the stream {config.name} on {shown} cannot be set up: "
                              f"{_describe(exc)}") from exc


async def _add_or_update(js: JetStreamContext, config: StreamConfig) -> None:
    """Makes the stream, or gives the one there these settings (another daemon's, or older
    ones). Daemons starting at once race: the loser may hear that the subjects overlap with
    a stream still being made, or that the stream is not found when it updates it; it tries
    again, a little later, a few times."""
    refused: nats.js.errors.APIError | None = None
    for attempt in range(_STREAM_ATTEMPTS):
        try:
            await js.add_stream(config)
            return
        except nats.js.errors.APIError as exc:
            if exc.err_code not in _STREAM_RACES:
                raise
            refused = exc  # what is told if no attempt succeeds
        try:
            await js.update_stream(config)
            return
        except nats.js.errors.APIError as exc:
            if exc.err_code not in _STREAM_RACES:
                raise
        await anyio.sleep(0.05 * (attempt + 1))
    assert refused is not None
    raise refused
