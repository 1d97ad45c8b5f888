"""The agent loop against the scripted server: round trips, retries, bad calls, limits.

Everything goes through the real openai client and real HTTP on loopback; the assertions are
about what the model was sent, what the conversation holds and which events an operator saw.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from pydantic import BaseModel

from tests.scripted_server import (
    HttpError,
    Reply,
    ScriptedServer,
    SSEChunks,
    Step,
    ToolCall,
    dropped_stream,
    rate_limited,
    server_error,
    slow,
)
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
from trading_agent.agent.conversation import repair
from trading_agent.agent.events import ErrorEvent, Event, RetryScheduled, ThinkingDelta
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.errors import BackendUnavailableError


class SymbolArguments(BaseModel):
    symbol: str


class WaitArguments(BaseModel):
    seconds: float


def _registry(started: anyio.Event | None = None) -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(description="Last price of a market.")
    async def get_ticker(arguments: SymbolArguments, context: ToolContext) -> str:
        if arguments.symbol == "CRASH/USDT":
            raise ConnectionError("exchange unreachable")
        return f"{arguments.symbol} last 21,034.50"

    @registry.tool(description="Waits.", timeout_seconds=0.5)
    async def wait(arguments: WaitArguments, context: ToolContext) -> str:
        if started is not None:
            started.set()
        await anyio.sleep(arguments.seconds)
        return "waited"

    return registry


class Harness:
    """A loop wired to the scripted server, recording events and retry sleeps."""

    def __init__(self, backend: OpenAICompatibleBackend, server: ScriptedServer,
                 maximum_rounds: int = 6, started: anyio.Event | None = None) -> None:
        self.server = server
        self.bus = EventBus()
        self.events = self.bus.subscribe("test")
        self.sleeps: list[float] = []
        self.loop = AgentLoop("alpha", backend, ToolCallExecutor(_registry(started)), self.bus,
                              maximum_rounds=maximum_rounds)
        self.loop.retry_policy = RetryPolicy(sleep=self._sleep)
        self.conversation = Conversation("You run a BTC desk.")

    async def _sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)

    def drained(self) -> list[Event]:
        events = []
        while (event := self.events.get_nowait()) is not None:
            events.append(event)
        return events


@pytest.fixture
async def backend(scripted_server: ScriptedServer) -> AsyncIterator[OpenAICompatibleBackend]:
    config = OpenAIBackendConfig(base_url=scripted_server.base_url, model="scripted-model",
                                 context_window=32_000, request_timeout=0.5)
    async with OpenAICompatibleBackend(config) as created:
        yield created


async def test_a_tool_round_trip(backend: OpenAICompatibleBackend,
                                 scripted_server: ScriptedServer) -> None:
    scripted_server.add(
        Reply("Let me look.", tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"},
                                                   argument_chunks=3)]),
        Reply("BTC is at 21,034.50; no trade.", text_chunks=3),
    )
    harness = Harness(backend, scripted_server)
    result = await harness.loop.run_turn(harness.conversation,
                                         Trigger("tick", "BTC/USDT moved 1.2%"))
    assert (result.text, result.rounds, result.hit_round_limit) == (
        "BTC is at 21,034.50; no trade.", 2, False)
    second = scripted_server.requests[1].messages
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool"]
    assert second[2]["tool_calls"][0]["function"]["arguments"] == '{"symbol": "BTC/USDT"}'
    assert second[3]["content"] == "BTC/USDT last 21,034.50"
    assert [m.kind for m in harness.conversation.messages] == [
        "trigger", "assistant", "tool_results", "assistant"]
    kinds = [e.type for e in harness.drained()]
    assert kinds[:4] == ["turn_start", "model_request", "text_delta", "usage"]
    assert kinds.index("tool_call") < kinds.index("tool_result") < kinds.index("turn_end")
    assert kinds[-1] == "turn_end"
    assert kinds.count("text_delta") == 4  # "Let me look." + three chunks of the answer
    scripted_server.assert_complete()


@pytest.mark.parametrize(
    ("fault", "status"),
    [
        (rate_limited(retry_after=2), 429),
        (server_error(500), 500),
        (server_error(502), 502),
        (server_error(503), 503),
        (server_error(504), 504),
        (HttpError(408, "request timeout"), 408),
        (HttpError(409, "conflict"), 409),
        (dropped_stream("This half answer must vanish", after_chunks=2), None),
        (slow(2.0, Reply("too late")), None),
    ],
    ids=["429", "500", "502", "503", "504", "408", "409", "dropped-stream", "timeout"],
)
async def test_each_fault_is_retried_and_evented(backend: OpenAICompatibleBackend,
                                                 scripted_server: ScriptedServer, fault: Step,
                                                 status: int | None) -> None:
    scripted_server.add(fault, Reply("Recovered answer."))
    harness = Harness(backend, scripted_server)
    result = await harness.loop.run_turn(harness.conversation, Trigger("tick", "moved"))
    assert result.text == "Recovered answer."
    retries = [e for e in harness.drained() if isinstance(e, RetryScheduled)]
    assert [(r.attempt, r.status_code) for r in retries] == [(1, status)]
    if status == 429:
        assert harness.sleeps == [2.0]  # Retry-After honoured
    else:
        assert 0 < harness.sleeps[0] <= 1.0  # first backoff step, with jitter
    # No half message: the conversation holds the trigger and the one complete answer.
    assert [m.text for m in harness.conversation.messages] == [
        "[tick]\nmoved", "Recovered answer."]


async def test_after_three_retries_the_backend_is_unavailable(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(*[server_error(503, "overloaded")] * 4)
    harness = Harness(backend, scripted_server)
    with pytest.raises(BackendUnavailableError) as raised:
        await harness.loop.run_turn(harness.conversation, Trigger("tick", "moved"))
    assert raised.value.status_code == 503
    assert "overloaded" in str(raised.value)
    events = harness.drained()
    assert [e.attempt for e in events if isinstance(e, RetryScheduled)] == [1, 2, 3]
    assert len(harness.sleeps) == 3
    assert harness.sleeps[0] < harness.sleeps[1] < harness.sleeps[2]  # exponential backoff
    errors = [e for e in events if isinstance(e, ErrorEvent)]
    assert errors and errors[-1].error_type == "BackendUnavailableError"
    assert len(scripted_server.requests) == 4
    assert [m.kind for m in harness.conversation.messages] == ["trigger"]


async def test_retry_after_is_capped_at_a_minute(backend: OpenAICompatibleBackend,
                                                 scripted_server: ScriptedServer) -> None:
    scripted_server.add(rate_limited(retry_after=3600), Reply("ok"))
    harness = Harness(backend, scripted_server)
    await harness.loop.run_turn(harness.conversation, Trigger("tick", "moved"))
    assert harness.sleeps == [60.0]


async def test_every_bad_tool_call_is_answered_and_the_turn_goes_on(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(
        Reply(tool_calls=[
            ToolCall("get_ticker", '{"symbol": "BTC/USDT"', id="bad_json"),
            ToolCall("get_ticker", {"sym": "BTC/USDT"}, id="bad_args"),
            ToolCall("get_tickers", {"symbol": "BTC/USDT"}, id="unknown"),
            ToolCall("get_ticker", {"symbol": "CRASH/USDT"}, id="raises"),
            ToolCall("wait", {"seconds": 5}, id="too_slow"),
        ]),
        Reply("I will try again later."),
    )
    harness = Harness(backend, scripted_server)
    result = await harness.loop.run_turn(harness.conversation, Trigger("tick", "moved"))
    assert result.text == "I will try again later."
    tool_messages = {m["tool_call_id"]: m["content"]
                     for m in scripted_server.requests[1].messages if m["role"] == "tool"}
    assert "not valid JSON" in tool_messages["bad_json"]
    assert "symbol: Field required" in tool_messages["bad_args"]
    assert "no tool named 'get_tickers'" in tool_messages["unknown"]
    assert "ConnectionError: exchange unreachable" in tool_messages["raises"]
    assert "did not finish within 0.5 s" in tool_messages["too_slow"]


async def test_the_round_limit_ends_the_turn_with_a_valid_conversation(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(*[Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})])
                          for _ in range(3)])
    harness = Harness(backend, scripted_server, maximum_rounds=3)
    result = await harness.loop.run_turn(harness.conversation, Trigger("tick", "moved"))
    assert result.hit_round_limit and result.rounds == 3
    assert "round limit" in result.text
    messages = harness.conversation.messages
    assert messages[-1].kind == "tool_results"
    assert repair(messages) == messages  # nothing to mend: every call has its result
    turn_end = [e for e in harness.drained() if e.type == "turn_end"]
    assert turn_end and turn_end[0].to_dict()["hit_round_limit"] is True
    scripted_server.assert_complete()


async def test_cancelling_mid_tool_leaves_every_call_answered(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    started = anyio.Event()
    scripted_server.add(Reply(tool_calls=[ToolCall("wait", {"seconds": 0.4}, id="slow_one"),
                                          ToolCall("get_ticker", {"symbol": "BTC/USDT"},
                                                   id="fast_one")]))
    harness = Harness(backend, scripted_server, started=started)

    async with anyio.create_task_group() as group:
        group.start_soon(harness.loop.run_turn, harness.conversation, Trigger("tick", "moved"))
        await started.wait()
        await anyio.sleep(0.05)
        group.cancel_scope.cancel()

    messages = harness.conversation.messages
    assert [m.kind for m in messages] == ["trigger", "assistant", "tool_results"]
    results: dict[str, Any] = {r.tool_use_id: r for r in messages[2].tool_results}
    assert results["fast_one"].text == "BTC/USDT last 21,034.50"  # finished: kept
    assert results["slow_one"].is_error and "interrupted" in results["slow_one"].text


async def test_the_models_reasoning_is_published_as_thinking_and_kept_out_of_the_conversation(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    def chunk(delta: dict[str, object], finish: str | None = None) -> dict[str, object]:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    scripted_server.add(SSEChunks([chunk({"reasoning_content": "Small move; "}),
                                   chunk({"reasoning_content": "hold."}),
                                   chunk({"content": "No trade."}), chunk({}, "stop")]),
                        Reply("Second answer."))
    harness = Harness(backend, scripted_server)

    result = await harness.loop.run_turn(harness.conversation, Trigger("tick", "BTC +0.1%"))
    await harness.loop.run_turn(harness.conversation, Trigger("tick", "BTC +0.2%"))

    assert result.text == "No trade."
    events = harness.drained()
    thinking = [e for e in events if isinstance(e, ThinkingDelta)]
    assert [e.text for e in thinking] == ["Small move; ", "hold."]
    assert {e.turn for e in thinking} == {result.turn_id} and thinking[0].desk == "alpha"
    assert "hold." not in str(scripted_server.requests[1].messages)  # never sent back
    assert all("hold." not in m.text for m in harness.conversation.messages)
