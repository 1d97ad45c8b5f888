"""GenAI traces built from a real agent loop's events, read back from an in-memory exporter
and from a local OTLP/HTTP receiver.

The loop runs against the scripted OpenAI-compatible server over real HTTP; the spans are
what an operator's tracing backend would show: one ``invoke_agent`` per turn with its
``chat`` and ``execute_tool`` children, and the ``gen_ai.*`` attributes.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pydantic import BaseModel, ValidationError

from tests.daemon_config import write_daemon_config
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, Step, ToolCall
from tests.scripted_server import server_error as scripted_server_error
from trading_agent.agent import (
    AgentLoop,
    Conversation,
    EventBus,
    RetryPolicy,
    ToolCallExecutor,
    ToolContext,
    ToolRegistry,
    Trigger,
)
from trading_agent.agent.events import (
    ErrorEvent,
    ModelRequest,
    ToolCallStarted,
    TurnEnded,
    TurnStarted,
)
from trading_agent.app.services import open_daemon
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.daemon.events import TurnCancelled
from trading_agent.errors import BackendUnavailableError, ConfigError
from trading_agent.settings import load_settings
from trading_agent.telemetry.config import TelemetrySettings
from trading_agent.telemetry.traces import Tracing, open_tracing
from trading_agent.tools.config import DELEGATE_TOOL_NAME, SubagentConfig
from trading_agent.tools.delegate import register_delegate_tool

MODEL = "scripted-model"
DESK = "alpha"


class SymbolArguments(BaseModel):
    symbol: str


def _registry() -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(description="Last price of a market.")
    async def get_ticker(arguments: SymbolArguments, context: ToolContext) -> str:
        if arguments.symbol == "CRASH/USDT":
            raise ConnectionError("exchange unreachable")
        await anyio.sleep(0.02)  # long enough to see the span's duration
        return f"{arguments.symbol} last 21,034.50"

    return registry


@pytest.fixture
async def backend(scripted_server: ScriptedServer) -> AsyncIterator[OpenAICompatibleBackend]:
    config = OpenAIBackendConfig(base_url=scripted_server.base_url, model=MODEL,
                                 context_window=32_000, request_timeout=2.0)
    async with OpenAICompatibleBackend(config) as created:
        yield created


class Traced:
    """A desk's loop on a bus, and the traces built from that bus into memory."""

    def __init__(self, backend: OpenAICompatibleBackend, registry: ToolRegistry) -> None:
        self.bus = EventBus()
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider(shutdown_on_exit=False)
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracing = Tracing.on_bus(provider, self.bus,
                                      model_of=lambda desk: MODEL if desk == DESK else None)
        self.loop = AgentLoop(DESK, backend, ToolCallExecutor(registry), self.bus,
                              maximum_rounds=6)
        self.sleeps: list[float] = []
        self.loop.retry_policy = RetryPolicy(sleep=self._sleep)
        self.conversation = Conversation("You run a BTC desk.")

    async def _sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)

    async def turn(self, text: str) -> None:
        """Runs one turn with the tracing service beside it, then stops the tracing.

        Raises:
            Exception: What the turn raised (once the tracing is closed).
        """
        failure: Exception | None = None
        async with anyio.create_task_group() as group:
            group.start_soon(self.tracing.run)
            try:
                await self.loop.run_turn(self.conversation, Trigger("tick", text))
            except Exception as exc:
                failure = exc
            await self.tracing.aclose()  # closes the subscription: run() ends
        if failure is not None:
            raise failure

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


def _one(spans: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{name}: {[s.name for s in spans]}"
    return found[0]


def _parent_of(span: ReadableSpan, spans: Sequence[ReadableSpan]) -> ReadableSpan | None:
    if span.parent is None:
        return None
    return next(s for s in spans if s.context is not None
                and s.context.span_id == span.parent.span_id)


def _attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_a_turn_with_a_tool_call_is_one_trace(backend: OpenAICompatibleBackend,
                                                    scripted_server: ScriptedServer) -> None:
    scripted_server.add(
        Reply("Let me look.", tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"},
                                                   id="call_ticker")],
              usage=(1200, 30), cached_tokens=1000),
        Reply("BTC is at 21,034.50; no trade.", text_chunks=3, usage=(1300, 12),
              cached_tokens=1150),
    )
    traced = Traced(backend, _registry())
    await traced.turn("BTC/USDT moved 1.2%")
    scripted_server.assert_complete()

    spans = traced.spans()
    assert sorted(s.name for s in spans) == sorted([
        f"invoke_agent {DESK}", f"chat {MODEL}", f"chat {MODEL}", "execute_tool get_ticker"])
    turn = _one(spans, f"invoke_agent {DESK}")
    chats = sorted((s for s in spans if s.name == f"chat {MODEL}"),
                   key=lambda s: s.start_time or 0)
    tool = _one(spans, "execute_tool get_ticker")

    # One trace; the turn is its root and every call is a child of the turn.
    assert turn.parent is None
    assert {s.context.trace_id for s in spans if s.context is not None} == {
        turn.context.trace_id if turn.context else 0}
    for child in (*chats, tool):
        assert _parent_of(child, spans) is turn

    assert turn.kind == SpanKind.INTERNAL
    assert _attributes(turn) | {"trading_agent.turn.id": "ignored"} == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": "openai",
        "gen_ai.system": "openai",
        "gen_ai.agent.name": DESK,
        "gen_ai.conversation.id": DESK,
        "gen_ai.request.model": MODEL,
        "gen_ai.usage.input_tokens": 2500,
        "gen_ai.usage.output_tokens": 42,
        "gen_ai.usage.cache_read.input_tokens": 2150,
        "trading_agent.trigger.kind": "tick",
        "trading_agent.turn.id": "ignored",
        "trading_agent.turn.rounds": 2,
    }
    first, second = chats
    assert first.kind == SpanKind.CLIENT
    assert {key: _attributes(first)[key] for key in (
        "gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model",
        "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
        "gen_ai.usage.cache_read.input_tokens", "trading_agent.round")} == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
        "gen_ai.request.model": MODEL, "gen_ai.usage.input_tokens": 1200,
        "gen_ai.usage.output_tokens": 30, "gen_ai.usage.cache_read.input_tokens": 1000,
        "trading_agent.round": 1}
    assert _attributes(second)["gen_ai.usage.cache_read.input_tokens"] == 1150
    assert _attributes(second)["trading_agent.round"] == 2
    assert 0 <= _attributes(second)["gen_ai.response.time_to_first_chunk"] < 2.0
    assert _attributes(tool) == {
        "gen_ai.operation.name": "execute_tool", "gen_ai.provider.name": "openai",
        "gen_ai.system": "openai", "gen_ai.request.model": MODEL,
        "gen_ai.tool.name": "get_ticker", "gen_ai.tool.call.id": "call_ticker",
        "gen_ai.tool.type": "function"}

    # The spans keep the events' times: in order, inside the turn, the tool call ~20 ms.
    assert all(s.status.status_code == StatusCode.UNSET for s in spans)
    assert turn.start_time is not None and turn.end_time is not None
    order = [first, tool, second]
    for earlier, later in itertools.pairwise(order):
        assert earlier.end_time is not None and later.start_time is not None
        assert earlier.end_time <= later.start_time
    for span in order:
        assert span.start_time is not None and span.end_time is not None
        assert turn.start_time <= span.start_time <= span.end_time <= turn.end_time
    assert tool.end_time is not None and tool.start_time is not None
    assert tool.end_time - tool.start_time >= 15_000_000


async def test_a_failing_tool_and_a_model_that_stays_down_are_errors(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(
        Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "CRASH/USDT"}, id="crash")],
              usage=(100, 5)),
        *[scripted_server_error(503, "overloaded")] * 4,
    )
    traced = Traced(backend, _registry())
    with pytest.raises(BackendUnavailableError):
        await traced.turn("moved")
    scripted_server.assert_complete()

    spans = traced.spans()
    turn = _one(spans, f"invoke_agent {DESK}")
    tool = _one(spans, "execute_tool get_ticker")
    failed_chat = max((s for s in spans if s.name == f"chat {MODEL}"),
                      key=lambda s: s.start_time or 0)
    assert _attributes(tool)["error.type"] == "tool_error"
    assert tool.status.status_code == StatusCode.ERROR
    assert _parent_of(failed_chat, spans) is turn
    for span in (failed_chat, turn):
        assert _attributes(span)["error.type"] == "BackendUnavailableError"
        assert span.status.status_code == StatusCode.ERROR
    # The three retries are events of the one model call, with the server's status.
    retries = [e for e in failed_chat.events if e.name == "retry"]
    assert [(e.attributes or {}).get("attempt") for e in retries] == [1, 2, 3]
    assert {(e.attributes or {}).get("http.response.status_code") for e in retries} == {503}
    assert "gen_ai.usage.input_tokens" not in _attributes(failed_chat)


def _subagent_model(request: RecordedRequest) -> Step:
    """The desk delegates once, its subagent answers, then the desk answers."""
    if str(request.messages[0]["content"]).startswith("SUBAGENT"):
        return Reply("Report: BTC is calm.", usage=(50, 5))
    if any(m["role"] == "tool" for m in request.messages):
        return Reply("Nothing to do.", usage=(300, 6))
    return Reply(tool_calls=[ToolCall(DELEGATE_TOOL_NAME, {"task": "Check BTC."},
                                      id="call_delegate")], usage=(200, 8))


async def test_a_subagent_turn_nests_under_the_delegate_call(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.responder = _subagent_model
    registry = _registry()
    register_delegate_tool(registry, SubagentConfig(system_prompt="SUBAGENT for {desk}."),
                           backend=backend)
    traced = Traced(backend, registry)
    await traced.turn("Look around.")

    spans = traced.spans()
    turns = [s for s in spans if s.name == f"invoke_agent {DESK}"]
    assert len(turns) == 2
    desk_turn = next(s for s in turns if s.parent is None)
    sub_turn = next(s for s in turns if s.parent is not None)
    delegate = _one(spans, f"execute_tool {DELEGATE_TOOL_NAME}")
    assert _parent_of(delegate, spans) is desk_turn
    assert _parent_of(sub_turn, spans) is delegate
    sub_id = _attributes(sub_turn)["gen_ai.agent.id"]
    assert str(sub_id).startswith("sub-")
    assert _attributes(sub_turn)["gen_ai.conversation.id"] == sub_id
    assert _attributes(sub_turn)["trading_agent.trigger.kind"] == "subagent"
    sub_chats = [s for s in spans if s.name == f"chat {MODEL}"
                 and _parent_of(s, spans) is sub_turn]
    assert [_attributes(s)["gen_ai.usage.input_tokens"] for s in sub_chats] == [50]
    # The desk's turn counts its subagent's tokens too.
    assert _attributes(desk_turn)["gen_ai.usage.input_tokens"] == 200 + 50 + 300
    assert len({s.context.trace_id for s in spans if s.context is not None}) == 1


async def test_a_turn_that_never_ended_is_closed_when_the_next_one_starts() -> None:
    bus = EventBus()
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing.on_bus(provider, bus)
    # Turn t1 crashes after its model call (the desk publishes no turn end, only a
    # turn-less error, as Desk._failed does); a market service fails during turn t2 (a
    # turn-less error too), which ends normally; turn t3 is cut at once by an operator.
    bus.publish(TurnStarted(desk=DESK, turn="t1", trigger_kind="tick", trigger_text="", at=10))
    bus.publish(ModelRequest(desk=DESK, turn="t1", round=1, message_count=2, tool_count=0,
                             estimated_tokens=50, image_count=0, at=11))
    bus.publish(ErrorEvent(desk=DESK, message="TypeError: boom", error_type="TypeError",
                           at=12))
    bus.publish(TurnStarted(desk=DESK, turn="t2", trigger_kind="tick", trigger_text="", at=20))
    bus.publish(ErrorEvent(desk=DESK, message="market failed", error_type="OSError", at=21))
    bus.publish(TurnEnded(desk=DESK, turn="t2", rounds=0, hit_round_limit=False,
                          final_text="", input_tokens=0, output_tokens=0, cost=None, at=22))
    bus.publish(TurnStarted(desk=DESK, turn="t3", trigger_kind="tick", trigger_text="", at=30))
    bus.publish(ToolCallStarted(desk=DESK, turn="t3", call_id="c1", name="wait",
                                arguments="{}", at=31))
    bus.publish(TurnCancelled(desk=DESK, by="alice", now=True, at=32))
    tracing.drain()
    assert tracing.tracer.open_spans == 0

    by_turn = {_attributes(s).get("trading_agent.turn.id"): s for s in exporter.get_finished_spans()
               if s.name.startswith("invoke_agent")}
    first, second, third = by_turn["t1"], by_turn["t2"], by_turn["t3"]
    assert _attributes(first)["error.type"] == "interrupted"
    assert first.end_time == 11 * 10**9  # when it last did something, not when t2 began
    assert "error.type" not in _attributes(second)
    assert second.status.status_code == StatusCode.UNSET
    assert _attributes(third)["error.type"] == "cancelled"
    tool = next(s for s in exporter.get_finished_spans() if s.name == "execute_tool wait")
    assert (_attributes(tool)["error.type"], tool.end_time) == ("cancelled", 32 * 10**9)
    await tracing.aclose()


async def test_without_an_endpoint_nothing_is_set_up() -> None:
    threads = {t.name for t in threading.enumerate()}
    provider = trace.get_tracer_provider()
    assert open_tracing(TelemetrySettings(), EventBus(), environ={}) is None
    # No exporter thread started, the global provider untouched.
    assert {t.name for t in threading.enumerate()} <= threads
    assert trace.get_tracer_provider() is provider


# --------------------------------------------------------------------------- OTLP over HTTP


class _Collector:
    """A local OTLP/HTTP receiver: records each export's spans and headers."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], ExportTraceServiceRequest]] = []
        self.received = threading.Event()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                collector.requests.append((self.path, dict(self.headers.items()), request))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()
                collector.received.set()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self) -> _Collector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


@pytest.fixture
def collector() -> Iterator[_Collector]:
    with _Collector() as running:
        yield running


async def test_spans_reach_a_configured_otlp_endpoint(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        collector: _Collector) -> None:
    scripted_server.add(
        Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"}, id="t1")],
              usage=(80, 4)),
        Reply("Calm.", usage=(90, 2)),
    )
    settings = TelemetrySettings(otlp_endpoint=f"http://127.0.0.1:{collector.port}",
                                 otlp_headers_env="TEST_OTLP_HEADERS", service_name="desk-ops")
    bus = EventBus()
    tracing = open_tracing(settings, bus, model_of=lambda desk: MODEL,
                           environ={"TEST_OTLP_HEADERS": "Authorization=Bearer%20s3cret-token"})
    assert tracing is not None
    loop = AgentLoop(DESK, backend, ToolCallExecutor(_registry()), bus, maximum_rounds=4)
    async with anyio.create_task_group() as group:
        group.start_soon(tracing.run)
        await loop.run_turn(Conversation("You run a BTC desk."), Trigger("tick", "moved"))
        await tracing.aclose()  # flushes the batch to the collector

    assert collector.requests, "nothing was exported"
    path, headers, _ = collector.requests[0]
    assert path == "/v1/traces"
    assert {k.lower(): v for k, v in headers.items()}["authorization"] == "Bearer s3cret-token"
    exported = [(span.name, resource.resource)
                for _, _, request in collector.requests
                for resource in request.resource_spans
                for scope in resource.scope_spans for span in scope.spans]
    assert sorted(name for name, _ in exported) == sorted([
        f"invoke_agent {DESK}", f"chat {MODEL}", f"chat {MODEL}", "execute_tool get_ticker"])
    service = {a.key: a.value.string_value for a in exported[0][1].attributes}["service.name"]
    assert service == "desk-ops"


def test_a_bad_endpoint_or_missing_headers_variable_is_a_clear_error() -> None:
    with pytest.raises(ValidationError, match="http:// or https:// URL"):
        TelemetrySettings(otlp_endpoint="collector:4318")
    settings = TelemetrySettings(otlp_endpoint="http://127.0.0.1:4318",
                                 otlp_headers_env="MISSING_OTLP_HEADERS")
    with pytest.raises(ConfigError, match="MISSING_OTLP_HEADERS is not set"):
        open_tracing(settings, EventBus(), environ={})
    with pytest.raises(ConfigError, match="key=value") as raised:
        open_tracing(settings, EventBus(), environ={"MISSING_OTLP_HEADERS": "just-a-token"})
    assert "just-a-token" not in str(raised.value)
    assert settings.traces_url() == "http://127.0.0.1:4318/v1/traces"
    assert TelemetrySettings(otlp_endpoint="https://c.example/v1/traces/").traces_url() == (
        "https://c.example/v1/traces")


async def test_a_daemon_with_an_endpoint_exports_its_desks_turns(
        scripted_server: ScriptedServer, collector: _Collector, tmp_path: Path) -> None:
    scripted_server.add(Reply("Calm.", usage=(90, 2)))
    config = write_daemon_config(
        tmp_path, scripted_server.base_url, model={"model": MODEL, "request_timeout": None},
        tables={"telemetry": {"otlp_endpoint": f"http://127.0.0.1:{collector.port}"}},
        desks={"alpha": {"system_prompt": "You are alpha."}})
    async with open_daemon(load_settings(config), environ={}) as daemon, \
            anyio.create_task_group() as group:
        group.start_soon(daemon.store.events.persist_events, daemon.store_subscription)
        await group.start(daemon.supervisor.run)
        await daemon.supervisor.send_message("alpha", "How is BTC?")
        with anyio.fail_after(10):
            while daemon.supervisor.desk("alpha").turns < 1:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        group.cancel_scope.cancel()
    # Closing the daemon flushed the batch.
    names = sorted(span.name for _, _, request in collector.requests
                   for resource in request.resource_spans
                   for scope in resource.scope_spans for span in scope.spans)
    assert names == [f"chat {MODEL}", "invoke_agent alpha"]
