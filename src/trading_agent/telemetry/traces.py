"""OpenTelemetry traces of the desks' work, after the GenAI semantic conventions.

The spans are built from the daemon's event bus, as the store and the logs are, so the agent
core knows nothing of OpenTelemetry. Each event carries its time (``at``), so every span has
the start and end of the step it stands for, however late the consumer reads the events::

    invoke_agent {desk}          a turn (the silent memory flush too), TurnStarted → TurnEnded
    ├── chat {model}             a model call, ModelRequest → UsageReported (retries: events)
    └── execute_tool {tool}      a tool call, ToolCallStarted → ToolResultReady
        └── invoke_agent {desk}  a subagent's turn, under the ``delegate`` call that ran it

A model call outside a turn (a compaction's summary) is a ``chat`` span of its own. A failure
(an :class:`~trading_agent.agent.events.ErrorEvent` of a turn or a subagent, an operator
cutting a turn at once) ends the spans it interrupts with ``error.type`` and an error status.
A turn whose end never came (it crashed, or its end was dropped) is ended when the desk's
next turn starts, at the time of its last event, with ``error.type`` ``interrupted``; spans
still open when the daemon stops end with ``shutdown``.

Attributes (names of the GenAI conventions as moved to ``open-telemetry/semantic-conventions-
genai``): ``gen_ai.operation.name``, ``gen_ai.provider.name`` (and the older
``gen_ai.system``, still read by many backends), ``gen_ai.agent.name`` (the desk),
``gen_ai.agent.id`` (a subagent's id), ``gen_ai.conversation.id``, ``gen_ai.request.model``,
``gen_ai.usage.input_tokens`` (cached ones included), ``gen_ai.usage.output_tokens``,
``gen_ai.usage.cache_read.input_tokens``, ``gen_ai.response.time_to_first_chunk``,
``gen_ai.tool.name``, ``gen_ai.tool.call.id``, ``gen_ai.tool.type``, ``error.type``; and
``trading_agent.*`` for what only this daemon knows (turn id, trigger, round, cost). No
message text, tool arguments or results are recorded: they may hold what an operator would
not send to a tracing backend.

:func:`open_tracing` builds a :class:`Tracing` with a tracer provider of its own (never the
global one) exporting over OTLP/HTTP, or returns None when no endpoint is configured: then
nothing is set up at all.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from trading_agent.agent.event_bus import EventBus, Subscription
from trading_agent.agent.events import (
    CompactionStarted,
    ErrorEvent,
    Event,
    EventsDropped,
    ModelRequest,
    RetryScheduled,
    TextDelta,
    ToolCallStarted,
    ToolResultReady,
    TurnEnded,
    TurnStarted,
    UsageReported,
)
from trading_agent.daemon.events import TurnCancelled
from trading_agent.errors import ConfigError
from trading_agent.telemetry.config import TelemetrySettings

__all__ = ["DEFAULT_PROVIDER", "GenAITracer", "ModelOf", "Tracing", "open_tracing",
           "parse_otlp_headers"]

_log = structlog.get_logger(__name__)

DEFAULT_PROVIDER = "openai"
"""``gen_ai.provider.name``: every backend of this daemon speaks OpenAI's chat API (the
conventions name the API's flavour here; ``gen_ai.request.model`` says which model)."""

ModelOf = Callable[[str], str | None]
"""The model a desk talks to, by the desk's name; None when unknown."""

_SCOPE = "trading_agent.telemetry"
_BUFFER = 20_000
"""Events the tracing subscription holds before new ones are dropped (a burst of text)."""
_SHUTDOWN_SECONDS = 2.0
"""The longest the last export may take when the daemon stops (less when its ten seconds
are nearly spent, see :mod:`trading_agent.app.stop_budget`)."""

# Attribute names, spelled out here: the semconv package marks its gen_ai constants as
# moved, and importing its enums warns.
_OPERATION = "gen_ai.operation.name"
_PROVIDER = "gen_ai.provider.name"
_SYSTEM = "gen_ai.system"
_AGENT_NAME = "gen_ai.agent.name"
_AGENT_ID = "gen_ai.agent.id"
_CONVERSATION = "gen_ai.conversation.id"
_REQUEST_MODEL = "gen_ai.request.model"
_INPUT_TOKENS = "gen_ai.usage.input_tokens"
_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
_CACHE_READ_TOKENS = "gen_ai.usage.cache_read.input_tokens"
_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
_TOOL_NAME = "gen_ai.tool.name"
_TOOL_CALL_ID = "gen_ai.tool.call.id"
_TOOL_TYPE = "gen_ai.tool.type"
_ERROR_TYPE = "error.type"

_WANTED = (TurnStarted, TurnEnded, ModelRequest, TextDelta, UsageReported, RetryScheduled,
           ToolCallStarted, ToolResultReady, ErrorEvent, CompactionStarted, TurnCancelled)

_LoopKey = tuple[str, str | None, str | None]
"""(desk, subagent, turn): one agent loop's turn; its model calls run one at a time."""


def _ns(at: float) -> int:
    return int(at * 1_000_000_000)


@dataclass(eq=False)
class _Open:
    """A span not ended yet, and the open spans under it."""

    span: Span
    started_at: float
    parent: _Open | None = None
    children: list[_Open] = field(default_factory=list)
    first_chunk_seen: bool = False
    index: dict[Any, _Open] | None = None
    """Where it is found by its key while open."""
    key: Any = None


class GenAITracer:
    """Turns a bus's events into spans as they are read; synchronous, no I/O.

    Args:
        tracer: Where spans are made.
        model_of: The model of a desk, for ``chat {model}`` and ``gen_ai.request.model``.
        provider: ``gen_ai.provider.name``.
    """

    def __init__(self, tracer: Tracer, *, model_of: ModelOf | None = None,
                 provider: str = DEFAULT_PROVIDER) -> None:
        self._tracer = tracer
        self._model_of = model_of
        self._provider = provider
        self._turns: dict[_LoopKey, _Open] = {}
        self._chats: dict[_LoopKey, _Open] = {}
        self._tools: dict[tuple[str, str], _Open] = {}
        """Open tool calls by (desk, call id): a subagent's turn finds its parent here."""
        self._last_at: dict[_LoopKey, float] = {}
        """When each loop last did something: where a model call without a request began."""

    @property
    def open_spans(self) -> int:
        """How many spans are started and not yet ended."""
        return len(self._turns) + len(self._chats) + len(self._tools)

    def handle(self, event: Event) -> None:
        """Opens, annotates or ends the spans an event stands for.

        Args:
            event: An event as the bus delivered it.
        """
        key: _LoopKey = (event.desk, event.subagent, event.turn)
        if isinstance(event, TurnStarted):
            self._turn_started(event, key)
        elif isinstance(event, TurnEnded):
            self._turn_ended(event, key)
        elif isinstance(event, ModelRequest):
            self._model_request(event, key)
        elif isinstance(event, TextDelta):
            self._text(event, key)
        elif isinstance(event, RetryScheduled):
            self._retry(event, key)
        elif isinstance(event, UsageReported):
            self._usage(event, key)
        elif isinstance(event, ToolCallStarted):
            self._tool_started(event, key)
        elif isinstance(event, ToolResultReady):
            self._tool_ended(event, key)
        elif isinstance(event, ErrorEvent):
            self._error(event, key)
        elif isinstance(event, TurnCancelled) and event.now:  # cut at once: no turn end comes
            for open_turn in self._desk_turns(event.desk):
                self._end(open_turn, event.at, error="cancelled")
        elif isinstance(event, EventsDropped):
            _log.warning("trace_events_dropped", count=event.count,
                         reason="the tracing subscription fell behind; spans may be missing")
        if key in self._turns or key[1:] == (None, None):  # bounded: open turns and desks
            self._last_at[key] = event.at

    def end_all(self, at: float | None = None, error: str = "shutdown") -> None:
        """Ends every open span (the daemon stops), marked with ``error``.

        Args:
            at: When, seconds since the epoch (now by default).
            error: Their ``error.type``.
        """
        at = time.time() if at is None else at
        for record in [*self._turns.values(), *self._chats.values(), *self._tools.values()]:
            if record.parent is None:
                self._end(record, at, error=error)
        for record in [*self._chats.values(), *self._tools.values(), *self._turns.values()]:
            self._end(record, at, error=error)
        self._last_at.clear()

    # ------------------------------------------------------------------ turns

    def _turn_started(self, event: TurnStarted, key: _LoopKey) -> None:
        if event.subagent is None:
            # A desk runs one turn at a time: one still open never ended (it crashed, or its
            # end was dropped); it ended when it last did something.
            for stale in self._desk_turns(event.desk):
                self._end(stale, self._last_at.get(stale.key, event.at), error="interrupted")
        parent = (self._tools.get((event.desk, event.parent_call))
                  if event.parent_call is not None else None)
        attributes = self._common("invoke_agent", event.desk)
        attributes.update({_AGENT_NAME: event.desk,
                           _CONVERSATION: event.subagent or event.desk,
                           "trading_agent.trigger.kind": event.trigger_kind})
        if event.turn is not None:
            attributes["trading_agent.turn.id"] = event.turn
        if event.subagent is not None:
            attributes[_AGENT_ID] = event.subagent
        if event.silent:
            attributes["trading_agent.turn.silent"] = True
        record = self._start(f"invoke_agent {event.desk}", SpanKind.INTERNAL, attributes,
                             event.at, parent)
        self._register(self._turns, key, record)

    def _turn_ended(self, event: TurnEnded, key: _LoopKey) -> None:
        record = self._turns.get(key)
        if record is None:
            return
        span = record.span
        span.set_attributes({_INPUT_TOKENS: event.input_tokens,
                             _OUTPUT_TOKENS: event.output_tokens,
                             _CACHE_READ_TOKENS: event.cached_input_tokens,
                             "trading_agent.turn.rounds": event.rounds})
        if event.cost is not None:
            span.set_attribute("trading_agent.cost", event.cost)
        if event.hit_round_limit:
            span.set_attribute("trading_agent.turn.hit_round_limit", True)
        if event.stopped:
            span.set_attribute("trading_agent.turn.stopped", True)
        self._end(record, event.at)

    def _desk_turns(self, desk: str) -> list[_Open]:
        return [record for (d, subagent, _), record in self._turns.items()
                if d == desk and subagent is None]

    # ------------------------------------------------------------------ model calls

    def _model_request(self, event: ModelRequest, key: _LoopKey) -> None:
        previous = self._chats.get(key)
        if previous is not None:  # its usage never came (dropped): it ended by now
            self._end(previous, event.at, error="interrupted")
        record = self._start_chat(event.desk, key, event.at)
        record.span.set_attributes({"trading_agent.round": event.round,
                                    "trading_agent.request.estimated_tokens":
                                        event.estimated_tokens})

    def _start_chat(self, desk: str, key: _LoopKey, at: float) -> _Open:
        model = self._model(desk)
        attributes = self._common("chat", desk)
        attributes[_CONVERSATION] = key[1] or desk
        record = self._start(f"chat {model}" if model else "chat", SpanKind.CLIENT, attributes,
                             at, self._turns.get(key))
        self._register(self._chats, key, record)
        return record

    def _text(self, event: TextDelta, key: _LoopKey) -> None:
        record = self._chats.get(key)
        if record is not None and not record.first_chunk_seen:
            record.first_chunk_seen = True
            record.span.set_attribute(_FIRST_CHUNK, max(0.0, event.at - record.started_at))

    def _retry(self, event: RetryScheduled, key: _LoopKey) -> None:
        record = self._chats.get(key)
        if record is None:
            return
        attributes: dict[str, Any] = {"attempt": event.attempt, "delay_seconds": event.delay}
        if event.status_code is not None:
            attributes["http.response.status_code"] = event.status_code
        record.span.add_event("retry", attributes, timestamp=_ns(event.at))

    def _usage(self, event: UsageReported, key: _LoopKey) -> None:
        record = self._chats.get(key)
        if record is None:
            # A call the loop made without a ModelRequest (a compaction's summary): it began
            # when the loop last did something.
            record = self._start_chat(event.desk, key, self._last_at.get(key, event.at))
        span = record.span
        span.set_attributes({_INPUT_TOKENS: event.input_tokens,
                             _OUTPUT_TOKENS: event.output_tokens,
                             _CACHE_READ_TOKENS: event.cached_input_tokens})
        if event.estimated:
            span.set_attribute("trading_agent.usage.estimated", True)
        if event.cost is not None:
            span.set_attribute("trading_agent.cost", event.cost)
        self._end(record, event.at)

    # ------------------------------------------------------------------ tool calls

    def _tool_started(self, event: ToolCallStarted, key: _LoopKey) -> None:
        attributes = self._common("execute_tool", event.desk)
        attributes.update({_TOOL_NAME: event.name, _TOOL_CALL_ID: event.call_id,
                           _TOOL_TYPE: "function"})
        record = self._start(f"execute_tool {event.name}", SpanKind.INTERNAL, attributes,
                             event.at, self._turns.get(key))
        tool_key = (event.desk, event.call_id)
        previous = self._tools.get(tool_key)
        if previous is not None:
            self._end(previous, event.at, error="interrupted")
        self._register(self._tools, tool_key, record)

    def _tool_ended(self, event: ToolResultReady, key: _LoopKey) -> None:
        record = self._tools.get((event.desk, event.call_id))
        if record is None:  # its start was dropped: the result says how long it took
            self._tool_started(ToolCallStarted(
                desk=event.desk, turn=event.turn, subagent=event.subagent,
                parent_call=event.parent_call, at=event.at - event.duration,
                call_id=event.call_id, name=event.name, arguments=""), key)
            record = self._tools[(event.desk, event.call_id)]
        if event.image_count:
            record.span.set_attribute("trading_agent.tool.image_count", event.image_count)
        self._end(record, event.at, error="tool_error" if event.is_error else None)

    # ------------------------------------------------------------------ failures

    def _error(self, event: ErrorEvent, key: _LoopKey) -> None:
        error = event.error_type or "_OTHER"
        chat = self._chats.get(key)
        if chat is not None:
            chat.span.set_status(Status(StatusCode.ERROR, _short(event.message)))
            self._end(chat, event.at, error=error)
        if event.turn is not None:
            turns = [t for t in [self._turns.get(key)] if t is not None]
        elif event.subagent is not None:  # the subagent failed: it does nothing more
            turns = [t for (d, s, _), t in self._turns.items()
                     if d == event.desk and s == event.subagent]
        else:
            # A desk's error without a turn may be a service beside a healthy turn: the
            # turn is left to end, or to be closed when the desk's next turn starts.
            turns = []
        for record in turns:
            record.span.set_status(Status(StatusCode.ERROR, _short(event.message)))
            self._end(record, event.at, error=error)

    # ------------------------------------------------------------------ spans

    def _model(self, desk: str) -> str | None:
        if self._model_of is None:
            return None
        try:
            return self._model_of(desk)
        except Exception:  # a desk a reload just removed: the span goes without it
            return None

    def _common(self, operation: str, desk: str) -> dict[str, Any]:
        attributes: dict[str, Any] = {_OPERATION: operation, _PROVIDER: self._provider,
                                      _SYSTEM: self._provider}
        model = self._model(desk)
        if model:
            attributes[_REQUEST_MODEL] = model
        return attributes

    def _start(self, name: str, kind: SpanKind, attributes: Mapping[str, Any], at: float,
               parent: _Open | None) -> _Open:
        context = (trace.set_span_in_context(parent.span) if parent is not None
                   else Context())  # a root: never whatever span happens to be current
        span = self._tracer.start_span(name, context=context, kind=kind,
                                       attributes=attributes, start_time=_ns(at))
        record = _Open(span, at, parent)
        if parent is not None:
            parent.children.append(record)
        return record

    @staticmethod
    def _register(index: dict[Any, _Open], key: Any, record: _Open) -> None:
        index[key] = record
        record.index, record.key = index, key

    def _end(self, record: _Open, at: float, *, error: str | None = None) -> None:
        """Ends a span and, first, its open children (at the same time, with the same
        error: a turn cut short cuts its calls short)."""
        for child in list(record.children):
            self._end(child, at, error=error)
        if error is not None:
            record.span.set_attribute(_ERROR_TYPE, error)
            record.span.set_status(Status(StatusCode.ERROR))
        record.span.end(end_time=max(_ns(at), _ns(record.started_at)))
        if record.index is not None and record.index.get(record.key) is record:
            del record.index[record.key]
            if record.index is self._turns:
                self._last_at.pop(record.key, None)
        record.index = None
        if record.parent is not None and record in record.parent.children:
            record.parent.children.remove(record)


def _short(message: str) -> str:
    return message if len(message) <= 300 else message[:299] + "…"


class Tracing:
    """A daemon's traces: a tracer provider of its own, fed from a bus subscription.

    Run :meth:`run` as one of the daemon's services; :meth:`aclose` when it stops.

    Args:
        provider: The tracer provider (its processors export the spans).
        subscription: The bus subscription the spans are built from.
        model_of: The model of each desk.
        provider_name: ``gen_ai.provider.name``.
    """

    def __init__(self, provider: TracerProvider, subscription: Subscription, *,
                 model_of: ModelOf | None = None,
                 provider_name: str = DEFAULT_PROVIDER) -> None:
        self.provider = provider
        self.subscription = subscription
        self.tracer = GenAITracer(provider.get_tracer(_SCOPE), model_of=model_of,
                                  provider=provider_name)
        self._closed = False

    @classmethod
    def on_bus(cls, provider: TracerProvider, bus: EventBus, *,
               model_of: ModelOf | None = None,
               provider_name: str = DEFAULT_PROVIDER) -> Tracing:
        """Subscribes to the events spans are made of.

        Args:
            provider: The tracer provider.
            bus: The daemon's bus.
            model_of: The model of each desk.
            provider_name: ``gen_ai.provider.name``.

        Returns:
            The tracing, subscribed (events are held until :meth:`run` reads them).
        """
        subscription = bus.subscribe("traces", max_buffer=_BUFFER,
                                     accept=lambda e: isinstance(e, _WANTED))
        return cls(provider, subscription, model_of=model_of, provider_name=provider_name)

    async def run(self) -> None:
        """Builds spans from the events until the subscription closes (a daemon service)."""
        async for event in self.subscription:
            self._handle(event)

    def drain(self) -> None:
        """Builds spans from the events already waiting, without waiting for more."""
        while (event := self.subscription.get_nowait()) is not None:
            self._handle(event)

    def _handle(self, event: Event) -> None:
        try:
            self.tracer.handle(event)
        except Exception as exc:  # a span gone wrong must not stop the traces
            _log.error("trace_event_failed", event_type=event.type, event_id=event.id,
                       error=f"{type(exc).__name__}: {exc}")

    async def aclose(self, within: float = _SHUTDOWN_SECONDS) -> None:
        """Stops reading, ends what is open, and exports what is left, for at most
        ``within`` seconds (a couple by default).

        The export runs in a daemon thread of its own, abandoned at the deadline: a
        collector that never answers (the exporter's own timeout may be minutes) can
        neither hold the daemon's exit nor a worker thread the interpreter would wait for.

        Args:
            within: The most the last export may take (a stopping daemon gives what is
                left of its ten seconds).
        """
        if self._closed:
            return
        self._closed = True
        self.subscription.close()
        self.drain()
        self.tracer.end_all()
        within = min(within, _SHUTDOWN_SECONDS)
        done = threading.Event()

        def shutdown() -> None:
            try:
                self.provider.force_flush(int(within * 1000))
                self.provider.shutdown()
            finally:
                done.set()

        threading.Thread(target=shutdown, name="trace-export-on-exit", daemon=True).start()
        with anyio.CancelScope(shield=True):
            # Event.wait returns by its timeout: the worker thread is never left blocked.
            if not await anyio.to_thread.run_sync(done.wait, within):
                _log.warning("traces_not_exported", reason=f"the collector did not answer "
                             f"within {within:g} s of the shutdown")


def parse_otlp_headers(text: str, variable: str) -> dict[str, str]:
    """Reads ``key=value,key2=value2`` (values percent-encoded), the format of
    ``OTEL_EXPORTER_OTLP_HEADERS``.

    Args:
        text: The variable's value.
        variable: Its name, for the error.

    Returns:
        The headers.

    Raises:
        ConfigError: A pair without ``=`` or with an empty key; the message never shows the
            value.
    """
    headers: dict[str, str] = {}
    for index, pair in enumerate(p for p in text.split(",") if p.strip()):
        key, separator, value = pair.partition("=")
        if not separator or not key.strip():
            raise ConfigError(f"telemetry.otlp_headers_env: the variable {variable} must hold "
                              f"key=value pairs separated by commas; pair {index + 1} is not "
                              "one (its text is not shown: it may be a secret)")
        headers[key.strip().lower()] = urllib.parse.unquote(value.strip())
    return headers


def open_tracing(settings: TelemetrySettings, bus: EventBus, *,
                 environ: Mapping[str, str] | None = None, model_of: ModelOf | None = None,
                 provider_name: str = DEFAULT_PROVIDER) -> Tracing | None:
    """The daemon's traces, exported over OTLP/HTTP; None when no endpoint is configured.

    Args:
        settings: The ``[telemetry]`` settings.
        bus: The daemon's bus.
        environ: Where ``otlp_headers_env`` is read (``os.environ`` by default).
        model_of: The model of each desk.
        provider_name: ``gen_ai.provider.name``.

    Returns:
        The tracing, subscribed to the bus; run its :meth:`Tracing.run` as a service and
        await its :meth:`Tracing.aclose` on the way out. None: nothing was set up.

    Raises:
        ConfigError: ``otlp_headers_env`` names a variable that is unset, empty or not
            ``key=value`` pairs.
    """
    url = settings.traces_url()
    if url is None:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    environ = os.environ if environ is None else environ
    headers: dict[str, str] = {}
    if settings.otlp_headers_env is not None:
        text = environ.get(settings.otlp_headers_env, "")
        if not text.strip():
            raise ConfigError(f"telemetry.otlp_headers_env: the environment variable "
                              f"{settings.otlp_headers_env} is not set or empty")
        headers = parse_otlp_headers(text, settings.otlp_headers_env)
    exporter = OTLPSpanExporter(endpoint=url, headers=headers,
                                timeout=settings.export_timeout_seconds)
    provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name}),
                              shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _log.info("traces_exported", endpoint=_without_credentials(url),
              service_name=settings.service_name)
    return Tracing.on_bus(provider, bus, model_of=model_of, provider_name=provider_name)


def _without_credentials(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"
