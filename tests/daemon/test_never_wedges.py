"""A desk never wedges: whatever arrives, what is sent fits the window, and after a failure
the next message is answered.

The scripted server plays a small model's server: it counts tokens the way Gemma's
tokenizer does for prices (every digit a token, the rest about four characters a token)
and refuses a prompt over its window with ``context_length_exceeded``, as llama.cpp does.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from pydantic import BaseModel

from tests.daemon.harness import open_store, stop_desk, wait_for
from tests.scripted_server import (
    RecordedRequest,
    Reply,
    ScriptedServer,
    Step,
    ToolCall,
    context_overflow,
)
from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.context_compressor import ContextCompressor
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import ErrorEvent, Event
from trading_agent.agent.retry import RetryPolicy
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.daemon.desk import Backoff, Desk, DeskProfile
from trading_agent.daemon.events import DeskPaused
from trading_agent.daemon.mailbox import Mailbox
from trading_agent.store.store import Store

WINDOW = 2048


class NoArguments(BaseModel):
    """No arguments."""


def server_tokens(request: RecordedRequest) -> int:
    """What a small model's tokenizer makes of the request: digits one token each."""
    text = json.dumps(request.json.get("messages"), ensure_ascii=False)
    text += json.dumps(request.json.get("tools") or [])
    digits = sum(ch.isdigit() for ch in text)
    return digits + (len(text) - digits) // 4


def window_of(size: int, answer: Callable[[RecordedRequest], Step]) -> Callable[
        [RecordedRequest], Step]:
    """A responder that refuses prompts over ``size`` tokens, as llama.cpp's server does."""
    def respond(request: RecordedRequest) -> Step:
        if server_tokens(request) > size:
            return context_overflow()
        return answer(request)
    return respond


def is_summary_request(request: RecordedRequest) -> bool:
    return str(request.messages[0].get("content", "")).startswith("You maintain the running")


def answering(request: RecordedRequest) -> Step:
    if is_summary_request(request):
        return Reply("## Goal\n- trade BTC\n## Positions and open orders\n- none\n"
                     "## Decisions and why\n- none\n## Risks\n- none\n## Next steps\n- wait")
    return Reply("Noted.", usage=(server_tokens(request), 3))


def small_desk(store: Store, base_url: str, bus: EventBus, registry: ToolRegistry | None = None
               ) -> Desk:
    backend = OpenAICompatibleBackend(OpenAIBackendConfig(
        base_url=base_url, model="small", context_window=WINDOW, max_output_tokens=64))
    mailbox = Mailbox()
    loop = AgentLoop("small", backend, ToolCallExecutor(registry or ToolRegistry()), bus,
                     maximum_rounds=4, compressor=ContextCompressor(WINDOW),
                     steering_inbox=mailbox)
    loop.retry_policy = RetryPolicy(max_retries=1, base_delay=0.001, max_delay=0.002)
    return Desk(DeskProfile("small"), loop, "You are a paper-trading desk for BTC/USDT.",
                store, mailbox=mailbox, event_bus=bus,
                backoff=Backoff(crash_first=0.01, crash_max=0.02, pause_first=0.01,
                                pause_max=0.02))


def pasted_prices(size: int) -> str:
    rng = random.Random(3)
    return "Look at these closes: " + " ".join(f"{16500 + rng.random() * 400:.1f}"
                                                for _ in range(size // 8))


async def test_an_8kb_operator_message_on_a_2048_token_window_is_answered(
        tmp_path: Path) -> None:
    bus = EventBus()
    with ScriptedServer(responder=window_of(WINDOW, answering)) as server:
        async with open_store(tmp_path) as store, anyio.create_task_group() as group:
            desk = small_desk(store, server.base_url, bus)
            group.start_soon(desk.run)
            await desk.ready.wait()
            await desk.send_message(pasted_prices(8192))
            await wait_for(lambda: desk.turns == 1)
            await desk.send_message("And now, in one word?")
            await wait_for(lambda: desk.turns == 2)
            transcript = await store.transcripts.transcript("small")
            await stop_desk(desk, group)

        overflows = [r for r in server.requests if server_tokens(r) > WINDOW]
        assert not overflows, "a request over the window was sent"
    # The store keeps the whole message; what was sent was cut, saying so.
    assert len(transcript[0]["text"]) > 8000
    sent = server.requests[0].messages[-1]["content"]
    assert "cut" in sent and "store" in sent


async def test_a_huge_tool_result_and_a_long_conversation_end_in_answered_turns(
        tmp_path: Path) -> None:
    registry = ToolRegistry()

    @registry.tool(description="Dumps every close of the day.")
    async def dump_closes(arguments: NoArguments, context: ToolContext) -> str:
        return pasted_prices(20000)

    def calls_then_answers(request: RecordedRequest) -> Step:
        last = request.messages[-1]
        if request.tools and last.get("role") == "user":
            return Reply(tool_calls=[ToolCall("dump_closes", {})])
        return answering(request)

    bus = EventBus()
    with ScriptedServer(responder=window_of(WINDOW, calls_then_answers)) as server:
        async with open_store(tmp_path) as store, anyio.create_task_group() as group:
            desk = small_desk(store, server.base_url, bus, registry)
            group.start_soon(desk.run)
            await desk.ready.wait()
            for turn in range(1, 7):
                await desk.send_message(f"Check {turn}: dump the closes, then one word.")
                await wait_for(lambda turn=turn: desk.turns == turn)  # type: ignore[misc]
            await stop_desk(desk, group)
        assert not [r for r in server.requests if server_tokens(r) > WINDOW]


async def test_after_an_overflow_that_cannot_be_recovered_the_next_message_is_answered(
        tmp_path: Path) -> None:
    """The server refuses everything for a while (it has less room than it says): the desk
    tells the operator why, does not retry the same prompt in a loop, and answers the next
    message once the server takes prompts again."""
    refusing = {"on": True}

    def respond(request: RecordedRequest) -> Step:
        if refusing["on"] and not is_summary_request(request):
            return context_overflow()
        return answering(request)

    bus = EventBus()
    seen: list[Event] = []
    subscription = bus.subscribe("test")
    with ScriptedServer(responder=respond) as server:
        async with open_store(tmp_path) as store, anyio.create_task_group() as group:
            desk = small_desk(store, server.base_url, bus)
            group.start_soon(desk.run)
            await desk.ready.wait()
            await desk.send_message("First question.")
            await wait_for(lambda: any(isinstance(e, ErrorEvent) for e in _drain(
                subscription, seen)))
            await anyio.sleep(0.3)  # a restart loop would ask again and again meanwhile
            asked = len(server.requests)
            await anyio.sleep(0.3)
            assert len(server.requests) == asked, "the desk keeps retrying the same prompt"
            refusing["on"] = False
            await desk.send_message("Second question.")
            await wait_for(lambda: desk.turns >= 1)
            status = desk.status()
            await stop_desk(desk, group)
    errors = [e for e in seen if isinstance(e, ErrorEvent)]
    assert "window" in errors[0].message
    assert status.last_turn_text == "Noted."
    assert server.requests[-1].messages[-1]["content"].endswith("Second question.")


def _wide_registry() -> ToolRegistry:
    """One tool whose definition alone takes most of a 2,048-token window."""
    registry = ToolRegistry()

    @registry.tool(description="Reads the whole market. " + "Every field is explained. " * 200)
    async def read_market(arguments: NoArguments, context: ToolContext) -> str:
        return "nothing"

    return registry


async def test_a_desk_whose_fixed_part_does_not_fit_is_paused_with_the_numbers(
        tmp_path: Path) -> None:
    """The server refuses every prompt as too long and its tokenizer says the tools alone
    overflow the window: after one failed message the desk is paused, the operator sees why
    and what to change, and the next message waits for the resume instead of failing."""
    refusing = {"on": True}

    def respond(request: RecordedRequest) -> Step:
        if refusing["on"] and not is_summary_request(request):
            return context_overflow()
        return answering(request)

    bus = EventBus()
    seen: list[Event] = []
    subscription = bus.subscribe("test")
    with ScriptedServer(responder=respond) as server:
        server.tokenizer = lambda content: len(content) // 2
        async with open_store(tmp_path) as store, anyio.create_task_group() as group:
            desk = small_desk(store, server.base_url, bus, _wide_registry())
            group.start_soon(desk.run)
            await desk.ready.wait()
            await desk.send_message("Say OK.")
            await wait_for(lambda: any(isinstance(e, DeskPaused) for e in _drain(
                subscription, seen)))
            status = desk.status()
            asked = len(server.requests)
            await desk.send_message("Second question.")
            queued = desk.status()
            refusing["on"] = False
            assert await desk.resume("ana") is not None
            await wait_for(lambda: desk.turns >= 1)
            await stop_desk(desk, group)
    paused = next(e for e in seen if isinstance(e, DeskPaused))
    assert paused.by == "daemon"
    for part in ("by the model's tokenizer", "context_window (2,048)", "desks.small.tools",
                 "model.max_output_tokens", "then resume the desk", "1 turn(s) in a row"):
        assert part in paused.reason
    assert status.state == "paused" and paused.reason in status.paused_reason
    assert queued.state == "paused" and len(server.requests) > asked
    assert server.requests[asked].messages[-1]["content"].endswith("Second question.")


async def test_without_a_tokenizer_a_desk_is_paused_after_two_refused_turns_in_a_row(
        tmp_path: Path) -> None:
    bus = EventBus()
    seen: list[Event] = []
    subscription = bus.subscribe("test")

    def respond(request: RecordedRequest) -> Step:
        return answering(request) if is_summary_request(request) else context_overflow()

    with ScriptedServer(responder=respond) as server:
        async with open_store(tmp_path) as store, anyio.create_task_group() as group:
            desk = small_desk(store, server.base_url, bus)
            group.start_soon(desk.run)
            await desk.ready.wait()
            await desk.send_message("First question.")
            await wait_for(lambda: any(isinstance(e, ErrorEvent) for e in _drain(
                subscription, seen)))
            after_one = desk.status()
            await desk.send_message("Second question.")
            await wait_for(lambda: any(isinstance(e, DeskPaused) for e in _drain(
                subscription, seen)))
            status = desk.status()
            await stop_desk(desk, group)
    assert after_one.paused_reason == ""
    reason = next(e for e in seen if isinstance(e, DeskPaused)).reason
    assert "2 turn(s) in a row" in reason and "estimated at 3 characters a token" in reason
    assert status.state == "paused" and "context_window (2,048)" in status.paused_reason


def _drain(subscription: object, into: list[Event]) -> list[Event]:
    while (event := subscription.get_nowait()) is not None:  # type: ignore[attr-defined]
        into.append(event)
    return into


pytestmark = pytest.mark.timeout(60)
