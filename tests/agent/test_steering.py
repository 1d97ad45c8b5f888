"""Steering, against the scripted server: what the model was sent after an operator wrote.

A message written during a tool round reaches the model after that round's results, marked
as an operator's; a tool call that started is never cancelled by it; a message written while
the model writes its final answer waits, and its owner (here :meth:`Desk.turn`, as the
daemon's mailbox does) opens the next turn with it at once: ``run_turn`` runs one turn.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from pydantic import BaseModel

from tests.agent.test_randomized_conversations import drain
from tests.scripted_server import (
    RecordedRequest,
    Reply,
    ScriptedServer,
    Step,
    ToolCall,
    server_error,
)
from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.context_compressor import ContextCompressor
from trading_agent.agent.conversation import Conversation, Message
from trading_agent.agent.event_bus import EventBus, Subscription
from trading_agent.agent.events import (
    Event,
    ModelRequest,
    SteeringDelivered,
    TextDelta,
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
from trading_agent.errors import BackendUnavailableError

MARK = "[Message from ana, a human operator, sent while you were working]\n"


class LabelArguments(BaseModel):
    label: str


class SymbolArguments(BaseModel):
    symbol: str


@dataclass
class Desk:
    loop: AgentLoop
    bus: EventBus
    events: Subscription
    inbox: SteeringInbox | None
    entered: anyio.Event = field(default_factory=anyio.Event)
    release: anyio.Event = field(default_factory=anyio.Event)
    finished: list[str] = field(default_factory=list)
    seen: list[Event] = field(default_factory=list)
    on_price: list[Callable[[], object]] = field(default_factory=list)
    conversation: Conversation = field(default_factory=lambda: Conversation("You are alpha."))

    async def turn(self) -> TurnResult:
        """A turn, then, as a desk's owner runs them, the turns late messages open."""
        result = await self.loop.run_turn(self.conversation, tick())
        while self.inbox is not None and not result.stopped and (
                late := self.inbox.take_next()) is not None:
            result = await self.loop.run_turn(self.conversation,
                                              late.to_trigger(after_answer=True))
        return result

    def of(self, kind: type[Event]) -> list[Any]:
        self.seen += drain(self.events)
        return [e for e in self.seen if isinstance(e, kind)]

    def put(self, text: str, source: str = "ana") -> SteeringMessage:
        message = SteeringMessage(text, source)
        assert self.inbox is not None
        self.inbox.put(message)
        return message


@contextlib.asynccontextmanager
async def running_desk(server: ScriptedServer, *, inbox: bool = True,
                       maximum_rounds: int = 6) -> AsyncIterator[Desk]:
    registry = ToolRegistry()
    desk: Desk

    @registry.tool(description="Waits until the test releases it.")
    async def wait_for_release(arguments: LabelArguments, context: ToolContext) -> str:
        desk.entered.set()
        await desk.release.wait()
        desk.finished.append(arguments.label)
        return f"released {arguments.label}"

    @registry.tool(description="Last price of a market.")
    async def get_price(arguments: SymbolArguments, context: ToolContext) -> str:
        for hook in desk.on_price:
            hook()
        desk.finished.append("price")
        return f"{arguments.symbol} last 64000"

    bus = EventBus()
    config = OpenAIBackendConfig(base_url=server.base_url, model="scripted-model",
                                 context_window=32_000, request_timeout=10)
    async with OpenAICompatibleBackend(config) as backend:
        steering = SteeringInbox() if inbox else None
        loop = AgentLoop("alpha", backend, ToolCallExecutor(registry), bus, maximum_rounds,
                         steering_inbox=steering)
        with bus.subscribe("test", max_buffer=100_000) as events:
            desk = Desk(loop, bus, events, steering)
            yield desk


async def _no_sleep(delay: float) -> None:
    await anyio.lowlevel.checkpoint()


def tick() -> Trigger:
    return Trigger(kind="tick", text="BTC/USDT moved 1%")


async def test_steering_reaches_the_model_after_the_tool_round_marked_as_an_operators(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("wait_for_release", {"label": "a"})]),
                        Reply("Understood: no buying."))
    results: list[TurnResult] = []
    async with running_desk(scripted_server) as desk:
        async def turn() -> None:
            results.append(await desk.turn())

        async with anyio.create_task_group() as group:
            group.start_soon(turn)
            with anyio.fail_after(5):
                await desk.entered.wait()
            message = desk.put("Do not buy anything.")
            await anyio.sleep(0.05)
            assert len(scripted_server.requests) == 1  # nothing reaches the model mid-round
            desk.release.set()
    assert [r.text for r in results] == ["Understood: no buying."]
    second = scripted_server.requests[1].messages
    assert second[-3]["role"] == "assistant" and second[-3]["tool_calls"]
    assert second[-2] == {"role": "tool", "tool_call_id": second[-3]["tool_calls"][0]["id"],
                          "content": "released a"}
    assert second[-1] == {"role": "user", "content": MARK + "Do not buy anything."}
    [delivered] = desk.of(SteeringDelivered)
    assert (delivered.after_round, delivered.message_id, delivered.started_turn) == (
        1, message.id, False)
    assert delivered.at >= delivered.queued_at == message.queued_at
    events = desk.seen
    [result] = desk.of(ToolResultReady)
    requests = desk.of(ModelRequest)
    assert events.index(result) < events.index(delivered) < events.index(requests[1])
    stored = desk.conversation.messages
    assert [m.kind for m in stored] == ["trigger", "assistant", "tool_results", "steering",
                                        "assistant"]
    assert stored[3].id == message.id
    scripted_server.assert_complete()


async def test_a_tool_call_that_started_is_never_cancelled_by_steering(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("wait_for_release", {"label": "slow"}),
                                          ToolCall("get_price", {"symbol": "BTC/USDT"})]),
                        Reply("Done."))
    async with running_desk(scripted_server) as desk, anyio.create_task_group() as group:
        priced = anyio.Event()
        desk.on_price.append(priced.set)
        group.start_soon(desk.turn)
        with anyio.fail_after(5):
            await desk.entered.wait()
            await priced.wait()
            await anyio.lowlevel.checkpoint()  # the price call's result is recorded
        desk.put("Stop everything!")
        await anyio.sleep(0.05)
        assert desk.finished == ["price"]  # the slow call still runs
        desk.release.set()
    assert desk.finished == ["price", "slow"]
    second = scripted_server.requests[1].messages
    assert [m["role"] for m in second[-4:]] == ["assistant", "tool", "tool", "user"]
    assert [m["content"] for m in second[-3:-1]] == ["released slow", "BTC/USDT last 64000"]
    assert second[-1]["content"] == MARK + "Stop everything!"
    results = desk.conversation.messages[2].tool_results
    assert not any(r.is_error for r in results)


async def test_a_message_written_during_the_final_answer_opens_the_next_turn(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("Holding; nothing to do.", text_chunks=5, chunk_delay=0.05),
                        Reply("Selling half, as asked."))
    async with running_desk(scripted_server) as desk:
        written: list[SteeringMessage] = []

        async def operator_writes_while_the_answer_streams() -> None:
            with desk.bus.subscribe("operator") as watch:
                async for event in watch:
                    if isinstance(event, TextDelta):
                        written.append(desk.put("Sell half."))
                        return

        async with anyio.create_task_group() as group:
            group.start_soon(operator_writes_while_the_answer_streams)
            await anyio.lowlevel.checkpoint()
            result = await desk.turn()

        assert result.text == "Selling half, as asked."
        [first_end, second_end] = desk.of(TurnEnded)
        assert first_end.final_text == "Holding; nothing to do."
        first_start, second_start = desk.of(TurnStarted)
        assert (second_start.trigger_kind, second_start.trigger_text) == ("operator", "Sell half.")
        assert result.turn_id == second_start.turn == second_end.turn != first_start.turn
        [delivered] = desk.of(SteeringDelivered)
        assert (delivered.turn, delivered.started_turn, delivered.after_round) == (
            second_start.turn, True, 0)
        assert delivered.message_id == written[0].id
        events = desk.seen
        assert (events.index(first_end) < events.index(second_start)
                < events.index(delivered) < events.index(desk.of(ModelRequest)[1]))
        assert desk.inbox is not None and desk.inbox.pending == 0
    second = scripted_server.requests[1].messages
    assert second[-2] == {"role": "assistant", "content": "Holding; nothing to do."}
    assert second[-1] == {"role": "user",
                          "content": "[Message from ana, a human operator]\nSell half."}
    assert desk.conversation.messages[2].id == written[0].id
    scripted_server.assert_complete()


async def test_several_late_messages_open_one_turn_and_the_others_follow_it(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("get_price", {"symbol": "BTC/USDT"})]),
                        Reply("Flat."), Reply("Both noted."))
    async with running_desk(scripted_server) as desk:
        original = desk.loop.backend.complete

        async def complete(request: Any, on_text: Any = None, on_thinking: Any = None) -> Any:
            reply = await original(request, on_text, on_thinking)
            if reply.text == "Flat.":  # two operators wrote while it was written
                desk.put("First.", "ana")
                desk.put("Second.", "bob")
            return reply

        desk.loop.backend.complete = complete  # type: ignore[method-assign]
        result = await desk.turn()
        assert result.text == "Both noted."
        first, second = desk.of(SteeringDelivered)
        assert (first.started_turn, second.started_turn) == (True, False)
        assert first.turn == second.turn and second.after_round == 0
    third = scripted_server.requests[2].messages
    assert [m["content"] for m in third[-3:]] == [
        "Flat.", "[Message from ana, a human operator]\nFirst.",
        "[Message from bob, a human operator, sent while you were working]\nSecond."]


async def test_a_message_at_the_round_limit_opens_the_next_turn(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("get_price", {"symbol": "BTC/USDT"})]),
                        Reply("Answering the operator."))
    async with running_desk(scripted_server, maximum_rounds=1) as desk:
        desk.on_price.append(lambda: desk.put("Why so many calls?"))
        result = await desk.turn()
        assert result.text == "Answering the operator." and not result.hit_round_limit
        first_end = desk.of(TurnEnded)[0]
        assert first_end.hit_round_limit
    second = scripted_server.requests[1].messages
    assert [m["role"] for m in second[-3:]] == ["assistant", "tool", "user"]
    assert second[-1]["content"] == "[Message from ana, a human operator]\nWhy so many calls?"


async def test_a_stopped_turn_does_not_follow_up_and_the_message_waits(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("get_price", {"symbol": "BTC/USDT"})]))
    async with running_desk(scripted_server) as desk:
        def shutdown_while_an_operator_writes() -> None:
            desk.loop.request_stop()
            desk.put("Are you there?")

        desk.on_price.append(shutdown_while_an_operator_writes)
        result = await desk.turn()
        assert result.stopped
        assert desk.inbox is not None and desk.inbox.pending == 1  # kept for the next turn
        assert not desk.of(SteeringDelivered)
    assert len(scripted_server.requests) == 1


async def test_a_message_waiting_when_a_turn_starts_is_delivered_before_its_first_call(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("Noted."))
    async with running_desk(scripted_server) as desk:
        message = desk.put("Careful today.")
        await desk.turn()
        [delivered] = desk.of(SteeringDelivered)
        assert (delivered.after_round, delivered.message_id) == (0, message.id)
    first = scripted_server.requests[0].messages
    assert first[-1]["content"] == MARK + "Careful today."
    assert first[-2]["content"].endswith("BTC/USDT moved 1%")


async def test_a_loop_without_an_inbox_runs_the_same_code(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("get_price", {"symbol": "BTC/USDT"})]),
                        Reply("BTC at 64000."))
    async with running_desk(scripted_server, inbox=False) as desk:
        result = await desk.turn()
        assert result.text == "BTC at 64000." and result.rounds == 2
        assert not desk.of(SteeringDelivered)
    scripted_server.assert_complete()


async def test_a_cancelled_turn_keeps_waiting_messages_for_the_next(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("wait_for_release", {"label": "x"})]),
                        Reply("Back."))
    async with running_desk(scripted_server) as desk:
        conversation = desk.conversation
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(desk.turn)
                await desk.entered.wait()
                desk.put("Still there?")
                scope.cancel()
        assert desk.inbox is not None and desk.inbox.pending == 1
        results = conversation.messages[-1].tool_results
        assert results[0].is_error and "interrupted" in results[0].text
        desk.release.set()
        await desk.turn()
    second = scripted_server.requests[1].messages
    assert second[-1]["content"] == MARK + "Still there?"
    tool = next(m for m in second if m["role"] == "tool")
    assert "interrupted" in tool["content"]


async def test_late_messages_wait_and_a_failed_compaction_before_their_turn_adds_nothing(
        scripted_server: ScriptedServer) -> None:
    """``run_turn`` runs one turn: messages written during its final answer wait in the
    inbox, in order. The compaction before the turn one of them opens fails: that turn
    raises before anything is added, so its owner can run it again (the daemon's desk
    does)."""
    bus, inbox = EventBus(), SteeringInbox()
    late = SteeringMessage("Sell half.", "ana")
    second = SteeringMessage("Then close the rest.", "ana")

    def model(request: RecordedRequest) -> Step:
        if len(scripted_server.requests) == 1:
            inbox.put(late)  # written while the model writes its final answer
            inbox.put(second)
            return Reply("Holding.", usage=(7_500, 10))  # the window is now past 70%
        return server_error(503)  # the summary request, and its retries

    scripted_server.responder = model
    config = OpenAIBackendConfig(base_url=scripted_server.base_url, model="scripted-model",
                                 context_window=8_000, request_timeout=10)
    history = [Message.user_text("tick " + "x" * 400), Message.user_text("answer " + "y" * 400)]
    conversation = Conversation("You are alpha.", history)
    async with OpenAICompatibleBackend(config) as backend:
        loop = AgentLoop("alpha", backend, ToolCallExecutor(ToolRegistry()), bus, 6,
                         compressor=ContextCompressor(8_000, keep_recent_tokens=30),
                         steering_inbox=inbox)
        loop.retry_policy.sleep = _no_sleep
        result = await loop.run_turn(conversation, tick())
        assert result.text == "Holding."
        assert [m.id for m in inbox.take_all()] == [late.id, second.id]  # in order
        count = len(conversation.messages)
        with pytest.raises(BackendUnavailableError):
            await loop.run_turn(conversation, late.to_trigger(after_answer=True))

    assert len(conversation.messages) == count
    assert all(m.kind != "steering" and late.id != m.id for m in conversation.messages)


def test_put_back_puts_a_message_at_the_front() -> None:
    inbox = SteeringInbox()
    older, newer = SteeringMessage("older"), SteeringMessage("newer")
    inbox.put(newer)
    inbox.put_back(older)
    assert inbox.pending == 2
    assert [m.id for m in inbox.take_all()] == [older.id, newer.id]
