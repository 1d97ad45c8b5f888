"""A prompt over the real local server's window: the server refuses it, the loop recovers.

The compressor acts before a request at 70% of the window, by its estimate (characters / 4).
Prices defeat that estimate: Gemma's tokenizer gives every digit a token of its own, so a
conversation of price lists that the estimate puts at a third of a 2048-token window is
over the window for the server. The server answers ``context_length_exceeded``; the loop must
compact (the summary requests themselves are split when the server refuses them too) and
replay, and the turn must end with the model's answer.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest

from tests.e2e.local_model import needs_local_model
from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.backend import ModelRequestSpec
from trading_agent.agent.context_compressor import ContextCompressor, request_tokens
from trading_agent.agent.conversation import Conversation, Message, TextBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import CompactionEnded, Event
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.backends.config import LocalModelConfig, OpenAIBackendConfig
from trading_agent.backends.local_server import LocalModelServer
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend

pytestmark = [pytest.mark.slow, needs_local_model]

WINDOW = 2048


def _price_history(rng: random.Random, hours: int) -> list[Message]:
    """Older turns: hourly closes the desk was shown, and its short answers."""
    messages: list[Message] = []
    for hour in range(hours):
        closes = " ".join(f"{16500 + rng.random() * 400:.1f}" for _ in range(80))
        messages.append(Message.user_text(f"[candle: BTC/USDT 5m, hour {hour}]\n{closes}"))
        messages.append(Message(role="assistant", content=(TextBlock("Noted."),)))
    return messages


async def _server_tokens(server: LocalModelServer, text: str) -> int:
    """The server's own count (llama-cpp-python's ``/extras/tokenize``)."""
    async with httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=server.unix_socket.path),
            base_url=server.base_url.removesuffix("/v1"), timeout=60,
            trust_env=False) as client:
        answer = await client.post("/extras/tokenize", json={"input": text})
        answer.raise_for_status()
        return len(answer.json()["tokens"])


@pytest.mark.timeout(300)
async def test_a_prompt_over_the_servers_window_is_compacted_and_replayed(
        model_cache: Path) -> None:
    config = LocalModelConfig(cache_dir=model_cache, context_window=WINDOW, threads=1)
    async with LocalModelServer(config) as server:
        backend_config = OpenAIBackendConfig(
            base_url=server.base_url, model=server.model, context_window=server.context_window,
            max_output_tokens=48, temperature=0, request_timeout=120)
        async with OpenAICompatibleBackend(backend_config,
                                           unix_socket=server.unix_socket) as backend:
            bus = EventBus()
            seen = bus.subscribe("test")
            # Messages up to 1,000 tokens are sent whole: no message is cut to fit before the
            # server has said what it counts.
            compressor = ContextCompressor(WINDOW, keep_recent_tokens=200, summary_max_tokens=96,
                                           tool_result_max_tokens=1000)
            loop = AgentLoop("probe", backend, ToolCallExecutor(ToolRegistry()), bus,
                             maximum_rounds=2, compressor=compressor)
            history = _price_history(random.Random(7), hours=4)
            conversation = Conversation("You are a paper-trading desk for BTC/USDT.", history)
            trigger = Trigger("operator", "In one sentence: where is BTC/USDT now?")

            # The premise: below the compressor's mark by estimate, over the window for real.
            estimate = request_tokens(ModelRequestSpec(
                conversation.system_prompt, [*history, trigger.to_message()], []))
            assert estimate < compressor.flush_threshold * WINDOW
            real = await _server_tokens(server, "\n".join(m.text for m in history))
            assert real > WINDOW

            result = await loop.run_turn(conversation, trigger)

    events: list[Event] = []
    while (event := seen.get_nowait()) is not None:
        events.append(event)
    kinds = [event.type for event in events]
    assert kinds[:3] == ["turn_start", "model_request", "overflow_recovery"], kinds
    assert kinds[-1] == "turn_end" and "error" not in kinds, kinds
    recovery = kinds.index("overflow_recovery")
    assert kinds[recovery + 1] == "compaction_start"
    compactions = [e for e in events if isinstance(e, CompactionEnded)]
    assert [e.reason for e in compactions] == ["overflow"]
    assert compactions[0].messages_summarized >= len(history) - 1
    assert kinds[kinds.index("compaction_end") + 1:].count("model_request") == 1  # the replay

    assert not result.hit_round_limit and not result.stopped
    assert result.rounds == 1
    assert isinstance(result.text, str)
    assert result.usage.input_tokens > 0
    # What is sent shrank to the summary (the store, not memory, keeps the full transcript).
    assert conversation.summary is not None
    assert len(conversation.messages) < len(history)
    assert conversation.messages[-1].role == "assistant"
