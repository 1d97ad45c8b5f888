"""The OpenAI-compatible backend, against the scripted server over real HTTP on loopback."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.agent.test_shared_messages import shared_as_a_window_sends
from tests.scripted_server import (
    HttpError,
    RawJSON,
    RawSSE,
    Reply,
    ScriptedServer,
    SSEChunks,
    ToolCall,
    context_overflow,
    dropped_stream,
    rate_limited,
    server_error,
    slow,
    unauthorized,
)
from trading_agent.agent.backend import ModelRequestSpec, Usage
from trading_agent.agent.conversation import (
    ImageBlock,
    Message,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    estimate_tokens,
)
from trading_agent.agent.image_preparer import ImagePreparer
from trading_agent.backends import openai_compatible
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import (
    NO_KEY_PLACEHOLDER,
    OpenAICompatibleBackend,
    encode_message,
)
from trading_agent.backends.sse_transport import HttpStatusError
from trading_agent.errors import (
    BackendError,
    ConfigError,
    ContextOverflowError,
    TransientBackendError,
)

MODEL = "test-model"
TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {"name": "get_ticker", "description": "Last price of a market.",
                 "parameters": {"type": "object",
                                "properties": {"symbol": {"type": "string"}},
                                "required": ["symbol"]}},
}]

OTHER_TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {**TOOLS[0]["function"], "description": "Last price of another market."},
}]
"""Another desk's tools (definitions of its own, as each desk's registry builds them)."""


def make_config(server: ScriptedServer, **overrides: Any) -> OpenAIBackendConfig:
    settings: dict[str, Any] = {"base_url": server.base_url, "model": MODEL,
                                "context_window": 8192, "request_timeout": 5.0}
    settings.update(overrides)
    return OpenAIBackendConfig(**settings)


def ask(text: str = "What is BTC doing?", *, tools: list[dict[str, Any]] | None = None,
        system: str = "You run a trading desk.") -> ModelRequestSpec:
    return ModelRequestSpec(system_prompt=system, messages=[Message.user_text(text)],
                            tools=tools if tools is not None else TOOLS)


@pytest.fixture
async def backend(scripted_server: ScriptedServer) -> AsyncIterator[OpenAICompatibleBackend]:
    async with OpenAICompatibleBackend(make_config(scripted_server)) as backend:
        yield backend


# --------------------------------------------------------------------------- answers


async def test_text_streams_each_delta_in_order(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply(["BTC ", "is ", "at ", "64,000."]))
    deltas: list[str] = []

    reply = await backend.complete(ask(), on_text=deltas.append)

    assert deltas == ["BTC ", "is ", "at ", "64,000."]
    assert reply.text == "BTC is at 64,000."
    assert reply.content == (TextBlock("BTC is at 64,000."),)
    assert reply.tool_calls == []
    assert reply.stop_reason == "stop"
    scripted_server.assert_complete()


async def test_a_tool_call_is_assembled_from_several_deltas(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply(tool_calls=[
        ToolCall("get_ticker", {"symbol": "BTC/USDT", "depth": 5}, id="call_abc",
                 argument_chunks=5)]))

    reply = await backend.complete(ask())

    assert reply.tool_calls == [ToolUseBlock(
        "call_abc", "get_ticker", '{"symbol": "BTC/USDT", "depth": 5}')]
    assert reply.text == ""
    assert reply.stop_reason == "tool_calls"


async def test_parallel_tool_calls_keep_their_order_and_the_text(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("Checking three markets.", tool_calls=[
        ToolCall("get_ticker", {"symbol": s}, id=f"call_{s[:3]}", argument_chunks=3)
        for s in ("BTC/USDT", "ETH/USDT", "SOL/USDT")]))

    reply = await backend.complete(ask())

    assert reply.content[0] == TextBlock("Checking three markets.")
    assert [(c.id, json.loads(c.arguments)["symbol"]) for c in reply.tool_calls] == [
        ("call_BTC", "BTC/USDT"), ("call_ETH", "ETH/USDT"), ("call_SOL", "SOL/USDT")]


async def test_a_length_stop_is_reported(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("The market is", finish_reason="length"))

    reply = await backend.complete(ask())

    assert (reply.text, reply.stop_reason) == ("The market is", "length")


# --------------------------------------------------------------------------- usage and cost


async def test_reported_usage_is_used_and_priced(scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("ok", usage=(1200, 300)))
    config = make_config(scripted_server, price_input_per_million=2.0,
                         price_output_per_million=10.0)
    async with OpenAICompatibleBackend(config) as backend:
        reply = await backend.complete(ask())

    assert reply.usage == Usage(1200, 300, estimated=False, cost=(1200 * 2.0 + 300 * 10.0) / 1e6)
    assert scripted_server.requests[0].json["stream_options"] == {"include_usage": True}


async def test_usage_is_estimated_when_the_server_reports_none(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("x" * 400, usage=None))
    request = ask("y" * 2000)

    reply = await backend.complete(request)

    tools_chars = len(json.dumps(TOOLS, separators=(",", ":")))
    expected_prompt = (estimate_tokens(request.messages[0]) + len(request.system_prompt) // 4
                       + tools_chars // 4)
    assert reply.usage == Usage(expected_prompt, 100, estimated=True, cost=None)


async def test_usage_in_the_finishing_chunk_is_read(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    # llama.cpp style: usage rides on the last chunk that has choices, not a separate one.
    scripted_server.add(SSEChunks([
        {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 42, "completion_tokens": 1, "total_tokens": 43}},
    ]))

    reply = await backend.complete(ask())

    assert reply.usage == Usage(42, 1, estimated=False)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("status", [408, 409, 500, 502, 503, 504])
async def test_retryable_statuses_are_transient(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer, status: int) -> None:
    scripted_server.add(server_error(status, "upstream trouble"))

    with pytest.raises(TransientBackendError) as caught:
        await backend.complete(ask())

    assert caught.value.status_code == status
    assert "upstream trouble" in str(caught.value)
    assert MODEL in str(caught.value)
    assert isinstance(caught.value.__cause__, HttpStatusError)


@pytest.mark.parametrize(("step", "expected"), [
    (rate_limited(retry_after=2), 2.0),
    (rate_limited(retry_after=None, retry_after_ms=1500), 1.5),
    (rate_limited(retry_after=None), None),
])
async def test_a_rate_limit_is_transient_and_says_when_to_retry(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        step: HttpError, expected: float | None) -> None:
    scripted_server.add(step)

    with pytest.raises(TransientBackendError) as caught:
        await backend.complete(ask())

    assert caught.value.status_code == 429
    assert caught.value.retry_after == expected


async def test_retry_after_as_an_http_date(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    when = datetime.now(UTC) + timedelta(seconds=30)
    scripted_server.add(rate_limited(retry_after=format_datetime(when, usegmt=True)))

    with pytest.raises(TransientBackendError) as caught:
        await backend.complete(ask())

    assert caught.value.retry_after is not None
    assert 25 <= caught.value.retry_after <= 31


@pytest.mark.parametrize("step", [
    context_overflow(),
    # llama.cpp's server.
    RawJSON(400, {"error": {"code": 400, "type": "exceed_context_size_error",
                            "message": "the request exceeds the available context size, "
                                       "try increasing it"}}),
    # vLLM: a bare message, no code.
    RawJSON(400, {"object": "error", "message": "This model's maximum context length is 4096 "
                  "tokens. However, you requested 5000 tokens.", "type": "BadRequestError"}),
    HttpError(400, "prompt exceeds the context window", "invalid_request_error"),
])
async def test_a_too_long_prompt_is_a_context_overflow(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer, step: Any) -> None:
    scripted_server.add(step)

    with pytest.raises(ContextOverflowError) as caught:
        await backend.complete(ask())

    assert caught.value.status_code == 400
    assert caught.value.model == MODEL


@pytest.mark.parametrize(("step", "status", "words"), [
    (unauthorized(), 401, "Incorrect API key"),
    (HttpError(403, "Project has no access to this model", "permission_error"), 403, "access"),
    (HttpError(404, "The model `nope` does not exist", "invalid_request_error",
               "model_not_found"), 404, "does not exist"),
    (HttpError(400, "Invalid value for 'temperature'", "invalid_request_error"), 400,
     "temperature"),
    (RawJSON(422, "unprocessable: bad tools"), 422, "bad tools"),
])
async def test_other_refusals_are_plain_backend_errors(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer, step: Any,
        status: int, words: str) -> None:
    scripted_server.add(step)

    with pytest.raises(BackendError) as caught:
        await backend.complete(ask())

    assert type(caught.value) is BackendError
    assert caught.value.status_code == status
    assert words in str(caught.value)
    assert MODEL in str(caught.value)


async def test_a_dropped_stream_is_transient_and_returns_nothing_partial(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(dropped_stream("This answer will be cut short", after_chunks=3),
                        Reply("Second try works."))
    deltas: list[str] = []

    with pytest.raises(TransientBackendError) as caught:
        await backend.complete(ask(), on_text=deltas.append)

    assert caught.value.status_code is None
    assert deltas  # some text had streamed before the cut...
    reply = await backend.complete(ask())  # ...and the client recovers on a new connection
    assert reply.text == "Second try works."
    assert scripted_server.connections == 2


async def test_a_stream_that_ends_without_finishing_is_transient(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(SSEChunks(
        [{"choices": [{"index": 0, "delta": {"content": "half an ans"}}]}], done=False))

    with pytest.raises(TransientBackendError, match="ended before"):
        await backend.complete(ask())


async def test_an_empty_answer_to_a_prompt_near_the_window_is_an_overflow(
        scripted_server: ScriptedServer) -> None:
    # llama-cpp-python's chatml-function-calling handler: a 200 with an empty stream.
    scripted_server.add(SSEChunks([], done=False), SSEChunks([], done=False))
    config = make_config(scripted_server, context_window=1000)

    async with OpenAICompatibleBackend(config) as backend:
        with pytest.raises(ContextOverflowError, match="empty answer"):
            await backend.complete(ask("word " * 800, tools=[]))
        with pytest.raises(TransientBackendError):  # a short prompt: just a broken stream
            await backend.complete(ask("word " * 100, tools=[]))


async def test_a_cut_after_the_finish_reason_keeps_the_whole_answer(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(SSEChunks([
        _chunk({"content": "All done."}),
        _chunk({}, "stop"),
    ], drop=True))  # cut before the usage chunk and [DONE]

    reply = await backend.complete(ask())

    assert (reply.text, reply.stop_reason) == ("All done.", "stop")
    assert reply.usage.estimated


async def test_an_error_inside_the_stream_is_translated(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(
        SSEChunks([{"error": {"message": "the model worker crashed", "type": "server_error"}}]),
        SSEChunks([{"error": {"message": "maximum context length is 2048 tokens",
                              "code": 400}}]),
    )

    with pytest.raises(TransientBackendError, match="worker crashed"):
        await backend.complete(ask())
    with pytest.raises(ContextOverflowError):
        await backend.complete(ask())


async def test_a_slow_server_times_out_as_transient(scripted_server: ScriptedServer) -> None:
    scripted_server.add(slow(5.0))
    started = time.monotonic()

    async with OpenAICompatibleBackend(
            make_config(scripted_server, request_timeout=0.3)) as backend:
        with pytest.raises(TransientBackendError, match=r"did not answer within 0\.3 s") as caught:
            await backend.complete(ask())

    assert caught.value.status_code is None
    assert time.monotonic() - started < 3


async def test_a_refused_connection_is_transient() -> None:
    with socket.socket() as probe:  # a loopback port with nobody listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = OpenAIBackendConfig(base_url=f"http://127.0.0.1:{port}/v1", model=MODEL,
                                 context_window=1000, request_timeout=2)

    async with OpenAICompatibleBackend(config) as backend:
        with pytest.raises(TransientBackendError, match="connection") as caught:
            await backend.complete(ask())

    assert caught.value.status_code is None


async def test_the_sdk_does_not_retry_on_its_own(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(server_error(503), Reply("unused"))

    with pytest.raises(TransientBackendError):
        await backend.complete(ask())

    assert len(scripted_server.requests) == 1
    assert scripted_server.remaining == 1


async def test_a_cancelled_request_leaves_the_backend_usable(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("slowly " * 10, text_chunks=10, chunk_delay=0.2), Reply("next"))
    deltas: list[str] = []

    with anyio.CancelScope() as scope:

        def stop_after_first(text: str) -> None:
            deltas.append(text)
            scope.cancel()

        await backend.complete(ask(), on_text=stop_after_first)

    assert scope.cancelled_caught
    assert deltas == ["slowly "]
    assert (await backend.complete(ask())).text == "next"


# --------------------------------------------------------------------------- what is sent


async def test_the_wire_messages_the_server_receives(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    chart = ImageBlock(b"\x89PNG-chart", "image/png", "BTC 1h chart")
    photo = ImageBlock(b"\xff\xd8jpeg", "image/jpeg")
    messages = [
        Message.user_text("Tick: BTC moved 2%."),
        Message(role="assistant", kind="assistant", content=(
            TextBlock("Let me look."),
            ToolUseBlock("call_1", "get_ticker", '{"symbol": "BTC/USDT"}'),
            ToolUseBlock("call_2", "chart", '{"symbol": "BTC/USDT"}'))),
        Message(role="user", kind="tool_results", content=(
            ToolResultBlock("call_1", (TextBlock("last 64000"),)),
            ToolResultBlock("call_2", (TextBlock("chart ready"), chart)))),
        Message(role="user", kind="operator", content=(TextBlock("And this one?"), photo)),
    ]
    scripted_server.add(Reply("Done."))

    await backend.complete(ModelRequestSpec("You run a desk.", messages, TOOLS,
                                            max_output_tokens=256))

    sent = scripted_server.requests[0]
    assert sent.path == "/v1/chat/completions"
    assert sent.json["model"] == MODEL
    assert sent.json["stream"] is True
    assert sent.json["max_tokens"] == 256
    assert sent.tools == TOOLS
    assert sent.messages == [
        {"role": "system", "content": "You run a desk."},
        {"role": "user", "content": "Tick: BTC moved 2%."},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_ticker", "arguments": '{"symbol": "BTC/USDT"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "chart", "arguments": '{"symbol": "BTC/USDT"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "last 64000"},
        {"role": "tool", "tool_call_id": "call_2",
         "content": "chart ready\n[image attached in the next message]"},
        {"role": "user", "content": [
            {"type": "text", "text": "Images from tool call call_2:"},
            {"type": "image_url", "image_url": {"url": chart.data_url()}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "And this one?"},
            {"type": "image_url", "image_url": {"url": photo.data_url()}}]},
    ]
    assert chart.data_url().startswith("data:image/png;base64,")
    assert sent.headers["content-type"] == "application/json"


async def test_an_assistant_message_with_only_tool_calls_has_no_content(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    messages = [
        Message.user_text("go"),
        Message(role="assistant", content=(
            ToolUseBlock("a", "get_ticker", ""), ToolUseBlock("b", "get_ticker", "{oops"),
            ToolUseBlock("c", "get_ticker", "[1]"))),
        Message(role="user", kind="tool_results", content=(
            ToolResultBlock("a", (TextBlock("1"),)),
            ToolResultBlock("b", (TextBlock("bad arguments"),), is_error=True),
            ToolResultBlock("c", (TextBlock("bad arguments"),), is_error=True))),
    ]
    scripted_server.add(Reply("ok"))

    await backend.complete(ModelRequestSpec("", messages, []))

    sent = scripted_server.requests[0]
    assert "tools" not in sent.json  # an empty list upsets some servers
    assert sent.messages[0] == {"role": "user", "content": "go"}  # no empty system prompt
    assistant = sent.messages[1]
    assert "content" not in assistant  # llama-cpp-python's server refuses null content
    # Arguments always go back as JSON text: servers that parse them must not choke.
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [
        "{}", json.dumps({"raw_arguments": "{oops"}), json.dumps({"raw_arguments": "[1]"})]


async def test_settings_shape_the_request_body(scripted_server: ScriptedServer) -> None:
    config = make_config(scripted_server, max_output_tokens=512, temperature=0.2,
                         max_tokens_field="max_completion_tokens",
                         extra_body={"cache_prompt": True}, extra_headers={"X-Desk": "btc"})
    scripted_server.add(Reply("a"), Reply("b"))

    async with OpenAICompatibleBackend(config) as backend:
        await backend.complete(ask())
        await backend.complete(ModelRequestSpec("s", [Message.user_text("x")], [],
                                                max_output_tokens=64))

    first, second = (r.json for r in scripted_server.requests)
    assert (first["max_completion_tokens"], first["temperature"], first["cache_prompt"]) == (
        512, 0.2, True)
    assert "max_tokens" not in first
    assert second["max_completion_tokens"] == 64
    assert scripted_server.requests[0].headers["x-desk"] == "btc"


async def test_unicode_and_broken_surrogates_still_make_valid_json(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("ok"), Reply("ok"))

    await backend.complete(ask("Prix : 64 000 € 🚀, 比特币"))
    await backend.complete(ask("a lone surrogate \ud83d from a broken stream"))

    assert scripted_server.requests[0].messages[1]["content"] == "Prix : 64 000 € 🚀, 比特币"
    assert "€".encode() in scripted_server.requests[0].body  # sent as UTF-8, not escaped
    assert scripted_server.requests[1].messages[1]["content"] == (
        "a lone surrogate \ud83d from a broken stream")


@given(st.lists(st.text(st.characters(codec=None, exclude_categories=())), min_size=1,
                max_size=4))
def test_every_encoding_is_valid_json_of_the_wire_messages(texts: list[str]) -> None:
    message = Message(role="user", kind="tool_results", content=tuple(
        ToolResultBlock(f"call_{i}", (TextBlock(text),)) for i, text in enumerate(texts)))

    decoded = json.loads(b"[" + encode_message(message) + b"]")

    assert decoded == [{"role": "tool", "tool_call_id": f"call_{i}", "content": text}
                       for i, text in enumerate(texts)]


async def test_each_message_is_encoded_once_and_bodies_are_identical(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    encoded: list[str] = []
    real = openai_compatible._wire_messages

    def counting(message: Message) -> list[dict[str, Any]]:
        encoded.append(message.id)
        return real(message)

    monkeypatch.setattr(openai_compatible, "_wire_messages", counting)
    messages = [Message.user_text(f"tick {i}") for i in range(50)]
    request = ModelRequestSpec("system", messages, TOOLS)
    scripted_server.add(Reply("a"), Reply("b"))

    await backend.complete(request)
    await backend.complete(request)

    assert encoded == [m.id for m in messages]  # once each, on the first request only
    assert all(isinstance(m.cache["openai_wire"], bytes) for m in messages)
    first, second = scripted_server.requests
    assert first.body == second.body


@given(st.lists(st.sampled_from(["append", "append", "replace", "drop_first", "cut_end",
                                  "other_desk"]), min_size=1, max_size=12),
       st.sampled_from([None, 0, 1]))
def test_a_desks_body_joined_from_its_last_request_equals_one_built_afresh(
        steps: list[str], shared_tail: int | None) -> None:
    """Also with the messages shared as the loop's window sends them (``shared_tail`` not
    None: on one list grown in place, with that many after the shared part). The other
    desk, on the same backend, has a system prompt and tools of its own."""
    config = OpenAIBackendConfig(base_url="http://127.0.0.1:9/v1", model=MODEL,
                                 context_window=8192)
    remembering = OpenAICompatibleBackend(config)
    window = [Message.user_text("first")]
    base: list[Message] = []
    for number, step in enumerate(steps):
        if step == "append":
            window = [*window, Message.user_text(f"new {number}")]
        elif step == "replace" and window:  # a picture pruned, a message cut in the middle
            middle = len(window) // 2
            window = [*window[:middle], Message.user_text(f"cut {number}"),
                      *window[middle + 1:]]
        elif step == "drop_first":  # a compaction
            window = window[1:]
        elif step == "cut_end":  # a replayed last message taken off
            window = window[:-1]
        other = step == "other_desk"
        key = "trading-agent:other" if other else "trading-agent:desk"
        sent: Sequence[Message] = window
        if shared_tail is not None:
            sent, base = shared_as_a_window_sends(window, base, shared_tail)
        request = ModelRequestSpec("other system" if other else "system", sent,
                                   OTHER_TOOLS if other else TOOLS, cache_key=key)

        assert remembering.request_body(request) == (
            OpenAICompatibleBackend(config).request_body(request))


async def test_the_bodies_a_desk_sends_are_byte_identical_to_ones_built_afresh(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    """The desk's joined history (kept in pieces, joined into one past a few dozen) changes
    no byte of what the server receives: across many appends, a compaction and the pruning
    of old pictures."""
    preparer = ImagePreparer()
    conversation: list[Message] = [Message.user_text("first")]
    sent: list[bytes] = []
    for number in range(60):
        conversation.append(Message.user_text(f"tick {number}"))
        if number % 5 == 0:  # a picture: the older ones are pruned once past the newest four
            conversation.append(Message(role="user", content=(
                TextBlock(f"chart {number}"), ImageBlock(b"\x89PNG-%d" % number))))
        if number == 40:  # a compaction: a summary and the recent messages
            conversation = [Message.user_text("summary of the first 40 ticks"),
                            *conversation[-6:]]
        request = ModelRequestSpec("system", preparer.prune(conversation), TOOLS,
                                   cache_key="trading-agent:desk")
        scripted_server.add(Reply("ok"))
        await backend.complete(request)
        sent.append(OpenAICompatibleBackend(make_config(scripted_server)).request_body(request))

    assert [recorded.body for recorded in scripted_server.requests] == sent


async def test_a_new_message_is_encoded_alone(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    encoded: list[str] = []
    real = openai_compatible._wire_messages

    def counting(message: Message) -> list[dict[str, Any]]:
        encoded.append(message.id)
        return real(message)

    monkeypatch.setattr(openai_compatible, "_wire_messages", counting)
    messages = [Message.user_text("one"), Message.user_text("two")]
    scripted_server.add(Reply("a"), Reply("b"))

    await backend.complete(ModelRequestSpec("s", messages, TOOLS))
    later = Message.user_text("three")
    await backend.complete(ModelRequestSpec("s", [*messages, later], TOOLS))

    assert encoded == [messages[0].id, messages[1].id, later.id]
    assert [m["content"] for m in scripted_server.requests[1].messages] == [
        "s", "one", "two", "three"]


# --------------------------------------------------------------------------- untidy servers


def _chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"id": "x", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


async def test_an_empty_legacy_function_call_beside_tool_calls_is_ignored(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    empty_legacy = {"name": "", "arguments": ""}
    scripted_server.add(SSEChunks([
        _chunk({"role": "assistant", "content": None, "function_call": empty_legacy}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                "function": {"name": "get_ticker", "arguments": ""}}],
                "function_call": empty_legacy}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"symbol":"BTC"}'}}],
                "function_call": empty_legacy}),
        _chunk({}, "tool_calls"),
        {"id": "x", "choices": []},  # a chunk with no choices at all
    ]))

    reply = await backend.complete(ask())

    assert reply.tool_calls == [ToolUseBlock("call_9", "get_ticker", '{"symbol":"BTC"}')]
    assert reply.stop_reason == "tool_calls"


async def test_a_legacy_function_call_alone_becomes_a_tool_call(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(SSEChunks([
        _chunk({"role": "assistant", "function_call": {"name": "get_ticker", "arguments": ""}}),
        _chunk({"function_call": {"arguments": '{"symbol":'}}),
        _chunk({"function_call": {"arguments": '"ETH"}'}}),
        _chunk({}, "function_call"),
    ]))

    reply = await backend.complete(ask())

    [call] = reply.tool_calls
    assert (call.name, call.arguments) == ("get_ticker", '{"symbol":"ETH"}')
    assert call.id.startswith("call_")
    assert reply.stop_reason == "tool_calls"


async def test_odd_or_missing_tool_call_ids_become_usable_unique_ids(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply(tool_calls=[
        ToolCall("a", id=None),  # no id at all
        ToolCall("b", id=7),  # a number
        ToolCall("c", id="  "),  # blank
        ToolCall("d", id="dup"),
        ToolCall("e", id="dup"),  # the same id twice in one answer
        ToolCall("f", id="call_1"),  # what the backend would make up first
    ]))

    reply = await backend.complete(ask())

    ids = [call.id for call in reply.tool_calls]
    assert [call.name for call in reply.tool_calls] == ["a", "b", "c", "d", "e", "f"]
    assert len(set(ids)) == 6
    assert (ids[1], ids[3], ids[5]) == ("7", "dup", "call_1")
    assert all(ids[i].startswith("call_") for i in (0, 2, 4))


async def test_tool_call_deltas_without_index_or_with_object_arguments(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(SSEChunks([
        _chunk({"tool_calls": [{"id": "c1", "function": {"name": "get_ticker",
                                                          "arguments": {"symbol": "BTC"}}}]}),
        _chunk({"tool_calls": [{"id": "c2", "function": {"name": "get_ticker",
                                                          "arguments": '{"symbol":'}}]}),
        _chunk({"tool_calls": [{"function": {"arguments": '"ETH"}'}}]}),
        _chunk({"tool_calls": [{"function": {"name": "get_ticker", "arguments": "{}"}}]}),
        _chunk({}, "stop"),  # llama.cpp sometimes says stop after tool calls
    ]))

    reply = await backend.complete(ask())

    assert [(c.id, json.loads(c.arguments)) for c in reply.tool_calls[:2]] == [
        ("c1", {"symbol": "BTC"}), ("c2", {"symbol": "ETH"})]
    assert reply.tool_calls[2].arguments == "{}"  # a third call: a name starts a new one
    assert reply.stop_reason == "tool_calls"


async def test_a_name_repeated_in_every_delta_is_not_doubled(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(SSEChunks([
        _chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                "function": {"name": "get_ticker", "arguments": '{"a"'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"name": "get_ticker",
                                                          "arguments": ":1}"}}]}),
        _chunk({}, "tool_calls"),
    ]))

    reply = await backend.complete(ask())

    assert reply.tool_calls == [ToolUseBlock("c1", "get_ticker", '{"a":1}')]


# Streams captured from real servers (llama.cpp's among them), replayed verbatim.
FIXTURES = Path(__file__).parent.parent / "fixtures"
CAPTURED_STREAMS = {str(path.relative_to(FIXTURES)): path.read_text()
                    for path in sorted(FIXTURES.glob("**/*.sse"))}


def _naive_reading(capture: str) -> tuple[str, list[str], bool, dict[str, Any] | None, bool]:
    """Text, tool names, whether usage came, any error, whether it finished: read simply."""
    text, usage, error, finished = "", False, None, False
    names: dict[int, str] = {}  # by index: some servers repeat the name in every delta
    for line in capture.splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        data = json.loads(line[5:])
        usage = usage or bool(data.get("usage"))
        error = data.get("error") or error
        for choice in data.get("choices") or []:
            finished = finished or bool(choice.get("finish_reason"))
            delta = choice.get("delta") or {}
            text += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                if (call.get("function") or {}).get("name"):
                    names.setdefault(call["index"], call["function"]["name"])
    return text, [names[i] for i in sorted(names)], usage, error, finished


@pytest.mark.parametrize("capture", list(CAPTURED_STREAMS.values()), ids=list(CAPTURED_STREAMS))
async def test_captured_real_server_streams_read_as_they_obviously_should(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer, capture: str) -> None:
    text, names, usage, error, finished = _naive_reading(capture)
    scripted_server.add(RawSSE(capture))
    deltas: list[str] = []

    if error is not None or not finished:
        expected = (TransientBackendError if error is None
                    else ContextOverflowError if "context" in json.dumps(error) else BackendError)
        with pytest.raises(expected):
            await backend.complete(ask(), on_text=deltas.append)
        return
    reply = await backend.complete(ask(), on_text=deltas.append)

    assert (reply.text, "".join(deltas)) == (text, text)
    assert [call.name for call in reply.tool_calls] == names
    assert reply.usage.estimated is not usage


# --------------------------------------------------------------------------- the key


async def test_the_api_key_is_sent_but_never_shown(scripted_server: ScriptedServer) -> None:
    secret = "sk-test-very-secret-0123456789"

    def echo_key(request: Any) -> HttpError:
        # Some servers quote the key they were given in their error message.
        return unauthorized(f"Incorrect API key provided: {request.headers['authorization']}")

    scripted_server.responder = echo_key
    config = make_config(scripted_server, api_key_env="DESK_MODEL_KEY")
    async with OpenAICompatibleBackend(config, environ={"DESK_MODEL_KEY": secret}) as backend:
        with pytest.raises(BackendError) as caught:
            await backend.complete(ask())
        shown = [str(caught.value), repr(caught.value), caught.value.message, repr(backend),
                 repr(config), config.model_dump_json()]

    assert scripted_server.requests[0].headers["authorization"] == f"Bearer {secret}"
    assert caught.value.status_code == 401
    assert "Incorrect API key provided" in str(caught.value)
    assert not [text for text in shown if secret in text]
    assert not [e for e in _traceback_chain(caught.value) if secret in str(e)]


def _traceback_chain(exc: BaseException | None) -> list[BaseException]:
    """The exceptions a traceback of ``exc`` would print."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return chain


async def test_a_missing_key_variable_is_a_config_error(scripted_server: ScriptedServer) -> None:
    config = make_config(scripted_server, api_key_env="DESK_MODEL_KEY")

    with pytest.raises(ConfigError, match="DESK_MODEL_KEY"):
        OpenAICompatibleBackend(config, environ={})


async def test_a_server_needing_no_key_gets_a_placeholder(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("ok"))

    await backend.complete(ask())

    assert scripted_server.requests[0].headers["authorization"] == f"Bearer {NO_KEY_PLACEHOLDER}"


def test_the_config_refuses_unknown_fields_and_half_prices() -> None:
    base = {"base_url": "http://127.0.0.1:1/v1", "model": "m", "context_window": 10}
    with pytest.raises(ValueError, match="api_key"):
        OpenAIBackendConfig.model_validate({**base, "api_key": "sk-oops"})
    with pytest.raises(ValueError, match="price"):
        OpenAIBackendConfig(**base, price_input_per_million=1.0)
    with pytest.raises(ValueError, match="messages"):
        OpenAIBackendConfig(**base, extra_body={"messages": []})
    assert openai_compatible.pricing(OpenAIBackendConfig(**base)) is None


async def test_reasoning_the_server_streams_goes_to_on_thinking_and_never_into_the_answer(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    scripted_server.add(SSEChunks([
        _chunk({"role": "assistant", "reasoning_content": "The tick is "}),  # DeepSeek, vLLM
        _chunk({"reasoning_content": "small."}),
        _chunk({"reasoning": " Wait."}),  # OpenRouter, Ollama
        _chunk({"content": "No trade."}),
        _chunk({}, "stop"),
    ]))
    thoughts: list[str] = []
    texts: list[str] = []

    reply = await backend.complete(ask(), on_text=texts.append, on_thinking=thoughts.append)

    assert thoughts == ["The tick is ", "small.", " Wait."]
    assert texts == ["No trade."]
    assert reply.content == (TextBlock("No trade."),)


async def test_another_providers_thinking_is_never_sent(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer) -> None:
    # A desk that thought on Anthropic's API and was moved to this provider on reload.
    scripted_server.add(Reply("No trade."))
    call = Message(role="assistant", content=(
        ThinkingBlock("The tick is small.", "sig-abc", "anthropic"),
        TextBlock("Let me look."), ToolUseBlock("call_1", "get_ticker", "{}")))
    results = Message(role="user", kind="tool_results",
                      content=(ToolResultBlock("call_1", (TextBlock("64000"),)),))

    await backend.complete(ModelRequestSpec("s", [Message.user_text("t"), call, results], []))

    [sent] = scripted_server.requests
    assert "The tick is small." not in sent.body.decode() and "sig-abc" not in sent.body.decode()
    assert sent.json["messages"][2]["content"] == "Let me look."
    assert [c["id"] for c in sent.json["messages"][2]["tool_calls"]] == ["call_1"]
