"""The native Anthropic backend, against the scripted Anthropic server over real HTTP on
loopback: what is sent (blocks, alternation, cache breakpoints, thinking), what is read back
(text, tool calls, usage and cost), and how every failure is mapped."""

from __future__ import annotations

import base64
import gc
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from tests.agent.test_shared_messages import shared_as_a_window_sends
from tests.scripted_anthropic_server import (
    Answer,
    AnthropicScriptedServer,
    Events,
    HttpError,
    RawJSON,
    RawSSE,
    Reply,
    StreamError,
    ToolCall,
    dropped_stream,
    forbidden,
    overloaded,
    prompt_too_long,
    rate_limited,
    server_error,
    unauthorized,
)
from tests.scripted_server import RecordedRequest, slow
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
from trading_agent.agent.backend import ModelRequestSpec, Usage
from trading_agent.agent.conversation import (
    ImageBlock,
    Message,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trading_agent.backends import anthropic
from trading_agent.backends.anthropic import (
    THINKING_SOURCE,
    AnthropicBackend,
    AnthropicBackendConfig,
    encode_message,
)
from trading_agent.errors import (
    BackendError,
    ConfigError,
    ContextOverflowError,
    TransientBackendError,
)

MODEL = "claude-test"
KEY = "sk-ant-test-very-secret-0123456789"
ENVIRON = {"ANTHROPIC_API_KEY": KEY}
EPHEMERAL = {"type": "ephemeral"}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_ticker", "description": "Last price of a market.",
        "parameters": {"type": "object", "properties": {"symbol": {"type": "string"}},
                       "required": ["symbol"]}}},
    {"type": "function", "function": {
        "name": "chart", "description": "A price chart.",
        "parameters": {"type": "object", "properties": {"symbol": {"type": "string"}}}}},
]

OTHER_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {**TOOLS[0]["function"],
                                      "description": "Last price of another market."}}]
"""Another desk's tools (definitions of its own, as each desk's registry builds them)."""


def make_config(server: AnthropicScriptedServer, **overrides: Any) -> AnthropicBackendConfig:
    settings: dict[str, Any] = {"base_url": server.base_url, "model": MODEL,
                                "context_window": 200_000, "request_timeout": 5.0}
    settings.update(overrides)
    return AnthropicBackendConfig(**settings)


def ask(text: str = "What is BTC doing?", *, tools: list[dict[str, Any]] | None = None,
        system: str = "You run a trading desk.") -> ModelRequestSpec:
    return ModelRequestSpec(system_prompt=system, messages=[Message.user_text(text)],
                            tools=tools if tools is not None else TOOLS)


@pytest.fixture
def server() -> Iterator[AnthropicScriptedServer]:
    scripted = AnthropicScriptedServer()
    scripted.start()
    try:
        yield scripted
        if scripted.errors:
            pytest.fail(f"the scripted server failed: {scripted.errors!r}")
    finally:
        scripted.stop()


@pytest.fixture
async def backend(server: AnthropicScriptedServer) -> AsyncIterator[AnthropicBackend]:
    async with AnthropicBackend(make_config(server), environ=ENVIRON) as created:
        yield created


def breakpoints(value: Any) -> list[str]:
    """Where ``cache_control`` is, as paths into the request body."""
    found: list[str] = []

    def walk(item: Any, path: str) -> None:
        if isinstance(item, dict):
            if "cache_control" in item:
                found.append(path)
            for key, inner in item.items():
                walk(inner, f"{path}.{key}" if path else key)
        elif isinstance(item, list):
            for index, inner in enumerate(item):
                walk(inner, f"{path}[{index}]")

    walk(value, "")
    return found


# --------------------------------------------------------------------------- answers


async def test_text_streams_each_delta_in_order(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    server.add(Reply(["BTC ", "is ", "at ", "64,000."]))
    deltas: list[str] = []

    reply = await backend.complete(ask(), on_text=deltas.append)

    assert deltas == ["BTC ", "is ", "at ", "64,000."]
    assert reply.content == (TextBlock("BTC is at 64,000."),)
    assert (reply.stop_reason, reply.tool_calls) == ("stop", [])
    sent = server.requests[0]
    assert sent.path == "/v1/messages"
    assert sent.headers["x-api-key"] == KEY
    assert sent.headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in sent.headers
    assert (sent.json["model"], sent.json["stream"], sent.json["max_tokens"]) == (
        MODEL, True, 4096)
    assert sent.json["system"] == [{"type": "text", "text": "You run a trading desk.",
                                    "cache_control": EPHEMERAL}]
    assert "thinking" not in sent.json and "temperature" not in sent.json
    server.assert_complete()


async def test_tool_calls_are_assembled_with_their_text(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    server.add(Reply("Checking two markets.", tool_calls=[
        ToolCall("get_ticker", {"symbol": "BTC/USDT", "depth": 5}, id="toolu_btc",
                 argument_chunks=4),
        ToolCall("get_ticker", {}, id="toolu_eth")]))

    reply = await backend.complete(ask())

    assert reply.content == (
        TextBlock("Checking two markets."),
        ToolUseBlock("toolu_btc", "get_ticker", '{"symbol": "BTC/USDT", "depth": 5}'),
        ToolUseBlock("toolu_eth", "get_ticker", "{}"))
    assert reply.stop_reason == "tool_calls"


@pytest.mark.parametrize(("sent", "reported"), [
    ("end_turn", "stop"), ("tool_use", "tool_calls"), ("max_tokens", "length"),
    ("stop_sequence", "stop_sequence"), ("refusal", "refusal"), ("pause_turn", "pause_turn"),
])
async def test_stop_reasons_are_mapped(
        backend: AnthropicBackend, server: AnthropicScriptedServer, sent: str,
        reported: str) -> None:
    server.add(Reply("The market is", finish_reason=sent))

    reply = await backend.complete(ask())

    assert (reply.text, reply.stop_reason) == ("The market is", reported)


async def test_pings_unknown_events_and_a_start_with_text_are_read(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    server.add(Events([
        {"type": "message_start", "message": {"usage": {"input_tokens": 7, "output_tokens": 1}}},
        {"type": "ping"},
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "text", "text": "Hel"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta",
                                                              "text": "lo"}},
        {"type": "something_new", "index": 0},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
         "usage": {"output_tokens": 3}},
        {"type": "message_stop"},
    ]))
    deltas: list[str] = []

    reply = await backend.complete(ask(), on_text=deltas.append)

    assert (reply.text, deltas) == ("Hello", ["Hel", "lo"])
    assert reply.usage == Usage(7, 3)


# --------------------------------------------------------------------------- what is sent


async def test_a_tool_round_trip_is_sent_back_as_anthropic_blocks(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    chart = ImageBlock(b"\x89PNG-chart", "image/png", "BTC 1h chart")
    server.add(
        Reply("Let me look.", tool_calls=[
            ToolCall("get_ticker", {"symbol": "BTC/USDT"}, id="toolu_1", argument_chunks=3),
            ToolCall("chart", {"symbol": "BTC/USDT"}, id="toolu_2"),
            ToolCall("get_ticker", "{oops", id="toolu_3")]),
        Reply("BTC is at 64,000."))
    trigger = Message.user_text("Tick: BTC moved 2%.")
    first = await backend.complete(ModelRequestSpec("s", [trigger], TOOLS))
    answer = Message(role="assistant", content=first.content)
    results = Message(role="user", kind="tool_results", content=(
        ToolResultBlock("toolu_1", (TextBlock("last 64000"),)),
        ToolResultBlock("toolu_2", (TextBlock("chart ready"), chart)),
        ToolResultBlock("toolu_3", (TextBlock("bad arguments"),), is_error=True)))
    steering = Message.user_text("Also check ETH.", kind="steering")

    await backend.complete(ModelRequestSpec("s", [trigger, answer, results, steering], TOOLS))

    messages = server.requests[1].messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_ticker",
         "input": {"symbol": "BTC/USDT"}},
        {"type": "tool_use", "id": "toolu_2", "name": "chart", "input": {"symbol": "BTC/USDT"}},
        {"type": "tool_use", "id": "toolu_3", "name": "get_ticker",
         "input": {"raw_arguments": "{oops"}}]
    assert messages[2]["content"] == [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "last 64000"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": [
            {"type": "text", "text": "chart ready"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(chart.data).decode()}}]},
        {"type": "tool_result", "tool_use_id": "toolu_3", "content": "bad arguments",
         "is_error": True},
        {"type": "text", "text": "Also check ETH.", "cache_control": EPHEMERAL}]
    server.assert_complete()


async def test_roles_alternate_and_blank_blocks_are_left_out(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    photo = ImageBlock(b"\xff\xd8jpeg", "image/jpeg")
    messages = [
        Message(role="assistant", content=(TextBlock("An answer from before."),)),
        Message(role="assistant", content=(TextBlock("   "),)),  # blank: nothing to send
        Message(role="user", kind="summary", content=(TextBlock("Summary so far."),)),
        Message(role="user", kind="operator", content=(TextBlock(""), photo)),
        Message(role="user", kind="notice", content=(TextBlock("\n"),)),
    ]
    server.add(Reply("ok"))

    await backend.complete(ModelRequestSpec("", messages, []))

    sent = server.requests[0].json
    assert "system" not in sent and "tools" not in sent
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "user"]
    assert sent["messages"][0]["content"] == [{"type": "text",
                                               "text": "(earlier messages omitted)"}]
    assert sent["messages"][2]["content"] == [
        {"type": "text", "text": "Summary so far."},
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                     "data": base64.b64encode(photo.data).decode()},
         "cache_control": EPHEMERAL}]


async def test_tools_go_out_in_anthropic_shape(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    native = {"name": "memory", "input_schema": {"type": "object", "properties": {}}}
    server.add(Reply("ok"))

    await backend.complete(ask(tools=[*TOOLS, native]))

    assert server.requests[0].tools == [
        {"name": "get_ticker", "description": "Last price of a market.",
         "input_schema": TOOLS[0]["function"]["parameters"]},
        {"name": "chart", "description": "A price chart.",
         "input_schema": TOOLS[1]["function"]["parameters"]},
        {**native, "cache_control": EPHEMERAL}]


async def test_settings_shape_the_request(server: AnthropicScriptedServer) -> None:
    config = make_config(server, max_output_tokens=1000, temperature=0.2,
                         anthropic_version="2099-01-01",
                         extra_headers={"anthropic-beta": "some-feature"},
                         base_url=server.base_url + "/v1/")
    server.add(Reply("a"), Reply("b"))

    async with AnthropicBackend(config, environ=ENVIRON) as backend:
        await backend.complete(ask())
        await backend.complete(ModelRequestSpec("s", [Message.user_text("x")], [],
                                                max_output_tokens=64))

    first, second = server.requests
    assert first.path == "/v1/messages"
    assert (first.json["max_tokens"], first.json["temperature"]) == (1000, 0.2)
    assert second.json["max_tokens"] == 64
    assert first.headers["anthropic-version"] == "2099-01-01"
    assert first.headers["anthropic-beta"] == "some-feature"


async def test_unicode_and_broken_surrogates_still_make_valid_json(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    server.add(Reply("ok"), Reply("ok"))

    await backend.complete(ask("Prix : 64 000 € 🚀, 比特币"))
    await backend.complete(ask("a lone surrogate \ud83d from a broken stream"))

    assert server.requests[0].messages[0]["content"][0]["text"] == "Prix : 64 000 € 🚀, 比特币"
    assert "€".encode() in server.requests[0].body
    assert server.requests[1].messages[0]["content"][0]["text"] == (
        "a lone surrogate \ud83d from a broken stream")


@given(st.lists(st.text(st.characters(codec=None, exclude_categories=())).filter(str.strip),
                min_size=1, max_size=4))
def test_every_encoding_is_valid_json_of_the_wire_blocks(texts: list[str]) -> None:
    message = Message(role="user", kind="tool_results", content=tuple(
        ToolResultBlock(f"call.{i}", (TextBlock(text),)) for i, text in enumerate(texts)))

    wire = encode_message(message)

    assert wire.role == "user"
    assert json.loads(wire.whole)["content"] == json.loads(b"[" + wire.blocks + b"]")
    assert json.loads(b"[" + wire.blocks + b"]") == [
        {"type": "tool_result", "tool_use_id": f"call_{i}", "content": text}
        for i, text in enumerate(texts)]


# --------------------------------------------------------------------------- prompt caching


async def test_cache_breakpoints_sit_on_tools_system_and_the_newest_message(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    history = [Message.user_text("tick 1"), Message(role="assistant",
                                                    content=(TextBlock("noted"),)),
               Message.user_text("tick 2")]
    server.add(Reply("a"), Reply("b"))

    await backend.complete(ModelRequestSpec("system", history, TOOLS))
    later = [*history, Message(role="assistant", content=(TextBlock("noted again"),)),
             Message.user_text("tick 3")]
    await backend.complete(ModelRequestSpec("system", later, TOOLS))

    first, second = (request.json for request in server.requests)
    assert breakpoints(first) == ["system[0]", "tools[1]", "messages[2].content[0]"]
    assert breakpoints(second) == ["system[0]", "tools[1]", "messages[4].content[0]"]
    assert len(breakpoints(second)) <= 4
    # The old newest message goes out as it was before it was the newest.
    assert second["messages"][2] == {"role": "user",
                                     "content": [{"type": "text", "text": "tick 2"}]}


async def test_cached_tokens_are_counted_and_priced_at_their_own_prices(
        server: AnthropicScriptedServer) -> None:
    server.add(Answer("ok", usage=(100, 50), cached_tokens=9000, cache_creation_tokens=500),
               Answer("ok", usage=(100, 50), cached_tokens=9000, cache_creation_tokens=500))
    priced = make_config(server, price_input_per_million=3.0, price_output_per_million=15.0,
                         price_cache_read_per_million=0.3, price_cache_write_per_million=3.75)

    async with AnthropicBackend(priced, environ=ENVIRON) as backend:
        reply = await backend.complete(ask())
    async with AnthropicBackend(make_config(server, price_input_per_million=3.0,
                                            price_output_per_million=15.0),
                                environ=ENVIRON) as backend:
        plain = await backend.complete(ask())

    assert reply.usage == Usage(
        input_tokens=9600, output_tokens=50, estimated=False, cached_input_tokens=9000,
        cost=(100 * 3.0 + 9000 * 0.3 + 500 * 3.75 + 50 * 15.0) / 1e6)
    assert plain.usage.cost == pytest.approx((9600 * 3.0 + 50 * 15.0) / 1e6)
    assert reply.usage.cached_input_tokens / reply.usage.input_tokens == pytest.approx(0.9375)


async def test_usage_is_estimated_when_the_server_reports_none(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    server.add(Reply("x" * 400, usage=None))

    reply = await backend.complete(ask("y" * 2000))

    assert reply.usage.estimated
    assert reply.usage.output_tokens == 100
    assert reply.usage.input_tokens > 500
    assert reply.usage.cost is None


async def test_each_message_is_encoded_once_and_bodies_are_reused(
        backend: AnthropicBackend, server: AnthropicScriptedServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    encoded: list[str] = []
    real = anthropic._wire_message

    def counting(message: Message) -> tuple[bytes, bytes]:
        encoded.append(message.id)
        return real(message)

    monkeypatch.setattr(anthropic, "_wire_message", counting)
    messages = [Message.user_text(f"tick {i}") if i % 2 == 0 else
                Message(role="assistant", content=(TextBlock(f"answer {i}"),))
                for i in range(51)]
    request = ModelRequestSpec("system", messages, TOOLS)
    server.add(Reply("a"), Reply("b"), Reply("c"))

    await backend.complete(request)
    await backend.complete(request)
    newest = Message.user_text("tick 51")
    # A new message is encoded alone; every older one is spliced from its cached bytes.
    await backend.complete(ModelRequestSpec("system", [*messages, newest], TOOLS))

    assert encoded == [m.id for m in messages] + [newest.id]
    assert all(encode_message(m).whole is m.cache["anthropic_wire"][1] for m in messages)
    gc.collect()  # the kept encodings give the collector nothing more to walk
    assert not any(gc.is_tracked(m.cache) for m in messages)
    first, second, third = server.requests
    assert first.body == second.body
    # The third body starts as the second did, up to the old newest message's breakpoint.
    shared = second.body.index(b',"cache_control"', second.body.index(b"tick 50"))
    assert third.body[:shared] == second.body[:shared]
    assert b"cache_control" not in encode_message(messages[-1]).whole


async def test_an_answer_of_text_alone_goes_as_a_string_but_carries_a_breakpoint_as_a_list(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    def answer(text: str) -> Message:
        return Message(role="assistant", content=(TextBlock(text),))

    messages = [Message.user_text("tick 1"), answer("No trade."), Message.user_text("tick 2"),
                answer("One."), answer("Two."), Message.user_text("tick 3"), answer("Last.")]
    server.add(Reply("a"), Reply("b"))

    await backend.complete(ModelRequestSpec("system", messages, TOOLS))
    await backend.complete(ModelRequestSpec("system", [*messages, Message.user_text("t")], TOOLS))

    first, second = (request.json["messages"] for request in server.requests)
    assert first[1]["content"] == "No trade."  # the API's short form
    # Two answers in a row are one wire message: blocks, as before.
    assert first[3]["content"] == [{"type": "text", "text": "One."},
                                   {"type": "text", "text": "Two."}]
    # The newest message carries the breakpoint, which only a block can.
    assert first[5]["content"] == [{"type": "text", "text": "Last.",
                                    "cache_control": {"type": "ephemeral"}}]
    assert second[5]["content"] == "Last."
    assert second[:5] == first[:5]


# --------------------------------------------------------------------------- thinking


async def test_thinking_is_streamed_kept_and_sent_back_within_the_turn(
        server: AnthropicScriptedServer) -> None:
    config = make_config(server, max_output_tokens=8192, thinking_budget_tokens=2048)
    server.add(
        Answer("Let me look.", thinking=["The move is ", "small; check the book."],
               signature="sig-abc", redacted_thinking="opaque-bytes",
               tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"}, id="toolu_t1")]),
        Answer("No trade.", thinking="Nothing to do."))
    thoughts: list[str] = []
    async with AnthropicBackend(config, environ=ENVIRON) as backend:
        trigger = Message.user_text("Tick.")
        first = await backend.complete(ModelRequestSpec("s", [trigger], TOOLS),
                                       on_thinking=thoughts.append)
        answer = Message(role="assistant", content=first.content)
        results = Message(role="user", kind="tool_results", content=(
            ToolResultBlock("toolu_t1", (TextBlock("last 64000"),)),))
        second = await backend.complete(ModelRequestSpec("s", [trigger, answer, results],
                                                         TOOLS, max_output_tokens=500),
                                        on_thinking=thoughts.append)

    assert thoughts == ["The move is ", "small; check the book.", "Nothing to do."]
    # The answer carries its thinking, first, for the conversation (and the store) to keep.
    assert first.content == (
        ThinkingBlock("The move is small; check the book.", "sig-abc", THINKING_SOURCE),
        ThinkingBlock("", source=THINKING_SOURCE, redacted="opaque-bytes"),
        TextBlock("Let me look."),
        ToolUseBlock("toolu_t1", "get_ticker", '{"symbol": "BTC/USDT"}'))
    assert first.text == "Let me look."
    assert second.text == "No trade."
    assert second.content == (TextBlock("No trade."),)  # no call: nothing to send back
    sent_first, sent_second = (request.json for request in server.requests)
    assert sent_first["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert sent_second["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert sent_second["max_tokens"] == 500 + 2048  # the request's cap is for the answer
    assert sent_second["messages"][1]["content"] == [
        {"type": "thinking", "thinking": "The move is small; check the book.",
         "signature": "sig-abc"},
        {"type": "redacted_thinking", "data": "opaque-bytes"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_t1", "name": "get_ticker",
         "input": {"symbol": "BTC/USDT"}}]
    assert breakpoints(sent_second)[-1] == "messages[2].content[0]"


async def test_a_tool_loop_whose_thinking_is_lost_goes_on_without_thinking(
        server: AnthropicScriptedServer) -> None:
    # A restart mid-turn: the new backend never saw the thinking of the call it continues.
    config = make_config(server, max_output_tokens=8192, thinking_budget_tokens=2048)
    call = Message(role="assistant", content=(ToolUseBlock("toolu_old", "get_ticker", "{}"),))
    result = Message(role="user", kind="tool_results",
                     content=(ToolResultBlock("toolu_old", (TextBlock("64000"),)),))
    done = Message(role="assistant", content=(TextBlock("No trade."),))
    server.add(Reply("ok"), Reply("ok"))

    async with AnthropicBackend(config, environ=ENVIRON) as backend:
        await backend.complete(ModelRequestSpec("s", [Message.user_text("t"), call, result],
                                                TOOLS))
        await backend.complete(ModelRequestSpec(
            "s", [Message.user_text("t"), call, result, done, Message.user_text("t2")], TOOLS))

    continued, fresh_turn = (request.json for request in server.requests)
    assert "thinking" not in continued
    assert fresh_turn["thinking"] == {"type": "enabled", "budget_tokens": 2048}


async def test_another_providers_thinking_is_never_sent(
        server: AnthropicScriptedServer) -> None:
    # The desk's provider changed on reload: the tool loop it continues thought elsewhere.
    config = make_config(server, max_output_tokens=8192, thinking_budget_tokens=2048)
    call = Message(role="assistant", content=(
        ThinkingBlock("elsewhere", "their-signature", "another-provider"),
        ToolUseBlock("toolu_old", "get_ticker", "{}")))
    result = Message(role="user", kind="tool_results",
                     content=(ToolResultBlock("toolu_old", (TextBlock("64000"),)),))
    server.add(Reply("ok"))

    async with AnthropicBackend(config, environ=ENVIRON) as backend:
        await backend.complete(ModelRequestSpec("s", [Message.user_text("t"), call, result],
                                                TOOLS))

    [sent] = server.requests
    assert "thinking" not in sent.json  # a tool loop without thinking of its own goes without
    assert "elsewhere" not in sent.body.decode() and "their-signature" not in sent.body.decode()
    assert [b["type"] for b in sent.messages[1]["content"]] == ["tool_use"]


async def test_thinking_is_never_sent_by_a_backend_without_it(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    server.add(Answer("ok", thinking="hmm", tool_calls=[ToolCall("get_ticker", id="toolu_x")]),
               Reply("done"))
    trigger = Message.user_text("t")
    first = await backend.complete(ModelRequestSpec("s", [trigger], TOOLS))
    results = Message(role="user", kind="tool_results",
                      content=(ToolResultBlock("toolu_x", (TextBlock("1"),)),))

    await backend.complete(ModelRequestSpec(
        "s", [trigger, Message(role="assistant", content=first.content), results], TOOLS))

    assert "thinking" not in server.requests[1].json
    assert [b["type"] for b in server.requests[1].messages[1]["content"]] == [
        "text", "tool_use"]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("step", "status", "retry_after"), [
    (rate_limited(retry_after=2), 429, 2.0),
    (rate_limited(retry_after=None), 429, None),
    (overloaded(), 529, None),
    (overloaded(retry_after=5), 529, 5.0),
    (server_error(500), 500, None),
    (server_error(502, "bad gateway"), 502, None),
    (server_error(503), 503, None),
    (server_error(504), 504, None),
    (HttpError(408, "request timeout", "timeout_error"), 408, None),
    (HttpError(409, "conflict", "api_error"), 409, None),
])
async def test_retryable_refusals_are_transient(
        backend: AnthropicBackend, server: AnthropicScriptedServer, step: HttpError,
        status: int, retry_after: float | None) -> None:
    server.add(step)

    with pytest.raises(TransientBackendError) as caught:
        await backend.complete(ask())

    assert (caught.value.status_code, caught.value.retry_after) == (status, retry_after)
    assert step.message in str(caught.value)
    assert "req_scripted_" in str(caught.value)  # the request id, for Anthropic's support
    assert MODEL in str(caught.value)


async def test_retry_after_as_an_http_date(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    when = datetime.now(UTC) + timedelta(seconds=30)
    server.add(rate_limited(retry_after=format_datetime(when, usegmt=True)))

    with pytest.raises(TransientBackendError) as caught:
        await backend.complete(ask())

    assert caught.value.retry_after is not None
    assert 25 <= caught.value.retry_after <= 31


@pytest.mark.parametrize("step", [
    prompt_too_long(),
    HttpError(400, "input length and `max_tokens` exceed context limit: 198000 + 4096 > "
              "200000, decrease input length or `max_tokens` and try again",
              "invalid_request_error"),
    HttpError(413, "Request exceeds the maximum allowed number of bytes.",
              "request_too_large"),
])
async def test_a_too_long_prompt_is_a_context_overflow(
        backend: AnthropicBackend, server: AnthropicScriptedServer, step: HttpError) -> None:
    server.add(step)

    with pytest.raises(ContextOverflowError) as caught:
        await backend.complete(ask())

    assert caught.value.status_code == step.status
    assert caught.value.model == MODEL


@pytest.mark.parametrize("step", [unauthorized(), forbidden()])
async def test_a_refused_key_names_its_variable(
        server: AnthropicScriptedServer, step: HttpError) -> None:
    server.add(step)
    config = make_config(server, api_key_env="DESK_CLAUDE_KEY")

    async with AnthropicBackend(config, environ={"DESK_CLAUDE_KEY": KEY}) as backend:
        with pytest.raises(BackendError) as caught:
            await backend.complete(ask())

    assert type(caught.value) is BackendError
    assert caught.value.status_code == step.status
    assert "DESK_CLAUDE_KEY" in str(caught.value)
    assert step.message in str(caught.value)


@pytest.mark.parametrize(("step", "status", "words"), [
    (HttpError(404, "model: claude-nope", "not_found_error"), 404, "claude-nope"),
    (HttpError(400, "temperature: range: 0..1", "invalid_request_error"), 400, "temperature"),
    (RawJSON(422, "unprocessable: bad tools"), 422, "bad tools"),
])
async def test_other_refusals_are_plain_backend_errors(
        backend: AnthropicBackend, server: AnthropicScriptedServer, step: Any, status: int,
        words: str) -> None:
    server.add(step)

    with pytest.raises(BackendError) as caught:
        await backend.complete(ask())

    assert type(caught.value) is BackendError
    assert caught.value.status_code == status
    assert words in str(caught.value)


async def test_a_dropped_stream_is_transient_and_the_backend_recovers(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    server.add(dropped_stream("This answer will be cut short", after_events=4),
               Reply("Second try works."))
    deltas: list[str] = []

    with pytest.raises(TransientBackendError) as caught:
        await backend.complete(ask(), on_text=deltas.append)

    assert caught.value.status_code is None
    assert deltas  # some text had streamed before the cut...
    assert (await backend.complete(ask())).text == "Second try works."  # ...on a new connection
    assert server.connections == 2


async def test_a_stream_that_ends_before_message_stop_is_transient(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    server.add(Events([
        {"type": "message_start", "message": {"usage": {"input_tokens": 5}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text",
                                                                      "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta",
                                                              "text": "All done."}},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
         "usage": {"output_tokens": 3}},
    ]))

    with pytest.raises(TransientBackendError, match="ended before"):
        await backend.complete(ask())


@pytest.mark.parametrize(("step", "expected"), [
    (StreamError("overloaded_error", "Overloaded"), TransientBackendError),
    (StreamError("api_error", "Internal server error"), TransientBackendError),
    (StreamError("invalid_request_error", "prompt is too long: 201000 tokens > 200000 maximum"),
     ContextOverflowError),
    (StreamError("invalid_request_error", "messages: roles must alternate"), BackendError),
])
async def test_an_error_event_mid_stream_is_translated(
        backend: AnthropicBackend, server: AnthropicScriptedServer, step: StreamError,
        expected: type[BackendError]) -> None:
    server.add(step, Reply("after"))
    deltas: list[str] = []

    with pytest.raises(BackendError) as caught:
        await backend.complete(ask(), on_text=deltas.append)

    assert type(caught.value) is expected
    assert step.message in str(caught.value)
    assert deltas == [step.text]
    assert (await backend.complete(ask())).text == "after"


async def test_an_unreadable_event_is_transient(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    server.add(RawSSE("event: message_start\ndata: {not json\n\n"))

    with pytest.raises(TransientBackendError, match="unreadable"):
        await backend.complete(ask())


async def test_a_slow_server_times_out_as_transient(server: AnthropicScriptedServer) -> None:
    server.add(slow(5.0))
    started = time.monotonic()

    async with AnthropicBackend(make_config(server, request_timeout=0.3),
                                environ=ENVIRON) as backend:
        with pytest.raises(TransientBackendError, match=r"did not answer within 0\.3 s") as caught:
            await backend.complete(ask())

    assert caught.value.status_code is None
    assert time.monotonic() - started < 3


async def test_a_refused_connection_is_transient() -> None:
    with socket.socket() as probe:  # a loopback port with nobody listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = AnthropicBackendConfig(base_url=f"http://127.0.0.1:{port}", model=MODEL,
                                    context_window=1000, request_timeout=2)

    async with AnthropicBackend(config, environ=ENVIRON) as backend:
        with pytest.raises(TransientBackendError, match="connection") as caught:
            await backend.complete(ask())

    assert caught.value.status_code is None


async def test_a_cancelled_request_leaves_the_backend_usable(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    server.add(Reply("slowly " * 10, text_chunks=10, chunk_delay=0.2), Reply("next"))
    deltas: list[str] = []

    with anyio.CancelScope() as scope:

        def stop_after_first(text: str) -> None:
            deltas.append(text)
            scope.cancel()

        await backend.complete(ask(), on_text=stop_after_first)

    assert scope.cancelled_caught
    assert deltas == ["slowly "]
    assert (await backend.complete(ask())).text == "next"


# --------------------------------------------------------------------------- the key


def _traceback_chain(exc: BaseException | None) -> list[BaseException]:
    """The exceptions a traceback of ``exc`` would print."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return chain


@pytest.mark.parametrize("status", [401, 429, 400, 500, None])
async def test_the_api_key_is_sent_but_never_shown(
        server: AnthropicScriptedServer, status: int | None) -> None:
    def echo_key(request: RecordedRequest) -> Any:
        # Some servers quote the key they were given in their error message.
        quoted = f"key {request.headers['x-api-key']} refused"
        if status is None:
            return StreamError("api_error", quoted)
        kind = {401: "authentication_error", 429: "rate_limit_error",
                400: "invalid_request_error", 500: "api_error"}[status]
        return HttpError(status, quoted, kind)

    server.responder = echo_key
    config = make_config(server)
    async with AnthropicBackend(config, environ=ENVIRON) as backend:
        with pytest.raises(BackendError) as caught:
            await backend.complete(ask())
        shown = [str(caught.value), repr(caught.value), caught.value.message, repr(backend),
                 repr(config), config.model_dump_json()]

    assert server.requests[0].headers["x-api-key"] == KEY
    assert "[redacted] refused" in str(caught.value)
    assert not [text for text in shown if KEY in text]
    assert not [e for e in _traceback_chain(caught.value) if KEY in str(e)]


async def test_a_missing_key_variable_is_a_config_error(server: AnthropicScriptedServer) -> None:
    with pytest.raises(ConfigError, match="ANTHROPIC_API_KEY"):
        AnthropicBackend(make_config(server), environ={})


async def test_a_server_needing_no_key_gets_none(server: AnthropicScriptedServer) -> None:
    server.add(Reply("ok"), unauthorized())

    async with AnthropicBackend(make_config(server, api_key_env=None), environ={}) as backend:
        await backend.complete(ask())
        with pytest.raises(BackendError, match="api_key_env"):
            await backend.complete(ask())

    assert "x-api-key" not in server.requests[0].headers


def test_the_config_refuses_what_the_api_would() -> None:
    base = {"model": "m", "context_window": 10}
    assert AnthropicBackendConfig(**base).base_url == "https://api.anthropic.com"
    with pytest.raises(ValueError, match="api_key"):
        AnthropicBackendConfig.model_validate({**base, "api_key": "sk-oops"})
    with pytest.raises(ValueError, match="price"):
        AnthropicBackendConfig(**base, price_input_per_million=1.0)
    with pytest.raises(ValueError, match="cache prices"):
        AnthropicBackendConfig(**base, price_cache_read_per_million=0.1)
    with pytest.raises(ValueError, match="below max_output_tokens"):
        AnthropicBackendConfig(**base, thinking_budget_tokens=4096)
    with pytest.raises(ValueError, match="greater than or equal to 1024"):
        AnthropicBackendConfig(**base, thinking_budget_tokens=100)
    with pytest.raises(ValueError, match="temperature"):
        AnthropicBackendConfig(**base, max_output_tokens=8000, thinking_budget_tokens=2000,
                               temperature=0.5)
    with pytest.raises(ValueError, match="X-Api-Key: the backend sets"):
        AnthropicBackendConfig(**base, extra_headers={"X-Api-Key": "sk-oops"})


# --------------------------------------------------------------------------- in the loop


class SymbolArguments(BaseModel):
    symbol: str


async def test_the_agent_loop_runs_a_tool_turn_over_the_anthropic_backend(
        backend: AnthropicBackend, server: AnthropicScriptedServer) -> None:
    registry = ToolRegistry()

    @registry.tool(description="Last price of a market.")
    async def get_ticker(arguments: SymbolArguments, context: ToolContext) -> str:
        return f"{arguments.symbol} last 21,034.50"

    server.add(
        Reply("Let me look.", tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"},
                                                   argument_chunks=3)], usage=(900, 20),
              cached_tokens=0),
        rate_limited(retry_after=0.5),
        Answer("BTC is at 21,034.50; no trade.", text_chunks=3, usage=(30, 12),
               cached_tokens=880, cache_creation_tokens=10))
    bus = EventBus()
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    loop = AgentLoop("alpha", backend, ToolCallExecutor(registry), bus, maximum_rounds=4)
    loop.retry_policy = RetryPolicy(sleep=sleep)
    conversation = Conversation("You run a BTC desk.")

    result = await loop.run_turn(conversation, Trigger("tick", "BTC/USDT moved 1.2%"))

    assert (result.text, result.rounds, result.hit_round_limit) == (
        "BTC is at 21,034.50; no trade.", 2, False)
    assert sleeps == [0.5]
    assert [m.kind for m in conversation.messages] == [
        "trigger", "assistant", "tool_results", "assistant"]
    sent = server.requests[2].json
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "user"]
    assert sent["messages"][1]["content"][1] == {
        "type": "tool_use", "id": "toolu_1", "name": "get_ticker",
        "input": {"symbol": "BTC/USDT"}}
    assert sent["messages"][2]["content"] == [{
        "type": "tool_result", "tool_use_id": "toolu_1",
        "content": "BTC/USDT last 21,034.50",
        "cache_control": EPHEMERAL}]
    assert sent["tools"][0]["name"] == "get_ticker" and "input_schema" in sent["tools"][0]
    assert len(breakpoints(sent)) == 3
    assert result.usage.input_tokens == 900 + 30 + 880 + 10
    assert result.usage.cached_input_tokens == 880
    server.assert_complete()


@given(st.lists(st.sampled_from(["user", "user", "assistant", "assistant", "blank", "call",
                                 "replace", "drop_first", "cut_end", "other_desk"]),
                min_size=1, max_size=14),
       st.sampled_from([None, 0, 1]))
def test_a_desks_body_joined_from_its_last_request_equals_one_built_afresh(
        steps: list[str], shared_tail: int | None) -> None:
    """Also with the messages shared as the loop's window sends them (``shared_tail`` not
    None: on one list grown in place, with that many after the shared part). The desks
    share the backend, each with a system prompt and tools of its own."""
    config = AnthropicBackendConfig(base_url="http://127.0.0.1:9", model=MODEL,
                                    context_window=200_000, api_key_env=None)
    remembering = AnthropicBackend(config)
    window: list[Message] = [Message.user_text("first")]
    base: list[Message] = []
    for number, step in enumerate(steps):
        if step == "user":
            window = [*window, Message.user_text(f"user {number}")]
        elif step == "assistant":  # runs of one role are merged into one wire message
            window = [*window, Message(role="assistant", content=(TextBlock(f"a {number}"),))]
        elif step == "blank":  # nothing the API takes: left out
            window = [*window, Message(role="assistant", content=(TextBlock(" "),))]
        elif step == "call":
            call = ToolUseBlock(f"call_{number}", "get_ticker", '{"symbol": "BTC/USDT"}')
            window = [*window, Message(role="assistant", content=(TextBlock("Looking."), call)),
                      Message(role="user", kind="tool_results", content=(
                          ToolResultBlock(call.id, (TextBlock("21,034"),)),))]
        elif step == "replace" and window:  # a picture pruned in the middle
            middle = len(window) // 2
            window = [*window[:middle], Message.user_text(f"cut {number}"),
                      *window[middle + 1:]]
        elif step == "drop_first":  # a compaction: the window may start with the model's
            window = window[1:]
        elif step == "cut_end":
            window = window[:-1]
        other = step == "other_desk"
        key = "trading-agent:other" if other else "trading-agent:desk"
        sent: Sequence[Message] = window
        if shared_tail is not None:
            sent, base = shared_as_a_window_sends(window, base, shared_tail)
        request = ModelRequestSpec("other system" if other else "system", sent,
                                   OTHER_TOOLS if other else TOOLS, cache_key=key)

        assert remembering.request_body(request) == AnthropicBackend(config).request_body(
            request)
