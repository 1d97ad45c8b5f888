"""Hooks observe and intervene: requests changed or refused, tool calls refused or changed,
results rewritten, every model call reported; a failing hook never fails a turn."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel

from tests.scripted_server import Reply, ScriptedServer, ToolCall
from trading_agent.agent import (
    AgentLoop,
    Conversation,
    EventBus,
    Message,
    ToolCallExecutor,
    ToolContext,
    ToolRegistry,
    Trigger,
)
from trading_agent.agent.backend import ModelRequestSpec
from trading_agent.agent.conversation import ToolResultBlock, ToolUseBlock
from trading_agent.agent.events import HookFailed, ToolResultReady
from trading_agent.agent.hooks import ModelCallReport, Refuse
from trading_agent.agent.tool_registry import Tool
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend


class OrderArguments(BaseModel):
    side: str
    amount: float


def _registry(placed: list[OrderArguments]) -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(description="Places an order.")
    async def place_order(arguments: OrderArguments, context: ToolContext) -> str:
        placed.append(arguments)
        return f"placed: {arguments.side} {arguments.amount}"

    return registry


@pytest.fixture
async def backend(scripted_server: ScriptedServer) -> AsyncIterator[OpenAICompatibleBackend]:
    config = OpenAIBackendConfig(base_url=scripted_server.base_url, model="scripted-model",
                                 context_window=32_000, request_timeout=5)
    async with OpenAICompatibleBackend(config) as created:
        yield created


class _Run:
    def __init__(self, backend: OpenAICompatibleBackend, hooks: list[object],
                 gate: Any = None) -> None:
        self.placed: list[OrderArguments] = []
        self.bus = EventBus()
        self.events = self.bus.subscribe("test")
        executor = ToolCallExecutor(_registry(self.placed), approval_gate=gate)
        self.loop = AgentLoop("alpha", backend, executor, self.bus, maximum_rounds=4,
                              hooks=hooks)
        self.conversation = Conversation("You run a BTC desk.")

    async def turn(self, text: str = "Buy some.") -> Any:
        return await self.loop.run_turn(self.conversation, Trigger("operator", text))

    def of(self, kind: type) -> list[Any]:
        found = []
        while (event := self.events.get_nowait()) is not None:
            if isinstance(event, kind):
                found.append(event)
        return found


def _order(side: str = "buy", amount: float = 0.5) -> Reply:
    return Reply(tool_calls=[ToolCall("place_order", {"side": side, "amount": amount})])


async def test_a_hook_changes_the_request_and_another_refuses_the_next(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    class Tag:
        async def before_request(self, request: ModelRequestSpec, turn: str) -> Any:
            note = Message.user_text("[risk desk: no new longs after 20:00]", kind="notice")
            return dataclasses.replace(request, messages=[*request.messages, note])

    class Budget:
        def __init__(self) -> None:
            self.calls = 0

        def before_request(self, request: ModelRequestSpec, turn: str) -> Refuse | None:
            self.calls += 1
            return Refuse("the desk's hourly model budget is spent") if self.calls > 1 else None

    scripted_server.add(_order(), Reply("never asked"))
    run = _Run(backend, [Tag(), Budget()])

    result = await run.turn()

    assert len(scripted_server.requests) == 1
    assert "no new longs" in scripted_server.requests[0].messages[-1]["content"]
    assert result.stopped
    assert result.text == "The model was not asked: the desk's hourly model budget is spent"
    assert [m.kind for m in run.conversation.messages] == ["operator", "assistant",
                                                           "tool_results"]


async def test_a_tool_call_is_refused_or_its_arguments_changed_before_the_gate_sees_them(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    class HalfSize:
        def before_tool_call(self, call: ToolUseBlock, arguments: Any,
                             context: ToolContext) -> Any:
            if arguments.side == "sell":
                return Refuse("this desk does not sell today")
            return {"side": arguments.side, "amount": arguments.amount / 2}

    class Gate:
        def __init__(self) -> None:
            self.reviewed: list[float] = []

        async def review(self, tool: Tool, arguments: Any, context: ToolContext) -> str | None:
            self.reviewed.append(arguments.amount)
            return None

    gate = Gate()
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", {"side": "buy", "amount": 1}),
                                          ToolCall("place_order", {"side": "sell",
                                                                   "amount": 1})]),
                        Reply("Done."))
    run = _Run(backend, [HalfSize()], gate)

    await run.turn()

    assert [(o.side, o.amount) for o in run.placed] == [("buy", 0.5)]
    assert gate.reviewed == [0.5]  # the gate, last, saw the changed arguments
    results = [m["content"] for m in scripted_server.requests[1].messages
               if m["role"] == "tool"]
    assert results == ["placed: buy 0.5", "this desk does not sell today"]


async def test_a_result_is_rewritten_and_every_model_call_reported_in_order(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    seen: list[str] = []

    class Redact:
        def after_tool_result(self, call: ToolUseBlock, result: ToolResultBlock,
                              context: ToolContext) -> str:
            seen.append("redact")
            return result.text.replace("0.5", "[amount]")

    class Meter:
        def __init__(self) -> None:
            self.reports: list[ModelCallReport] = []

        async def after_model_call(self, report: ModelCallReport) -> None:
            seen.append("meter")
            self.reports.append(report)

    meter = Meter()
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", {"side": "buy",
                                                                   "amount": 0.5})],
                              usage=(100, 10)),
                        Reply("Bought.", usage=(150, 5)), Reply("Again.", usage=(200, 3)))
    run = _Run(backend, [Redact(), meter])

    await run.turn()
    await run.turn("And now?")

    tool_message = next(m for m in scripted_server.requests[1].messages if m["role"] == "tool")
    assert tool_message["content"] == "placed: buy [amount]"
    [ready] = run.of(ToolResultReady)
    assert ready.text == "placed: buy [amount]"
    assert seen == ["meter", "redact", "meter", "meter"]
    first, second, third = meter.reports
    assert (first.usage.input_tokens, first.turn_usage.input_tokens,
            first.total_usage.input_tokens, first.round) == (100, 100, 100, 1)
    assert (second.turn_usage.input_tokens, second.total_usage.input_tokens,
            second.round) == (250, 250, 2)
    assert (third.turn_usage.input_tokens, third.total_usage.input_tokens) == (200, 450)
    assert all(report.elapsed > 0 for report in meter.reports)


async def test_a_failing_or_confused_hook_is_reported_and_the_turn_goes_on(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    class Broken:
        def before_request(self, request: ModelRequestSpec, turn: str) -> None:
            raise RuntimeError("the hook's database is down")

        def before_tool_call(self, call: ToolUseBlock, arguments: Any,
                             context: ToolContext) -> dict[str, object]:
            return {"side": "buy", "amount": "a lot"}  # not a number: left out

        def after_tool_result(self, call: ToolUseBlock, result: ToolResultBlock,
                              context: ToolContext) -> int:
            return 42

    scripted_server.add(_order(), Reply("Bought."))
    run = _Run(backend, [Broken()])

    result = await run.turn()

    assert result.text == "Bought."
    assert [(o.side, o.amount) for o in run.placed] == [("buy", 0.5)]
    failures = run.of(HookFailed)
    assert [(f.hook, f.method) for f in failures] == [
        ("Broken", "before_request"), ("Broken", "before_tool_call"),
        ("Broken", "after_tool_result"), ("Broken", "before_request")]
    assert "database is down" in failures[0].error and failures[0].turn == result.turn_id
    assert "invalid" in failures[1].error
