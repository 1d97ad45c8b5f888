"""Orphans are impossible and pictures stay few, across 1,000 randomized desk conversations.

A scenario is a desk's day in miniature: turns opened by ticks and operator messages (some
with a picture), the model's answers drawn at random (tool calls for a ticker, a chart image,
huge candle dumps, the memory tool, a tool during which an operator writes or the turn is
cancelled; final answers, some written while an operator writes; transient failures and
context overflows), and between turns a ``/compact`` or a simulated crash that lost the last
tool results. The window is small, so compactions (with memory flushes) happen all the time.

- :func:`test_every_request_is_valid_in_process`: 1,000 examples (``max_examples=1000``,
  deadline None) drive the real :class:`AgentLoop` (executor, compressor, steering inbox,
  image preparer, event bus) through :class:`ScriptedModel`, an in-process scripted
  :class:`~trading_agent.agent.backend.ModelBackend` that checks every request it receives:
  each tool call answered by exactly one result right after it, no result without its call,
  at most four images, nothing over the window (a summary request with its answer), and a
  retried request byte-identical (OpenAI wire encoding) to the one that failed.
- :func:`test_every_request_is_valid_over_http`: 40 examples of the same scenarios through
  the real :class:`OpenAICompatibleBackend` and the scripted HTTP server, checking the bodies
  the server received: every assistant ``tool_call`` id followed by exactly one ``tool``
  message with that id, no ``tool`` message without its call, at most four ``image_url``
  parts, nothing over the window.

After each scenario: no steering message lost or delivered twice, the flush turn silent and
absent from the transcript, and the transcript append-only (compaction changes only what
is sent). Plus two small properties: ``repair`` is idempotent and always valid, and
``find_cut`` never separates a call from its results.
"""

from __future__ import annotations

import io
import itertools
import json
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.lowlevel
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from pydantic import BaseModel

from tests.scripted_server import (
    RecordedRequest,
    Reply,
    ScriptedServer,
    Step,
    ToolCall,
    context_overflow,
    server_error,
)
from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec, Usage
from trading_agent.agent.context_compressor import (
    FLUSH_NO_OP,
    FLUSH_TRIGGER_PREFIX,
    ContextCompressor,
    find_cut,
    request_tokens,
)
from trading_agent.agent.conversation import (
    IMAGE_TOKEN_COST,
    ContentBlock,
    Conversation,
    ImageBlock,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    repair,
)
from trading_agent.agent.event_bus import EventBus, Subscription
from trading_agent.agent.events import (
    Event,
    MemoryFlush,
    SteeringDelivered,
    TextDelta,
    TurnStarted,
)
from trading_agent.agent.image_preparer import ImagePreparer
from trading_agent.agent.steering_inbox import SteeringInbox, SteeringMessage
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import ToolContext, ToolOutput, ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend, encode_message
from trading_agent.errors import (
    BackendUnavailableError,
    ContextOverflowError,
    TransientBackendError,
)

SYSTEM_PROMPT = "You are the desk alpha. Trade BTC/USDT with care; explain each decision."
SUMMARY_MARK = "You maintain the running summary"
FLUSH_MARK = "[Memory flush]"
SUMMARY_REPLY = ("## Goal\n- trade BTC/USDT\n## Positions and open orders\n- long 0.1 BTC at "
                 "64000, stop 62000\n## Decisions and why\n- bought the breakout\n## Risks\n"
                 "- a failed retest\n## Next steps\n- watch 65000")


def _chart_png(size: int = 24) -> bytes:
    image = Image.new("RGB", (size, size), "white")
    for x in range(size):
        image.putpixel((x, (x * 7) % size), (0, 90, 200))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


CHART = ImagePreparer().prepare(_chart_png(), "chart")


# --------------------------------------------------------------------------- invariants


def message_problems(messages: Sequence[Message]) -> list[str]:
    """What is wrong with a request's messages: unanswered calls, results without a call."""
    problems: list[str] = []
    index = 0
    while index < len(messages):
        message = messages[index]
        if message.role == "assistant" and message.tool_uses:
            ids = [call.id for call in message.tool_uses]
            following = messages[index + 1] if index + 1 < len(messages) else None
            answered = [] if following is None or following.kind != "tool_results" else [
                result.tool_use_id for result in following.tool_results]
            if answered != ids:
                problems.append(f"calls {ids} answered by {answered}")
            index += 2 if following is not None and following.kind == "tool_results" else 1
            continue
        if message.tool_results:
            problems.append(f"results {[r.tool_use_id for r in message.tool_results]} "
                            "without their calls")
        index += 1
    return problems


def image_count(messages: Sequence[Message]) -> int:
    """How many pictures a request's messages hold."""
    return sum(message.image_count for message in messages)


def wire_tokens(body: dict[str, Any]) -> int:
    """A request body's size as the scripted server counts it: characters / 4 of every text,
    name and argument (16 characters of framing a message), a fixed cost per image."""
    chars, images = len(json.dumps(body.get("tools") or [], separators=(",", ":"))), 0
    for message in body["messages"]:
        chars += 16
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if part.get("type") == "text":
                    chars += len(part["text"])
                else:
                    images += 1
        for call in message.get("tool_calls") or ():
            chars += 16 + len(call["function"]["name"]) + len(call["function"]["arguments"])
    return chars // 4 + images * IMAGE_TOKEN_COST


def wire_images(body: dict[str, Any]) -> int:
    """How many ``image_url`` parts a request body holds."""
    return sum(1 for message in body["messages"] if isinstance(message.get("content"), list)
               for part in message["content"] if part.get("type") == "image_url")


def wire_problems(body: dict[str, Any], window: int) -> list[str]:
    """What is wrong with a request body: every assistant tool_call id must be followed by
    exactly one tool message with that id, no tool message may come without its call, at
    most four images, nothing over the window (a summary request with its answer's cap)."""
    problems: list[str] = []
    messages = body["messages"]
    index = 0
    while index < len(messages):
        message = messages[index]
        if message["role"] == "assistant" and message.get("tool_calls"):
            ids = [call["id"] for call in message["tool_calls"]]
            index += 1
            answered = []
            while index < len(messages) and messages[index]["role"] == "tool":
                answered.append(messages[index]["tool_call_id"])
                index += 1
            if sorted(answered) != sorted(ids) or len(set(answered)) != len(answered):
                problems.append(f"calls {ids} answered by {answered}")
            continue
        if message["role"] == "tool":
            problems.append(f"tool message {message.get('tool_call_id')} without its call")
        index += 1
    if wire_images(body) > 4:
        problems.append(f"{wire_images(body)} images sent")
    size = wire_tokens(body) + int(body.get("max_tokens") or 0)
    if size > window:
        problems.append(f"{size} tokens sent to a {window}-token window")
    return problems


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Call:
    """One tool call the model makes."""

    name: Literal["get_ticker", "get_chart", "get_candles", "hold", "remember"]
    size: int = 0
    steer: bool = False
    cancel: bool = False

    def arguments(self) -> dict[str, Any]:
        if self.name == "get_candles":
            return {"count": self.size}
        if self.name == "hold":
            return {"steer": self.steer, "cancel": self.cancel}
        if self.name == "remember":
            return {"note": "long 0.1 BTC from 64000, stop 62000"}
        return {"symbol": "BTC/USDT"}


@dataclass(frozen=True)
class Answer:
    """A final answer; with ``steer``, an operator writes while it is being written."""

    length: int
    steer: bool = False


@dataclass(frozen=True)
class Failure:
    """The server fails this request: a transient error, or a context-length 400."""

    kind: Literal["transient", "overflow"]


ModelStep = tuple[Call, ...] | Answer | Failure


@dataclass(frozen=True)
class TurnPlan:
    """One trigger, and what happens just before it."""

    kind: Literal["tick", "operator", "operator_image"]
    before: Literal["nothing", "compact", "crash"] = "nothing"


@dataclass(frozen=True)
class Scenario:
    """A small desk day."""

    window: int
    turns: tuple[TurnPlan, ...]
    steps: tuple[ModelStep, ...]


_calls = st.one_of(
    st.builds(Call, st.just("get_ticker")),
    st.builds(Call, st.just("get_chart")),
    st.builds(Call, st.just("get_candles"),
              size=st.one_of(st.integers(1, 60), st.integers(1, 60), st.integers(1, 2500))),
    st.builds(Call, st.just("remember")),
    st.builds(Call, st.just("hold"), steer=st.booleans(),
              cancel=st.sampled_from([False, False, False, False, True])),
)
_steps: st.SearchStrategy[ModelStep] = st.one_of(
    st.lists(_calls, min_size=1, max_size=3).map(tuple),
    st.lists(_calls, min_size=1, max_size=3).map(tuple),
    st.builds(Answer, st.integers(0, 4000), st.booleans()),
    st.builds(Failure, st.sampled_from(["transient", "transient", "overflow"])),
)
scenarios = st.builds(
    Scenario,
    window=st.sampled_from([3_500, 5_000, 8_000]),
    turns=st.lists(st.builds(TurnPlan, st.sampled_from(["tick", "operator", "operator_image"]),
                             st.sampled_from(["nothing"] * 6 + ["compact", "crash"])),
                   min_size=1, max_size=10).map(tuple),
    steps=st.lists(_steps, max_size=30).map(tuple),
)


class Brain:
    """What the model answers: summaries and flushes by rule, the rest from the scenario."""

    def __init__(self, scenario: Scenario) -> None:
        self.steps: deque[ModelStep] = deque(scenario.steps)
        self.steer_after_reply = 0
        self.texts = itertools.count(1)

    def desk_step(self) -> ModelStep:
        step = self.steps.popleft() if self.steps else Answer(40)
        if isinstance(step, Answer) and step.steer:
            self.steer_after_reply += 1
        return step

    @staticmethod
    def flush_step(answered_already: bool) -> ModelStep:
        return Answer(-1) if answered_already else (Call("remember"),)

    def text(self, step: Answer) -> str:
        if step.length < 0:
            return FLUSH_NO_OP
        return f"Answer {next(self.texts)}: " + "the market holds its range. " * (
            step.length // 28)


class ScriptedModel:
    """An in-process :class:`ModelBackend` that answers from a :class:`Brain` and checks
    every request it receives (see the module docstring)."""

    model = "in-process"

    def __init__(self, window: int, brain: Brain, inbox: SteeringInbox,
                 steering: Callable[[str], SteeringMessage]) -> None:
        self.context_window = window
        self.brain = brain
        self.inbox = inbox
        self.steering = steering
        self.requests: list[ModelRequestSpec] = []
        self.problems: list[str] = []
        self.ids = itertools.count(1)
        self._failed_wire: list[bytes] | None = None
        self._failures_in_row = 0

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None) -> ModelReply:
        await anyio.lowlevel.checkpoint()
        self.requests.append(request)
        messages = list(request.messages)
        wire = [encode_message(m) for m in messages]
        # The loop retries a 503 three times, then gives up: only those are replays.
        failures, self._failures_in_row = self._failures_in_row, 0
        if self._failed_wire is not None and failures <= 3 and wire != self._failed_wire:
            self.problems.append("a retried request differs from the one that failed")
        self._failed_wire = None
        self.problems += message_problems(messages)
        if image_count(messages) > 4:
            self.problems.append(f"{image_count(messages)} images sent")
        tokens = request_tokens(request)
        if tokens + (request.max_output_tokens or 0) > self.context_window:
            self.problems.append(f"{tokens} tokens sent to a {self.context_window} window")
            raise ContextOverflowError("the prompt is too long", status_code=400)
        if request.system_prompt.startswith(SUMMARY_MARK):
            return ModelReply((TextBlock(SUMMARY_REPLY),), Usage(tokens, 60))
        if any(m.id.startswith(FLUSH_TRIGGER_PREFIX) for m in messages):
            step = self.brain.flush_step(messages[-1].kind == "tool_results")
        else:
            step = self.brain.desk_step()
        if isinstance(step, Failure):
            if step.kind == "transient":
                self._failed_wire = wire
                self._failures_in_row = failures + 1
                raise TransientBackendError("scripted 503", status_code=503)
            raise ContextOverflowError("scripted overflow", status_code=400)
        if isinstance(step, Answer):
            text = self.brain.text(step)
            if on_text is not None and text:
                on_text(text[: len(text) // 2])
                on_text(text[len(text) // 2:])
            while self.brain.steer_after_reply:
                self.brain.steer_after_reply -= 1
                self.inbox.put(self.steering("written while you answered"))
            return ModelReply((TextBlock(text),), Usage(tokens, len(text) // 4 + 1))
        calls: list[ContentBlock] = [
            ToolUseBlock(f"c{next(self.ids)}", call.name, json.dumps(call.arguments()))
            for call in step]
        return ModelReply(tuple(calls), Usage(tokens, 20), "tool_calls")


class WireDesk:
    """The real HTTP backend, with the brain's "an operator writes during this answer"."""

    def __init__(self, inner: OpenAICompatibleBackend, brain: Brain, inbox: SteeringInbox,
                 steering: Callable[[str], SteeringMessage]) -> None:
        self.inner = inner
        self.model = inner.model
        self.context_window = inner.context_window
        self.brain = brain
        self.inbox = inbox
        self.steering = steering

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None) -> ModelReply:
        reply = await self.inner.complete(request, on_text)
        while self.brain.steer_after_reply:
            self.brain.steer_after_reply -= 1
            self.inbox.put(self.steering("written while you answered"))
        return reply


def wire_responder(brain: Brain, window: int, problems: list[str]) -> Callable[
        [RecordedRequest], Step]:
    """The scripted server's answers for a scenario, checking every body it receives."""

    def respond(request: RecordedRequest) -> Step:
        body = request.json
        problems.extend(wire_problems(body, window))
        usage = (wire_tokens(body), 20)
        messages = body["messages"]
        if str(messages[0]["content"]).startswith(SUMMARY_MARK):
            return Reply(SUMMARY_REPLY, usage=usage)
        if any(FLUSH_MARK in str(m.get("content")) for m in messages):
            step = brain.flush_step(messages[-1]["role"] == "tool")
        else:
            step = brain.desk_step()
        if isinstance(step, Failure):
            return server_error(503) if step.kind == "transient" else context_overflow()
        if isinstance(step, Answer):
            return Reply(brain.text(step), text_chunks=2, usage=usage)
        return Reply(tool_calls=[ToolCall(c.name, c.arguments()) for c in step], usage=usage)

    return respond


# --------------------------------------------------------------------------- the desk


class SymbolArguments(BaseModel):
    symbol: str


class CandleArguments(BaseModel):
    count: int


class HoldArguments(BaseModel):
    steer: bool = False
    cancel: bool = False


class NoteArguments(BaseModel):
    note: str


@dataclass
class RecordingStore:
    """A ConversationObserver keeping what a store would: every append, every compaction."""

    appended: list[Message] = field(default_factory=list)
    compactions: list[tuple[Message, str | None]] = field(default_factory=list)

    async def message_appended(self, conversation: Conversation, message: Message) -> None:
        self.appended.append(message)

    async def compacted(self, conversation: Conversation, summary: Message,
                        first_kept_id: str | None) -> None:
        self.compactions.append((summary, first_kept_id))


@dataclass
class DeskRig:
    """A desk wired as the daemon wires one, for a scenario."""

    inbox: SteeringInbox = field(default_factory=SteeringInbox)
    put_ids: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    scope: anyio.CancelScope | None = None
    charts: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def steering(self, text: str) -> SteeringMessage:
        message = SteeringMessage(f"{text} ({len(self.put_ids) + 1})", "ana")
        self.put_ids.append(message.id)
        return message

    def registry(self) -> ToolRegistry:
        registry = ToolRegistry()

        @registry.tool(description="Last price of a market.")
        async def get_ticker(arguments: SymbolArguments, context: ToolContext) -> str:
            return f"{arguments.symbol} last 64000.5 bid 64000 ask 64001"

        @registry.tool(description="A price chart of a market.")
        async def get_chart(arguments: SymbolArguments, context: ToolContext) -> ToolOutput:
            number = next(self.charts)
            image = ImageBlock(CHART.data, CHART.media_type,
                               f"chart {number} of {arguments.symbol}")
            return ToolOutput(f"chart {number} attached", images=(image,))

        @registry.tool(description="Recent candles.")
        async def get_candles(arguments: CandleArguments, context: ToolContext) -> str:
            return "\n".join(f"2024-05-01T{i % 24:02d}:00 o 64000 h 64100 l 63900 c 64050"
                             for i in range(arguments.count))

        @registry.tool(description="Waits on something slow.")
        async def hold(arguments: HoldArguments, context: ToolContext) -> str:
            if arguments.steer:
                self.inbox.put(self.steering("written during a tool call"))
            if arguments.cancel and self.scope is not None:
                self.scope.cancel()
            await anyio.lowlevel.checkpoint()
            return "held"

        @registry.tool(description="Saves a note to long-term memory.")
        async def remember(arguments: NoteArguments, context: ToolContext) -> str:
            self.notes.append(arguments.note)
            return "saved"

        return registry


def trigger_for(plan: TurnPlan, number: int) -> Trigger:
    if plan.kind == "tick":
        return Trigger(kind="tick", text=f"BTC/USDT moved 0.{number}%", source="BTC/USDT")
    images = ((ImageBlock(CHART.data, CHART.media_type, f"operator screenshot {number}"),)
              if plan.kind == "operator_image" else ())
    return Trigger(kind="operator", text=f"What now? ({number})", source="ana", images=images)


def crashed(conversation: Conversation, store: RecordingStore) -> Conversation:
    """The conversation restored after a crash that lost the last tool results' write."""
    messages = list(conversation.messages)
    lost = max((i for i, m in enumerate(messages) if m.kind == "tool_results"
                and i >= conversation.window_start), default=None)
    if lost is not None:
        del messages[lost]
    restored = Conversation(conversation.system_prompt, messages,
                            summary=conversation.summary, observer=store)
    restored.window_start = conversation.window_start
    store.appended = list(messages)
    return restored


def drain(subscription: Subscription) -> list[Event]:
    events = []
    while (event := subscription.get_nowait()) is not None:
        events.append(event)
    return events


async def _no_sleep(delay: float) -> None:
    await anyio.lowlevel.checkpoint()


async def run_scenario(scenario: Scenario, rig: DeskRig, backend: ModelBackend) -> list[str]:
    """Plays a scenario on a real AgentLoop; returns what went wrong around the requests."""
    bus = EventBus()
    subscription = bus.subscribe("test", max_buffer=1_000_000)
    window = scenario.window
    compressor = ContextCompressor(window, keep_recent_tokens=window // 5,
                                   summary_max_tokens=window // 16)
    loop = AgentLoop("alpha", backend, ToolCallExecutor(rig.registry()), bus, maximum_rounds=5,
                     compressor=compressor, steering_inbox=rig.inbox)
    loop.retry_policy.sleep = _no_sleep
    store = RecordingStore()
    conversation = Conversation(SYSTEM_PROMPT, observer=store)
    problems: list[str] = []
    for number, plan in enumerate(scenario.turns, 1):
        try:
            with anyio.CancelScope() as scope:
                rig.scope = scope
                if plan.before == "compact":
                    await loop.compact(conversation, Trigger(kind="command", text="/compact"))
                elif plan.before == "crash":
                    conversation = crashed(conversation, store)
                await loop.run_turn(conversation, trigger_for(plan, number))
            if not scope.cancelled_caught and rig.inbox.pending:
                problems.append("a steering message still waits after run_turn returned")
        except (ContextOverflowError, BackendUnavailableError):
            pass  # a scripted overflow with nothing left to compact, or four 503s in a row
    return problems + scenario_problems(drain(subscription), rig, conversation, store)


def scenario_problems(events: list[Event], rig: DeskRig, conversation: Conversation,
                      store: RecordingStore) -> list[str]:
    problems: list[str] = []
    silent_turns = {e.turn for e in events if isinstance(e, TurnStarted) and e.silent}
    if any(isinstance(e, TextDelta) and e.turn in silent_turns for e in events):
        problems.append("the memory flush streamed text")
    if len([e for e in events if isinstance(e, MemoryFlush)]) != len(silent_turns):
        problems.append("a flush turn without its MemoryFlush event")
    delivered = [e.message_id for e in events if isinstance(e, SteeringDelivered)]
    waiting = [m.id for m in rig.inbox.take_all()]
    if sorted(delivered + waiting) != sorted(rig.put_ids):
        problems.append(f"steering lost or repeated: put {rig.put_ids}, delivered "
                        f"{delivered}, waiting {waiting}")
    if any(m.id.startswith(FLUSH_TRIGGER_PREFIX) for m in conversation.messages):
        problems.append("the flush turn reached the transcript")
    # The store has every message; memory, only those since the last compaction.
    stored = [m.id for m in store.appended]
    kept = [m.id for m in conversation.messages]
    if stored[len(stored) - len(kept):] != kept:
        problems.append("the transcript was rewritten")
    first_kept_id = store.compactions[-1][1] if store.compactions else None
    if first_kept_id is not None and kept[:1] != [first_kept_id]:
        problems.append("memory keeps messages the last compaction summarized")
    return problems


# --------------------------------------------------------------------------- properties


@settings(max_examples=1000, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario=scenarios)
@pytest.mark.slow
def test_every_request_is_valid_in_process(scenario: Scenario) -> None:
    rig = DeskRig()
    brain = Brain(scenario)
    model = ScriptedModel(scenario.window, brain, rig.inbox, rig.steering)

    async def main() -> list[str]:
        return await run_scenario(scenario, rig, model)

    problems = anyio.run(main, backend="asyncio")
    assert model.problems == []
    assert problems == []
    assert model.requests, "the scenario never reached the model"


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(scenario=scenarios)
@pytest.mark.slow
def test_every_request_is_valid_over_http(scenario: Scenario,
                                          scripted_server: ScriptedServer) -> None:
    rig = DeskRig()
    brain = Brain(scenario)
    wire: list[str] = []
    scripted_server.responder = wire_responder(brain, scenario.window, wire)
    first_request = len(scripted_server.requests)

    async def main() -> list[str]:
        config = OpenAIBackendConfig(base_url=scripted_server.base_url, model="scripted-model",
                                     context_window=scenario.window, request_timeout=10)
        async with OpenAICompatibleBackend(config) as inner:
            return await run_scenario(scenario, rig, WireDesk(inner, brain, rig.inbox,
                                                              rig.steering))

    problems = anyio.run(main, backend="asyncio")
    assert wire == []
    assert problems == []
    assert len(scripted_server.requests) > first_request
    assert scripted_server.unexpected == []


# --------------------------------------------------------------------------- repair and cut


def _call(call_id: str) -> ToolUseBlock:
    return ToolUseBlock(call_id, "get_ticker", '{"symbol": "BTC/USDT"}')


def _results(*ids: str) -> Message:
    return Message(role="user", kind="tool_results", content=tuple(
        ToolResultBlock(i, (TextBlock("64000"),)) for i in ids))


_piece = st.one_of(
    st.just("user"), st.just("answer"),
    st.lists(st.sampled_from("abcd"), min_size=1, max_size=3, unique=True).map(
        lambda ids: ("calls", tuple(ids))),
    st.lists(st.sampled_from("abcdz"), min_size=1, max_size=3).map(
        lambda ids: ("results", tuple(ids))),
)


def _messages(pieces: list[Any]) -> list[Message]:
    messages = []
    for number, piece in enumerate(pieces):
        if piece == "user":
            messages.append(Message.user_text(f"tick {number}"))
        elif piece == "answer":
            messages.append(Message(role="assistant", content=(TextBlock(f"ok {number}"),)))
        elif piece[0] == "calls":
            messages.append(Message(role="assistant", content=tuple(
                _call(f"{i}{number}") for i in piece[1])))
        else:
            messages.append(_results(*(f"{i}{number - 1}" for i in piece[1])))
    return messages


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(_piece, max_size=12))
def test_repair_is_valid_and_idempotent(pieces: list[Any]) -> None:
    messages = _messages(pieces)
    once = repair(messages)
    assert message_problems(once) == []
    twice = repair(once)
    assert [encode_message(m) for m in twice] == [encode_message(m) for m in once]
    assert all(a is b for a, b in zip(twice, once, strict=True))


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(_piece, max_size=12), budget=st.integers(0, 200))
def test_the_cut_never_separates_a_call_from_its_results(pieces: list[Any],
                                                         budget: int) -> None:
    messages = repair(_messages(pieces))
    cut = find_cut(messages, budget)
    assert 0 <= cut <= len(messages)
    assert cut in (0, len(messages)) or messages[cut].kind != "tool_results"
    assert message_problems(messages[cut:]) == []
