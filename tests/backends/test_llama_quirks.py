"""llama-cpp-python's server is not tidy: each of its quirks, replayed from captured bytes.

``tests/fixtures/llama_server/README.md`` lists what a client of that server has to cope
with; every answer here is one of those captures, sent back byte for byte by the scripted
server, and the backend must read it as the obvious answer (or the right error):

- a stream with no usage at all (``chatml-function-calling``), or usage riding on the
  finishing chunk (our ``trading-agent-tools`` format);
- tool-call ids in the server's own shape, the call's name repeated in every delta;
- a legacy ``function_call`` beside ``tool_calls``, its name empty or whole;
- a 400 ``context_length_exceeded`` for a prompt over the window, an ``error`` event inside
  a 200 stream, or an empty 200 body: each a :class:`ContextOverflowError`;
- a keep-alive comment before the first event; an empty answer.

The backend always streams, so a captured non-streamed message (``*.json``) is replayed as
the delta of one chunk: the same fields, as a streaming server sends them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.scripted_server import RawJSON, RawSSE, ScriptedServer, SSEChunks
from trading_agent.agent.backend import ModelRequestSpec, Usage
from trading_agent.agent.conversation import (
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    estimate_tokens,
)
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.errors import ContextOverflowError, TransientBackendError

CAPTURES = Path(__file__).parent.parent / "fixtures" / "llama_server"
OURS = CAPTURES / "trading_agent_tools"
CHATML = CAPTURES / "chatml_function_calling"
MODEL = "gemma-3-270m"
TICKER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_ticker", "description": "Get the last price of a market symbol.",
    "parameters": {"type": "object", "properties": {"symbol": {"type": "string"}},
                   "required": ["symbol"]}}}


def _capture(path: Path) -> str:
    return path.read_text()


def _as_one_chunk(path: Path) -> SSEChunks:
    """A captured non-streamed answer, as the single chunk of a stream."""
    answer = json.loads(path.read_text())
    [choice] = answer["choices"]
    chunk = {"id": answer["id"], "object": "chat.completion.chunk",
             "created": answer["created"], "model": answer["model"],
             "choices": [{"index": 0, "delta": choice["message"],
                          "finish_reason": choice["finish_reason"]}]}
    if "usage" in answer:
        chunk["usage"] = answer["usage"]
    return SSEChunks([chunk])


def _ask(text: str = "What is the price of BTC/USDT right now?") -> ModelRequestSpec:
    return ModelRequestSpec("You are a trading desk assistant.", [Message.user_text(text)],
                            [TICKER_TOOL])


@pytest.fixture
async def backend(scripted_server: ScriptedServer) -> AsyncIterator[OpenAICompatibleBackend]:
    config = OpenAIBackendConfig(base_url=scripted_server.base_url, model=MODEL,
                                 context_window=2048, request_timeout=5.0)
    async with OpenAICompatibleBackend(config) as backend:
        yield backend


# --------------------------------------------------------------------------- usage


async def test_a_stream_without_usage_is_estimated(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(RawSSE(_capture(CHATML / "chat_text.sse")))
    request = _ask("Say hello.")

    reply = await backend.complete(request)

    assert (reply.text, reply.stop_reason) == ("Say hello.", "stop")
    assert reply.usage.estimated
    assert reply.usage.input_tokens >= estimate_tokens(request.messages[0]) > 0
    assert reply.usage.output_tokens == len("Say hello.") // 4


async def test_usage_on_the_finishing_chunk_is_taken_as_reported(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(RawSSE(_capture(OURS / "chat_text.sse")))

    reply = await backend.complete(_ask("Say hello."))

    assert reply.usage == Usage(26, 3, estimated=False)


# --------------------------------------------------------------------------- tool calls


async def test_tool_call_ids_in_the_servers_shape_are_kept_and_sent_back(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    # Every delta repeats the id and the whole name, beside a legacy function_call delta.
    scripted_server.add(RawSSE(_capture(CHATML / "tool_call_forced.sse")),
                        RawSSE(_capture(OURS / "after_tool_result.sse")))
    call_id = "call__0_get_ticker_cmpl-9e7ed1c0-5523-4281-bc6c-37971cd14e83"

    reply = await backend.complete(_ask())

    [call] = reply.tool_calls
    assert (call.id, call.name) == (call_id, "get_ticker")
    assert json.loads(call.arguments) == {"symbol": "BTC/USDT"}
    assert reply.stop_reason == "tool_calls"

    first = _ask()
    await backend.complete(ModelRequestSpec(first.system_prompt, [
        *first.messages,
        Message(role="assistant", content=reply.content),
        Message(role="user", kind="tool_results", content=(
            ToolResultBlock(call.id, (TextBlock("last 16,612.5"),)),)),
    ], first.tools))

    sent = scripted_server.requests[1].messages
    assert [c["id"] for c in sent[-2]["tool_calls"]] == [call_id]
    assert sent[-1] == {"role": "tool", "tool_call_id": call_id, "content": "last 16,612.5"}


@pytest.mark.parametrize("capture", ["tool_call_auto.json", "tool_call_forced.json"])
async def test_a_legacy_function_call_beside_tool_calls_is_not_a_second_call(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer, capture: str) -> None:
    # "auto": the legacy field's name is "" ; forced: it repeats the call whole.
    legacy = json.loads((CHATML / capture).read_text())["choices"][0]["message"]
    assert legacy["function_call"]["name"] in ("", "get_ticker")
    scripted_server.add(_as_one_chunk(CHATML / capture))

    reply = await backend.complete(_ask())

    [call] = reply.tool_calls
    assert call == ToolUseBlock(legacy["tool_calls"][0]["id"], "get_ticker",
                                '{"symbol": "BTC/USDT"}')
    assert reply.text == ""
    assert reply.usage == Usage(256, 9, estimated=False)


async def test_our_formats_tool_call_streams_whole(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(RawSSE(_capture(OURS / "tool_call.sse")))

    reply = await backend.complete(_ask())

    assert reply.tool_calls == [ToolUseBlock("call_f120ca46853b4b86b9e89539", "get_ticker",
                                             '{"symbol": "BTC/USDT"}')]
    assert reply.usage == Usage(179, 18, estimated=False)


# --------------------------------------------------------------------------- too long


@pytest.mark.parametrize("folder", [OURS, CHATML], ids=lambda folder: folder.name)
async def test_the_400_for_a_too_long_prompt_is_a_context_overflow(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer, folder: Path) -> None:
    scripted_server.add(RawJSON(400, _capture(folder / "context_overflow.json")))

    with pytest.raises(ContextOverflowError) as caught:
        await backend.complete(_ask())

    assert caught.value.status_code == 400
    assert caught.value.model == MODEL
    assert "maximum context length is 2048 tokens" in str(caught.value)


async def test_an_overflow_inside_a_200_stream_is_a_context_overflow(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(RawSSE(_capture(OURS / "context_overflow.sse")))

    with pytest.raises(ContextOverflowError, match="resulted in 2124 tokens"):
        await backend.complete(_ask())


async def test_an_empty_200_body_is_an_overflow_only_for_a_prompt_near_the_window(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    empty = _capture(CHATML / "context_overflow.sse")
    assert empty == ""
    scripted_server.add(RawSSE(empty), RawSSE(empty))

    with pytest.raises(ContextOverflowError, match="empty answer"):
        await backend.complete(_ask("price " * 1400))  # ~2100 tokens by estimate
    with pytest.raises(TransientBackendError):
        await backend.complete(_ask())


# --------------------------------------------------------------------------- the stream


async def test_a_keepalive_comment_before_the_first_event_is_skipped(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    ping = ": ping - 2026-11-30 00:31:25.212066+00:00\n\n"
    scripted_server.add(RawSSE(ping + _capture(OURS / "chat_text.sse"), chunk_delay=0.01))
    deltas: list[str] = []

    reply = await backend.complete(_ask("Say hello."), on_text=deltas.append)

    assert reply.text == "".join(deltas) != ""
    assert reply.usage == Usage(26, 3, estimated=False)


async def test_an_empty_answer_is_an_empty_reply_not_an_error(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(RawSSE(_capture(OURS / "after_tool_result.sse")))

    reply = await backend.complete(_ask())

    assert (reply.text, reply.tool_calls, reply.stop_reason) == ("", [], "stop")
    assert reply.usage == Usage(143, 0, estimated=False)
