"""What goes over the wire is pinned: the same conversation sends the same bytes.

A fixed desk history (text, tool calls with good and broken arguments, tool results with a
picture, a steering message, more pictures than are kept) runs one turn of three model calls
through the real loop and the real backend to the scripted server. Every request body must
equal, byte for byte, the one recorded in ``tests/fixtures/wire/openai_turn.jsonl`` (made by
the loop before its transport was replaced), and the headers must be the ones the OpenAI SDK
sends. Run with ``TRADING_AGENT_RECORD_WIRE=1`` to record the file again after a deliberate
change of the wire format, and say why in the commit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import openai
from pydantic import BaseModel

from tests.scripted_server import Reply, ScriptedServer, ToolCall
from trading_agent.agent import (
    AgentLoop,
    Conversation,
    EventBus,
    ImageBlock,
    Message,
    TextBlock,
    ToolCallExecutor,
    ToolContext,
    ToolRegistry,
    ToolResultBlock,
    ToolUseBlock,
    Trigger,
)
from trading_agent.agent.context_compressor import ContextCompressor
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend

RECORDING = Path(__file__).resolve().parents[1] / "fixtures" / "wire" / "openai_turn.jsonl"
PICTURE = bytes(range(256)) * 3


class Symbol(BaseModel):
    symbol: str


def _registry() -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(description="Last price of a market.")
    async def get_ticker(arguments: Symbol, context: ToolContext) -> str:
        return f"{arguments.symbol} last 21,034.50 bid 21,034.40 ask 21,034.60"

    @registry.tool(description="A chart of the last candles.")
    async def get_chart(arguments: Symbol, context: ToolContext) -> str:
        return f"Chart of {arguments.symbol}: up 2% in an hour."

    return registry


def _history() -> list[Message]:
    """A desk's past, with every kind of block the encoder translates."""
    messages: list[Message] = []
    for index in range(6):
        call = ToolUseBlock(f"hist_{index}", "get_chart", '{"symbol": "BTC/USDT"}')
        broken = ToolUseBlock(f"bad_{index}", "get_ticker", '{"symbol": "BTC/')
        messages += [
            Message.user_text(f"[tick: BTC/USDT]\nBTC/USDT moved 0.{index}% to {21000 + index}"),
            Message(role="assistant", content=(TextBlock("Looking at the chart."), call, broken)),
            Message(role="user", kind="tool_results", content=(
                ToolResultBlock(call.id, (TextBlock(f"Chart {index}"),
                                          ImageBlock(PICTURE + bytes([index]),
                                                     description=f"chart {index}"))),
                ToolResultBlock(broken.id, (TextBlock("Invalid arguments: not JSON"),),
                                is_error=True),
            )),
            Message(role="assistant", content=(TextBlock(f"No trade at {21000 + index}. "
                                                         "Ünïcode — “quotes” \n\t ok"),)),
        ]
    messages.append(Message.user_text("Keep risk low today.", kind="steering"))
    messages.append(Message(role="assistant", content=(TextBlock("Understood."),)))
    return messages


async def _requests(server: ScriptedServer) -> tuple[list[bytes], list[dict[str, str]]]:
    server.add(
        Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"}, id="call_1"),
                          ToolCall("get_chart", {"symbol": "ETH/USDT"}, id="call_2")]),
        Reply("Still checking.", tool_calls=[ToolCall("get_ticker", {"symbol": "SOL/USDT"},
                                                      id="call_3")]),
        Reply("Holding: no setup worth trading."),
    )
    config = OpenAIBackendConfig(
        base_url=server.base_url, model="desk-model", context_window=200_000,
        api_key_env="WIRE_TEST_KEY", temperature=0.2, max_output_tokens=900,
        extra_headers={"X-Desk-Fleet": "east"}, extra_body={"top_p": 0.9})
    async with OpenAICompatibleBackend(config, environ={"WIRE_TEST_KEY": "sk-wire"}) as backend:
        loop = AgentLoop("wire-desk", backend, ToolCallExecutor(_registry()), EventBus(),
                         maximum_rounds=5, compressor=ContextCompressor(200_000))
        conversation = Conversation("You run the BTC desk.\nBe careful.", _history())
        result = await loop.run_turn(conversation, Trigger(
            "schedule", "Hourly check.", source="hourly", at=1_700_000_000.0, id="t1"))
    assert result.text == "Holding: no setup worth trading."
    server.assert_complete()
    return [r.body for r in server.requests], [dict(r.headers) for r in server.requests]


async def test_the_requests_of_a_turn_are_byte_for_byte_the_recorded_ones(
        scripted_server: ScriptedServer) -> None:
    bodies, _ = await _requests(scripted_server)

    if os.environ.get("TRADING_AGENT_RECORD_WIRE"):
        RECORDING.parent.mkdir(parents=True, exist_ok=True)
        RECORDING.write_bytes(b"".join(body + b"\n" for body in bodies))
    recorded = RECORDING.read_bytes().splitlines()
    assert len(bodies) == len(recorded) == 3
    for number, (sent, expected) in enumerate(zip(bodies, recorded, strict=True), start=1):
        assert sent == expected, f"request {number} differs from the recorded one"


async def test_the_headers_are_the_ones_the_openai_sdk_sends(
        scripted_server: ScriptedServer) -> None:
    _, headers = await _requests(scripted_server)

    sdk = openai.AsyncOpenAI(api_key="sk-wire", base_url=scripted_server.base_url,
                             default_headers={"X-Desk-Fleet": "east"})
    expected: dict[str, Any] = {name.lower(): value for name, value in sdk.default_headers.items()
                                if isinstance(value, str)}
    await sdk.close()
    expected.update({
        "authorization": "Bearer sk-wire",
        "accept": "text/event-stream",
        "content-type": "application/json",
        "x-stainless-async": "async:asyncio",
        "x-stainless-retry-count": "0",
        "x-stainless-read-timeout": "120.0",
    })
    for sent in headers:
        assert {name: sent.get(name) for name in expected} == expected
        assert int(sent["content-length"]) > 0
