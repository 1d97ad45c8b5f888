"""A request prepared ahead of time (a desk restored with a long history) is sent byte for
byte as it would have been, and its messages are encoded before it is sent."""

from __future__ import annotations

import pytest

from trading_agent.agent.backend import ModelRequestSpec
from trading_agent.agent.conversation import Message, TextBlock, ToolResultBlock, ToolUseBlock
from trading_agent.backends.anthropic import AnthropicBackend
from trading_agent.backends.config import AnthropicBackendConfig, OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend


def _history(turns: int) -> list[Message]:
    messages: list[Message] = []
    for number in range(turns):
        call = ToolUseBlock(f"call_{number}", "get_ticker", '{"symbol": "BTC/USDT"}')
        messages += [
            Message.user_text(f"[tick: BTC/USDT]\nmoved to {21000 + number}"),
            Message(role="assistant", content=(TextBlock("Checking."), call)),
            Message(role="user", kind="tool_results", content=(
                ToolResultBlock(call.id, (TextBlock(f"last {21000 + number}"),)),)),
            Message(role="assistant", content=(TextBlock(f"No trade at {21000 + number}."),)),
        ]
    return messages


def _backend(provider: str) -> OpenAICompatibleBackend | AnthropicBackend:
    if provider == "anthropic":
        return AnthropicBackend(AnthropicBackendConfig(
            base_url="http://127.0.0.1:9", model="claude", api_key_env=None,
            context_window=200_000))
    return OpenAICompatibleBackend(OpenAIBackendConfig(base_url="http://127.0.0.1:9/v1",
                                                       model="m", context_window=32_000))


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_a_prepared_request_is_encoded_and_sends_the_same_bytes(provider: str) -> None:
    history = _history(150)
    request = ModelRequestSpec("You run a desk.", history, [], cache_key="desk-a")
    prepared, fresh = _backend(provider), _backend(provider)
    try:
        await prepared.prepare(request)
        assert all(message.cache for message in history), "every message encoded ahead"
        grown = [*history, Message.user_text("[tick: BTC/USDT]\nmoved again")]
        after = ModelRequestSpec("You run a desk.", grown, [], cache_key="desk-a")
        expected = fresh.request_body(ModelRequestSpec(
            "You run a desk.", [*_history(150), grown[-1]], [], cache_key="desk-a"))
        assert prepared.request_body(after) == expected
    finally:
        await prepared.aclose()
        await fresh.aclose()
