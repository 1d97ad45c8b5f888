"""What a desk sends keeps its prefix: tools in a fixed order, the same bytes for the system
prompt and the tools, and each request beginning with the whole previous one (so a server's
prefix cache can serve it). Against the scripted server, over real HTTP."""

from __future__ import annotations

import itertools

from pydantic import BaseModel

from tests.scripted_server import Reply, ScriptedServer, ToolCall
from trading_agent.agent import (
    AgentLoop,
    Conversation,
    EventBus,
    ToolCallExecutor,
    ToolContext,
    ToolRegistry,
    Trigger,
)
from trading_agent.agent.context_compressor import ContextCompressor
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend

NAMES = ["get_ticker", "get_candles", "remember", "place_order"]


class SymbolArguments(BaseModel):
    symbol: str


def _registry() -> ToolRegistry:
    registry = ToolRegistry()
    for name in NAMES:
        async def handler(arguments: SymbolArguments, context: ToolContext,
                          name: str = name) -> str:
            return f"{name} {arguments.symbol}: 64,000"

        registry.tool(name=name, description=f"The {name} tool.")(handler)
    return registry


def test_tool_definitions_keep_their_order_and_their_objects() -> None:
    registry = _registry()
    first, second = registry.definitions(), registry.definitions()
    assert [d["function"]["name"] for d in first] == NAMES  # registration order, not sorted
    # The same objects each time: the backend encodes them once, to the same bytes.
    assert all(a is b for a, b in zip(first, second, strict=True))
    assert [d["function"]["name"] for d in registry.subset(["remember", "get_ticker"])
            .definitions()] == ["remember", "get_ticker"]


async def test_each_request_begins_with_the_whole_previous_one(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(
        Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})]),
        Reply("BTC holds 64,000."),
        Reply(tool_calls=[ToolCall("get_candles", {"symbol": "ETH/USDT"})]),
        Reply("ETH is quiet."),
    )
    backend = OpenAICompatibleBackend(OpenAIBackendConfig(
        base_url=scripted_server.base_url, model="scripted-model", context_window=32_000,
        request_timeout=10))
    async with backend:
        loop = AgentLoop("alpha", backend, ToolCallExecutor(_registry()), EventBus(),
                         maximum_rounds=4, compressor=ContextCompressor(32_000))
        conversation = Conversation("You are the alpha desk.")
        await loop.run_turn(conversation, Trigger(kind="operator", text="BTC?",
                                                  source="erin"))
        await loop.run_turn(conversation, Trigger(kind="candle", text="5m candle closed",
                                                  source="ETH/USDT"))

    bodies = [r.body for r in scripted_server.requests]
    assert len(bodies) == 4
    for earlier, later in itertools.pairwise(bodies):
        assert earlier.endswith(b"]}")
        assert later.startswith(earlier[:-2] + b","), (earlier[-200:], later[:len(earlier)])
    assert [t["function"]["name"] for t in scripted_server.requests[-1].json["tools"]] == NAMES
    scripted_server.assert_complete()
