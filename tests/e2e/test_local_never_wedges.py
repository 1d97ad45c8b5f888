"""The embedded model with a 2,048-token window never wedges.

Gemma's tokenizer gives every digit a token, so prices defeat a characters-divided-by-four
estimate. An 8 KB paste of prices from an operator, a tool result of 20 KB of prices, and a
history whose summary requests are themselves too long for the server: each turn must end
with the model's answer, and the next message must be answered too.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.e2e.local_model import needs_local_model
from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.context_compressor import ContextCompressor
from trading_agent.agent.conversation import (
    Conversation,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import ErrorEvent, Event
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.backends.config import LocalModelConfig, OpenAIBackendConfig
from trading_agent.backends.local_server import LocalModelServer
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend

pytestmark = [pytest.mark.slow, needs_local_model]

WINDOW = 2048


def prices(rng: random.Random, count: int) -> str:
    return " ".join(f"{16500 + rng.random() * 400:.1f}" for _ in range(count))


def history(rng: random.Random) -> list[Message]:
    """A restored day: price lists, a huge tool result, short answers."""
    messages: list[Message] = []
    for hour in range(3):
        messages.append(Message.user_text(f"[candle: BTC/USDT, hour {hour}]\n"
                                          f"{prices(rng, 60)}"))
        messages.append(Message(role="assistant", content=(TextBlock("Noted."),)))
    call = ToolUseBlock("call_dump", "get_candles", '{"limit": 3000}')
    messages.append(Message(role="assistant", content=(call,)))
    messages.append(Message(role="user", kind="tool_results", content=(
        ToolResultBlock("call_dump", (TextBlock(prices(rng, 2500)),)),)))
    messages.append(Message(role="assistant", content=(TextBlock("That is a lot of data."),)))
    return messages


@pytest.mark.timeout(600)
async def test_long_pastes_results_and_summaries_all_end_in_answers(model_cache: Path) -> None:
    rng = random.Random(11)
    # One llama.cpp thread: beside make test's other worker, two spin at every barrier.
    config = LocalModelConfig(cache_dir=model_cache, context_window=WINDOW, threads=1)
    async with LocalModelServer(config) as server:
        backend_config = OpenAIBackendConfig(
            base_url=server.base_url, model=server.model, context_window=server.context_window,
            max_output_tokens=32, temperature=0, request_timeout=120)
        async with OpenAICompatibleBackend(backend_config,
                                           unix_socket=server.unix_socket) as backend:
            bus = EventBus()
            seen = bus.subscribe("test")
            loop = AgentLoop("tiny", backend, ToolCallExecutor(ToolRegistry()), bus,
                             maximum_rounds=2, compressor=ContextCompressor(WINDOW))
            conversation = Conversation("You are a paper-trading desk for BTC/USDT.",
                                        history(rng))
            paste = "Here are today's closes: " + prices(rng, 1100)  # about 8 KB
            assert len(paste) > 8000

            first = await loop.run_turn(conversation, Trigger("operator", paste))
            second = await loop.run_turn(
                conversation, Trigger("operator", "In one word: up or down?"))

    events: list[Event] = []
    while (event := seen.get_nowait()) is not None:
        events.append(event)
    assert not [e for e in events if isinstance(e, ErrorEvent)]
    for result in (first, second):
        assert not result.hit_round_limit and not result.stopped
        assert result.usage.input_tokens > 0  # the server answered
    # The whole paste is in the conversation (the store); what was sent was cut.
    assert any(m.text == f"[Message from operator, a human operator]\n{paste}"
               for m in conversation.messages) or conversation.summary is not None
    assert conversation.messages[-1].role == "assistant"
