"""The delegate tool against the scripted server: a desk hands research to subagents.

A responder answers the desk and its subagents differently (by their system prompts), so
several subagents can run at once and their overlap can be measured from the events.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import BaseModel, ValidationError

from tests.agent.test_randomized_conversations import wire_problems
from tests.scripted_server import (
    RecordedRequest,
    Reply,
    ScriptedServer,
    Step,
    ToolCall,
    unauthorized,
)
from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.backend import Usage
from trading_agent.agent.conversation import Conversation, Message, ToolResultBlock, repair
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import (
    Event,
    SteeringDelivered,
    ToolCallStarted,
    ToolResultReady,
    TurnEnded,
    TurnStarted,
)
from trading_agent.agent.steering_inbox import SteeringInbox, SteeringMessage
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.agent.turn_runner import TurnResult
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.store import Store
from trading_agent.tools.config import DELEGATE_TOOL_NAME, SubagentConfig
from trading_agent.tools.delegate import (
    Delegator,
    SubagentLink,
    SubagentTranscripts,
    register_delegate_tool,
)

DESK = "desk-a"
DESK_PROMPT = "You are the trading desk desk-a."
SUB_PROMPT = "SUBAGENT working for {desk}."
PARENT_USAGE = (100, 10)
SUB_USAGE = (7, 3)


# --------------------------------------------------------------------------- the fake model


def _is_subagent(request: RecordedRequest) -> bool:
    return str(request.messages[0]["content"]).startswith("SUBAGENT")


def _task(request: RecordedRequest) -> str:
    """The subagent's task (its first user message, after the trigger's label line)."""
    return str(request.messages[1]["content"]).split("\n", 1)[1]


def _round(request: RecordedRequest) -> int:
    """How many model answers the conversation already holds."""
    return sum(1 for m in request.messages if m["role"] == "assistant")


def _delegates(*tasks: str | dict[str, Any]) -> Reply:
    calls = [ToolCall(DELEGATE_TOOL_NAME, {"task": t} if isinstance(t, str) else t, id=f"d{i}")
             for i, t in enumerate(tasks, 1)]
    return Reply(tool_calls=calls, usage=PARENT_USAGE)


@dataclass
class Model:
    """Answers the desk with ``desk(round)`` and a subagent with ``sub(task, round)``."""

    desk: Callable[[int], Step]
    sub: Callable[[str, int], Step]

    def __call__(self, request: RecordedRequest) -> Step:
        if _is_subagent(request):
            return self.sub(_task(request), _round(request))
        return self.desk(_round(request))


def _desk_delegating(*tasks: str | dict[str, Any]) -> Callable[[int], Step]:
    def desk(round_: int) -> Step:
        if round_ == 0:
            return _delegates(*tasks)
        return Reply("Desk summary.", usage=PARENT_USAGE)
    return desk


def _sub_answering(delay: float = 0.0) -> Callable[[str, int], Step]:
    def sub(task: str, round_: int) -> Step:
        return Reply(f"Report on: {task}", delay=delay, usage=SUB_USAGE)
    return sub


# --------------------------------------------------------------------------- the desk


class TickerArguments(BaseModel):
    symbol: str


class OrderArguments(BaseModel):
    symbol: str
    amount: float


@dataclass
class Desk:
    """A desk wired as the daemon would: registry, delegate tool, loop, bus, inbox."""

    loop: AgentLoop
    bus: EventBus
    registry: ToolRegistry
    inbox: SteeringInbox
    delegator: Delegator
    transcripts: Any
    conversation: Conversation = field(default_factory=lambda: Conversation(DESK_PROMPT))
    on_ticker: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def turn(self, text: str = "Compare BTC and ETH.") -> TurnResult:
        return await self.loop.run_turn(self.conversation,
                                        Trigger(kind="operator", text=text, source="ana"))


class RecordingObserver:
    """Stores one subagent's transcript in memory, as the store would in SQLite."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.compactions: list[tuple[Message, str | None]] = []

    async def message_appended(self, conversation: Conversation, message: Message) -> None:
        self.messages.append(message)

    async def compacted(self, conversation: Conversation, summary: Message,
                        first_kept_id: str | None) -> None:
        self.compactions.append((summary, first_kept_id))


class RecordingTranscripts:
    """A :class:`SubagentTranscripts` keeping each transcript by its link."""

    def __init__(self) -> None:
        self.stored: dict[SubagentLink, RecordingObserver] = {}

    async def observer_for(self, link: SubagentLink) -> RecordingObserver:
        observer = self.stored[link] = RecordingObserver()
        return observer


@pytest.fixture
def server(scripted_server: ScriptedServer) -> Iterator[ScriptedServer]:
    yield scripted_server
    assert not scripted_server.unexpected, "a request got no answer"


@pytest.fixture
async def backend(server: ScriptedServer) -> AsyncIterator[OpenAICompatibleBackend]:
    config = OpenAIBackendConfig(base_url=server.base_url, model="scripted-model",
                                 context_window=32_000)
    async with OpenAICompatibleBackend(config) as opened:
        yield opened


@pytest.fixture
def make_desk(backend: OpenAICompatibleBackend) -> Callable[..., Desk]:
    def make(transcripts: SubagentTranscripts | None = None, **settings: Any) -> Desk:
        registry = ToolRegistry()
        hooks: list[Callable[[], Awaitable[None]]] = []

        @registry.tool(description="Last price of a market.")
        async def get_ticker(arguments: TickerArguments, context: ToolContext) -> str:
            for hook in hooks:
                await hook()
            return f"{arguments.symbol} last 64000"

        @registry.tool(description="Places an order.", dangerous=True)
        async def place_order(arguments: OrderArguments, context: ToolContext) -> str:
            return "filled"

        transcripts = transcripts or RecordingTranscripts()
        config = SubagentConfig(system_prompt=SUB_PROMPT, **settings)
        delegator = register_delegate_tool(registry, config, backend=backend,
                                           transcripts=transcripts)
        assert delegator is not None
        bus, inbox = EventBus(), SteeringInbox()
        loop = AgentLoop(DESK, backend, ToolCallExecutor(registry), bus, maximum_rounds=4,
                         steering_inbox=inbox)
        return Desk(loop, bus, registry, inbox, delegator, transcripts, on_ticker=hooks)
    return make


def _drain(subscription: Any) -> list[Event]:
    events = []
    while (event := subscription.get_nowait()) is not None:
        events.append(event)
    return events


def _results(request: RecordedRequest) -> dict[str, str]:
    """The tool results a request carries, by call id."""
    return {m["tool_call_id"]: m["content"] for m in request.messages if m["role"] == "tool"}


def _max_overlap(events: list[Event]) -> int:
    """The most subagent turns running at once, from their start and end events in order."""
    running = peak = 0
    for event in sorted(events, key=lambda e: e.id):
        if event.subagent is not None and isinstance(event, TurnStarted):
            running += 1
            peak = max(peak, running)
        elif event.subagent is not None and isinstance(event, TurnEnded):
            running -= 1
    return peak


# --------------------------------------------------------------------------- parallel runs


async def test_two_delegates_in_one_round_run_at_once_and_both_return(
        server: ScriptedServer, make_desk: Callable[..., Desk]) -> None:
    delay = 0.4
    server.responder = Model(_desk_delegating("BTC volatility", "ETH volatility"),
                             _sub_answering(delay))
    desk = make_desk(max_concurrent=2)
    with desk.bus.subscribe("test") as watch:
        started = anyio.current_time()
        result = await desk.turn()
        elapsed = anyio.current_time() - started
        events = _drain(watch)

    assert result.text == "Desk summary."
    # Both reports reached the desk, each as the result of its own call.
    final_request = server.requests[-1]
    assert _results(final_request) == {"d1": "Report on: BTC volatility",
                                       "d2": "Report on: ETH volatility"}
    # Measured overlap: both subagent turns were running together for most of the delay.
    spans = {e.subagent: [e.at] for e in events if isinstance(e, TurnStarted) and e.subagent}
    for e in events:
        if isinstance(e, TurnEnded) and e.subagent:
            spans[e.subagent].append(e.at)
    assert len(spans) == 2
    (start_a, end_a), (start_b, end_b) = spans.values()
    overlap = min(end_a, end_b) - max(start_a, start_b)
    assert overlap > 0.75 * delay, f"subagents overlapped only {overlap:.3f} s"
    assert elapsed < 2 * delay, f"two {delay} s subagents took {elapsed:.2f} s in all"
    assert desk.delegator.running(DESK) == 0


async def test_at_most_max_concurrent_subagents_run_at_once(
        server: ScriptedServer, make_desk: Callable[..., Desk]) -> None:
    server.responder = Model(_desk_delegating("one", "two", "three"), _sub_answering(0.25))
    desk = make_desk(max_concurrent=2)
    with desk.bus.subscribe("test") as watch:
        await desk.turn()
        events = _drain(watch)

    assert _max_overlap(events) == 2
    assert sorted(_results(server.requests[-1]).values()) == [
        "Report on: one", "Report on: three", "Report on: two"]


async def test_a_call_waiting_too_long_for_a_slot_gets_an_error_result(
        server: ScriptedServer, make_desk: Callable[..., Desk]) -> None:
    server.responder = Model(_desk_delegating("a", "b", "c"), _sub_answering(0.4))
    desk = make_desk(max_concurrent=1, timeout_seconds=0.6)
    await desk.turn()

    results = _results(server.requests[-1])
    # "b" waited 0.4 s for the only slot, then ran; "c" would have waited 0.8 s.
    assert results["d1"] == "Report on: a" and results["d2"] == "Report on: b"
    assert results["d3"] == ("Error: no subagent slot became free within 0.6 s (1 subagents "
                             "were already running). Try again when they have reported.")
    assert sum(1 for r in server.requests if _is_subagent(r)) == 2


# --------------------------------------------------------------------------- limits


async def test_a_subagent_is_never_offered_delegate_nor_place_order(
        server: ScriptedServer, make_desk: Callable[..., Desk]) -> None:
    def sub(task: str, round_: int) -> Step:
        if round_ == 0:  # it tries anyway
            return Reply(tool_calls=[ToolCall(DELEGATE_TOOL_NAME, {"task": "deeper"}, id="s1")],
                         usage=SUB_USAGE)
        return Reply("Could not go deeper.", usage=SUB_USAGE)

    server.responder = Model(_desk_delegating("dig"), sub)
    desk = make_desk()
    await desk.turn()

    sub_requests = [r for r in server.requests if _is_subagent(r)]
    assert len(sub_requests) == 2
    offered = {t["function"]["name"] for t in sub_requests[0].tools}
    assert offered == {"get_ticker"}
    refusal = _results(sub_requests[1])["s1"]
    assert "no tool named 'delegate'" in refusal
    parent_offered = {t["function"]["name"] for t in server.requests[0].tools}
    assert parent_offered == {"get_ticker", "place_order", DELEGATE_TOOL_NAME}
    assert _results(server.requests[-1])["d1"] == "Could not go deeper."


@pytest.mark.parametrize(
    ("tools", "expected"),
    [
        (["delegate"], "a subagent may not be given delegate"),
        (["place_order"], "a subagent may not be given place_order"),
        (["get_ticker", "get_news"], "not among your tools: get_news"),
    ],
)
async def test_asking_for_tools_the_subagent_may_not_have_is_refused(
        server: ScriptedServer, make_desk: Callable[..., Desk], tools: list[str],
        expected: str) -> None:
    server.responder = Model(_desk_delegating({"task": "x", "tools": tools}), _sub_answering())
    desk = make_desk()
    await desk.turn()

    assert len(server.requests) == 2, "no subagent should have run"
    refusal = _results(server.requests[-1])["d1"]
    assert refusal.startswith("Error: ") and expected in refusal
    assert "may be given: get_ticker." in refusal


async def test_a_named_subset_and_allowed_orders_are_what_the_subagent_is_offered(
        server: ScriptedServer, make_desk: Callable[..., Desk]) -> None:
    server.responder = Model(
        _desk_delegating({"task": "orders only", "tools": ["place_order"]},
                         {"task": "nothing", "tools": []},
                         "everything"),
        _sub_answering())
    desk = make_desk(allow_place_order=True)
    await desk.turn()

    offered = {_task(r): sorted(t["function"]["name"] for t in r.tools)
               for r in server.requests if _is_subagent(r)}
    assert offered == {"orders only": ["place_order"], "nothing": [],
                       "everything": ["get_ticker", "place_order"]}
    links = sorted(desk.transcripts.stored, key=lambda link: link.parent_call_id)
    assert [link.tools for link in links] == [("place_order",), (), ("get_ticker", "place_order")]


async def test_a_timeout_comes_back_as_a_result_with_the_partial_text(
        server: ScriptedServer, make_desk: Callable[..., Desk]) -> None:
    def sub(task: str, round_: int) -> Step:
        if round_ == 0:
            return Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})],
                         text="Checking the ticker first.", usage=SUB_USAGE)
        # The second answer streams slowly: the timeout cuts it halfway.
        return Reply(["Bid walls at 63,500", " and 63,000;", " asks thin above 64,200."],
                     chunk_delay=0.4, usage=SUB_USAGE)

    server.responder = Model(_desk_delegating("Where are the walls?"), sub)
    desk = make_desk(timeout_seconds=0.6)
    result = await desk.turn()

    text = _results(server.requests[-1])["d1"]
    assert text.startswith("Error: the subagent did not finish within 0.6 s and was stopped "
                           "after 1 model calls.")
    assert "Checking the ticker first." in text
    assert text.endswith("\nBid walls at 63,500")  # streamed before the cut
    assert result.text == "Desk summary."
    # The finished model call still counts toward the desk's usage.
    assert result.usage.input_tokens == 2 * PARENT_USAGE[0] + SUB_USAGE[0]
    # The stored transcript stays valid to send.
    [observer] = desk.transcripts.stored.values()
    assert [m.kind for m in observer.messages] == ["trigger", "assistant", "tool_results"]
    assert repair(observer.messages) == observer.messages


async def test_a_timeout_during_a_tool_round_leaves_an_answered_transcript(
        server: ScriptedServer, make_desk: Callable[..., Desk]) -> None:
    def sub(task: str, round_: int) -> Step:
        return Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "ETH/USDT"}, id="t1")],
                     usage=SUB_USAGE)

    server.responder = Model(_desk_delegating("stuck"), sub)
    desk = make_desk(timeout_seconds=0.3)
    desk.on_ticker.append(anyio.sleep_forever)  # the subagent's tool hangs
    await desk.turn()

    text = _results(server.requests[-1])["d1"]
    assert "did not finish within 0.3 s" in text and "It had written nothing yet." in text
    [observer] = desk.transcripts.stored.values()
    assert [m.kind for m in observer.messages] == ["trigger", "assistant", "tool_results"]
    [interrupted] = observer.messages[-1].tool_results
    assert interrupted.tool_use_id == "t1" and interrupted.is_error
    assert "interrupted" in interrupted.text


async def test_the_round_limit_comes_back_as_a_result(
        server: ScriptedServer, make_desk: Callable[..., Desk]) -> None:
    def sub(task: str, round_: int) -> Step:
        return Reply(f"Looking again ({round_}).",
                     tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})],
                     usage=SUB_USAGE)

    server.responder = Model(_desk_delegating("loop forever"), sub)
    desk = make_desk(maximum_rounds=2)
    result = await desk.turn()

    text = _results(server.requests[-1])["d1"]
    assert text.startswith("Error: the subagent used all 2 of its model calls (maximum_rounds) "
                           "without a final answer.")
    assert "Looking again (0).\nLooking again (1)." in text
    assert sum(1 for r in server.requests if _is_subagent(r)) == 2
    assert result.usage.input_tokens == 2 * PARENT_USAGE[0] + 2 * SUB_USAGE[0]


async def test_a_failing_model_comes_back_as_a_result(
        server: ScriptedServer, make_desk: Callable[..., Desk]) -> None:
    def sub(task: str, round_: int) -> Step:
        return unauthorized("The subagent key is revoked.")

    server.responder = Model(_desk_delegating("anything"), sub)
    desk = make_desk()
    result = await desk.turn()

    text = _results(server.requests[-1])["d1"]
    assert text.startswith("Error: the subagent failed: the server refused the request: The "
                           "subagent key is revoked. (HTTP 401)")
    assert result.text == "Desk summary."


# --------------------------------------------------------------------------- the window


class CandleArguments(BaseModel):
    count: int


async def test_huge_tool_results_never_push_a_subagent_request_past_the_window(
        server: ScriptedServer) -> None:
    window, candle = 4000, "2024-05-01T00:00 o 64000 h 64100 l 63900 c 64050\n"
    calls: list[int] = []

    def model(request: RecordedRequest) -> Step:
        system = str(request.messages[0]["content"])
        if system.startswith("You maintain the running summary"):
            return Reply("## Goal\n- read the candles")
        if not system.startswith("SUBAGENT"):
            return _desk_delegating("Read a lot of candles")(_round(request))
        if len(calls) < 6:
            return Reply(tool_calls=[ToolCall("get_candles", {"count": 800})])
        return Reply("BTC trends up over 4800 candles.")

    server.responder = model
    registry = ToolRegistry()

    @registry.tool(description="Recent candles of BTC/USDT, one a line.")
    async def get_candles(arguments: CandleArguments, context: ToolContext) -> str:
        calls.append(arguments.count)
        return candle * arguments.count  # about 10,000 tokens: more than the whole window

    config = OpenAIBackendConfig(base_url=server.base_url, model="scripted-model",
                                 context_window=window, max_output_tokens=200)
    async with OpenAICompatibleBackend(config) as small:
        register_delegate_tool(registry, SubagentConfig(system_prompt=SUB_PROMPT),
                               backend=small, transcripts=RecordingTranscripts())
        loop = AgentLoop(DESK, small, ToolCallExecutor(registry.subset([DELEGATE_TOOL_NAME])),
                         EventBus(), maximum_rounds=2)
        result = await loop.run_turn(Conversation(DESK_PROMPT),
                                     Trigger(kind="operator", text="Research.", source="ana"))

    assert result.text == "Desk summary."
    assert _results(server.requests[-1])["d1"] == "BTC trends up over 4800 candles."
    assert len(calls) == 6
    summaries = [r for r in server.requests
                 if str(r.messages[0]["content"]).startswith("You maintain the running")]
    assert len(summaries) >= 1  # the subagent compacted between rounds
    for request in server.requests:
        assert wire_problems(request.json, window) == []  # paired and within the window


# --------------------------------------------------------------------------- isolation


async def test_steering_sent_to_the_desk_never_reaches_its_subagent(
        server: ScriptedServer, make_desk: Callable[..., Desk]) -> None:
    def sub(task: str, round_: int) -> Step:
        if round_ == 0:
            return Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})],
                         usage=SUB_USAGE)
        return Reply("BTC at 64000.", usage=SUB_USAGE)

    server.responder = Model(_desk_delegating("price?"), sub)
    desk = make_desk()

    async def operator_writes() -> None:  # while the subagent is mid-task (its tool runs)
        desk.inbox.put(SteeringMessage("Stop buying ETH.", "ana"))

    desk.on_ticker.append(operator_writes)
    with desk.bus.subscribe("test") as watch:
        await desk.turn()
        events = _drain(watch)

    sub_requests = [r for r in server.requests if _is_subagent(r)]
    assert len(sub_requests) == 2
    assert all(b"Stop buying ETH." not in r.body for r in sub_requests)
    assert b"Stop buying ETH." in server.requests[-1].body  # the desk got it after the round
    [delivered] = [e for e in events if isinstance(e, SteeringDelivered)]
    assert delivered.subagent is None


async def test_subagent_events_are_tagged_and_nested_under_the_parent_call(
        server: ScriptedServer, make_desk: Callable[..., Desk]) -> None:
    def sub(task: str, round_: int) -> Step:
        if round_ == 0:
            return Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})],
                         usage=SUB_USAGE)
        return Reply("Done.", usage=SUB_USAGE)

    server.responder = Model(_desk_delegating("nest"), sub)
    desk = make_desk()
    with desk.bus.subscribe("test") as watch:
        result = await desk.turn()
        events = _drain(watch)

    [link] = desk.transcripts.stored
    mine = [e for e in events if e.subagent is not None]
    assert {(e.desk, e.subagent, e.parent_call) for e in mine} == {
        (DESK, link.subagent_id, "d1")}
    assert {type(e).__name__ for e in mine} >= {
        "TurnStarted", "ModelRequest", "UsageReported", "ToolCallStarted", "ToolResultReady",
        "TurnEnded"}
    # The subagent has a turn of its own, distinct from the desk's.
    assert {e.turn for e in mine} == {next(e.turn for e in mine
                                           if isinstance(e, TurnStarted))} != {result.turn_id}
    assert link.parent_turn == result.turn_id and link.parent_call_id == "d1"
    # Nested: every subagent event falls between the desk's delegate call and its result.
    [call] = [e for e in events if isinstance(e, ToolCallStarted) and e.call_id == "d1"]
    [done] = [e for e in events if isinstance(e, ToolResultReady) and e.call_id == "d1"]
    assert call.subagent is None and done.subagent is None and done.text == "Done."
    assert all(call.id < e.id < done.id for e in mine)


async def test_usage_rolls_up_and_the_transcript_is_stored_with_its_link(
        server: ScriptedServer, make_desk: Callable[..., Desk]) -> None:
    def sub(task: str, round_: int) -> Step:
        if round_ == 0:
            return Reply(tool_calls=[ToolCall("get_ticker", {"symbol": task})], usage=SUB_USAGE)
        return Reply(f"{task} looks calm.", usage=SUB_USAGE)

    server.responder = Model(_desk_delegating("BTC/USDT", "ETH/USDT"), sub)
    desk = make_desk()
    with desk.bus.subscribe("test") as watch:
        result = await desk.turn()
        events = _drain(watch)

    assert result.usage == Usage(2 * PARENT_USAGE[0] + 4 * SUB_USAGE[0],
                                 2 * PARENT_USAGE[1] + 4 * SUB_USAGE[1])
    [desk_end] = [e for e in events if isinstance(e, TurnEnded) and e.subagent is None]
    assert desk_end.input_tokens == result.usage.input_tokens
    links = sorted(desk.transcripts.stored, key=lambda link: link.parent_call_id)
    assert [(link.desk, link.parent_call_id, link.task) for link in links] == [
        (DESK, "d1", "BTC/USDT"), (DESK, "d2", "ETH/USDT")]
    for link in links:
        stored = desk.transcripts.stored[link].messages
        assert [m.kind for m in stored] == ["trigger", "assistant", "tool_results", "assistant"]
        assert link.task in stored[0].text
        assert stored[-1].text == f"{link.task} looks calm."
    # The desk's own conversation holds only the reports, not the subagents' steps.
    desk_results = [b for m in desk.conversation.messages for b in m.content
                    if isinstance(b, ToolResultBlock)]
    assert [b.text for b in desk_results] == ["BTC/USDT looks calm.", "ETH/USDT looks calm."]


async def test_the_sqlite_store_keeps_the_transcript_linked_to_the_parent_call(
        server: ScriptedServer, make_desk: Callable[..., Desk], tmp_path: Path) -> None:
    def sub(task: str, round_: int) -> Step:
        if round_ == 0:
            return Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})],
                         usage=SUB_USAGE)
        return Reply("BTC is calm.", usage=SUB_USAGE)

    server.responder = Model(_desk_delegating("BTC?"), sub)
    async with await Store.open(tmp_path / "state.sqlite3") as store:
        desk = make_desk(transcripts=store.transcripts)
        desk.conversation = Conversation(DESK_PROMPT, observer=store.transcripts.observer(DESK))
        result = await desk.turn()
        stored = await store.transcripts.transcript(DESK)
        restored = await store.transcripts.restore_conversation(DESK, DESK_PROMPT)

    subagent = [m for m in stored if m["subagent"] is not None]
    assert [m["kind"] for m in subagent] == ["trigger", "assistant", "tool_results", "assistant"]
    assert {(m["subagent"].startswith("sub-"), m["parent_call"]) for m in subagent} == {
        (True, "d1")}
    assert subagent[-1]["text"] == "BTC is calm."
    # The desk's own conversation, as restored after a restart, holds only the report.
    assert [m.kind for m in restored.messages] == [
        "operator", "assistant", "tool_results", "assistant"]
    assert restored.messages[2].tool_results[0].text == "BTC is calm."
    assert result.text == "Desk summary."


async def test_cancelling_the_desk_turn_cancels_its_subagents_cleanly(
        server: ScriptedServer, make_desk: Callable[..., Desk]) -> None:
    release = threading.Event()

    def sub(task: str, round_: int) -> Step:
        return Reply("never read", hold_until=release, usage=SUB_USAGE)

    server.responder = Model(_desk_delegating("a", "b"), sub)
    desk = make_desk()
    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(desk.turn)
                await server.wait_for_requests(3)  # the desk's call and both subagents'
                assert desk.delegator.running(DESK) == 2
                group.cancel_scope.cancel()
    finally:
        release.set()

    assert desk.delegator.running(DESK) == 0
    # The desk's conversation stays valid: both calls answered as interrupted.
    last = desk.conversation.messages[-1]
    assert last.kind == "tool_results"
    assert [(b.tool_use_id, b.is_error) for b in last.tool_results] == [("d1", True),
                                                                       ("d2", True)]
    for observer in desk.transcripts.stored.values():
        assert [m.kind for m in observer.messages] == ["trigger"]
    # Its slots are free again: the next turn delegates at once.
    server.responder = Model(_desk_delegating("again"), _sub_answering())
    desk.conversation = Conversation(DESK_PROMPT)
    assert (await desk.turn()).text == "Desk summary."
    assert _results(server.requests[-1])["d1"] == "Report on: again"


async def test_a_drain_stops_running_subagents_at_their_safe_point(
        server: ScriptedServer, make_desk: Callable[..., Desk]) -> None:
    def sub(task: str, round_: int) -> Step:
        return Reply("Reading the book.", usage=SUB_USAGE,
                     tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})])

    server.responder = Model(_desk_delegating("walls?"), sub)
    desk = make_desk()

    async def shutdown_begins() -> None:  # while the subagent's tool runs
        desk.loop.request_stop()
        desk.delegator.request_stop(DESK)

    desk.on_ticker.append(shutdown_begins)
    result = await desk.turn()

    assert result.stopped
    assert sum(1 for r in server.requests if _is_subagent(r)) == 1
    [report] = desk.conversation.messages[-1].tool_results
    assert report.is_error
    assert report.text == ("Error: the subagent was stopped after 1 model calls because the "
                           "daemon is shutting down. What it had written so far:\n"
                           "Reading the book.")
    assert result.usage.input_tokens == PARENT_USAGE[0] + SUB_USAGE[0]


# --------------------------------------------------------------------------- config


def test_config_forbids_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ValidationError, match="max_parallel"):
        SubagentConfig.model_validate({"max_parallel": 3})
    with pytest.raises(ValidationError, match="max_concurrent"):
        SubagentConfig(max_concurrent=0)
    with pytest.raises(ValidationError, match="timeout_seconds"):
        SubagentConfig(timeout_seconds=0)


def test_a_disabled_config_adds_no_tool(backend: OpenAICompatibleBackend) -> None:
    registry = ToolRegistry()
    assert register_delegate_tool(registry, SubagentConfig(enabled=False),
                                  backend=backend) is None
    assert DELEGATE_TOOL_NAME not in registry


def test_the_tool_tells_the_model_its_limits(backend: OpenAICompatibleBackend) -> None:
    registry = ToolRegistry()
    register_delegate_tool(registry, SubagentConfig(max_concurrent=3, maximum_rounds=5,
                                                    timeout_seconds=90), backend=backend)
    tool = registry.get(DELEGATE_TOOL_NAME)
    assert tool is not None
    assert "at most 3 at a time" in tool.description
    assert "5 model calls and 90 s" in tool.description
    assert "place orders" in tool.description
    schema = json.dumps(tool.definition())
    assert '"task"' in schema and '"tools"' in schema
    # The executor's own deadline leaves room for the slot wait and the run.
    assert tool.timeout_seconds > 2 * 90
    with pytest.raises(ValueError, match="exactly one"):
        Delegator(SubagentConfig(), tools=registry)
