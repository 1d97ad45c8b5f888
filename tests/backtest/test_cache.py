"""The response cache, over the real OpenAI-compatible backend and the scripted HTTP server.

Every answer the cache records comes from the scripted server through the real backend; the
server's request log proves which requests reached the model and which were replayed.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.agent.test_randomized_conversations import (
    Brain,
    DeskRig,
    Failure,
    Scenario,
    run_scenario,
    scenarios,
    wire_responder,
)
from tests.backends.test_openai_compatible import TOOLS
from tests.scripted_server import (
    RecordedRequest,
    Reply,
    ScriptedServer,
    ToolCall,
    context_overflow,
    server_error,
)
from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec, Usage
from trading_agent.agent.conversation import (
    ImageBlock,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.backtest.cache import (
    CacheFileError,
    CacheMissError,
    CacheMode,
    ResponseCache,
)
from trading_agent.errors import (
    BackendError,
    ConfigError,
    ContextOverflowError,
    TransientBackendError,
)

SYSTEM = "You run the BTC desk. Trade BTC/USDT with care."


@pytest.fixture
async def backend(scripted_server: ScriptedServer) -> AsyncIterator[OpenAICompatibleBackend]:
    config = OpenAIBackendConfig(base_url=scripted_server.base_url, model="scripted-model",
                                 context_window=32_000, request_timeout=5.0,
                                 price_input_per_million=3.0, price_output_per_million=15.0)
    async with OpenAICompatibleBackend(config) as created:
        yield created


@pytest.fixture
def cache_file(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "alpha" / "responses.jsonl"


def desk_script() -> list[Reply]:
    """The model's side of :func:`play`: four answers, with tool calls, usage or none."""
    return [
        Reply("Let me look.", tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"},
                                                   id="call_first")], usage=(120, 14)),
        Reply("BTC holds 64,000; no trade.", text_chunks=3, usage=None),
        Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"}, argument_chunks=2)],
              usage=(260, 11)),
        Reply(["Bought 0.1 BTC ", "on the breakout."], usage=(300, 9)),
    ]


@dataclass
class Played:
    """What :func:`play` saw: the replies and every piece of streamed text."""

    replies: list[ModelReply]
    streamed: list[str]
    requests: list[ModelRequestSpec]


async def play(cache: ModelBackend, *, system: str = SYSTEM,
               second_tick: str = "[tick: BTC/USDT]\nBTC/USDT moved 2.1%",
               prices: Sequence[str] = ("64,000.50", "65,210.00")) -> Played:
    """A desk's two turns, request by request, as the loop builds them (4 requests).

    Messages are made afresh on every call (new ids, new times), as a re-run makes them.
    """
    messages: list[Message] = [Message.user_text("[tick: BTC/USDT]\nBTC/USDT moved 1.2%")]
    played = Played([], [], [])

    async def ask() -> ModelReply:
        request = ModelRequestSpec(system, list(messages),
                                   TOOLS, max_output_tokens=400)
        played.requests.append(request)
        reply = await cache.complete(request, played.streamed.append)
        played.replies.append(reply)
        messages.append(Message(role="assistant", content=reply.content))
        return reply

    for price in prices:
        calls = (await ask()).tool_calls
        messages.append(Message(role="user", kind="tool_results", content=tuple(
            ToolResultBlock(call.id, (TextBlock(f"BTC/USDT last {price}"),))
            for call in calls)))
        await ask()
        messages.append(Message.user_text(second_tick))
    return played


def read(path: Path) -> bytes:
    """The file's bytes (a small file: read on the event loop in a test)."""
    return path.read_bytes()


def write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def lines_of(path: Path) -> list[dict[str, Any]]:
    data = read(path)
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.splitlines()]


# --------------------------------------------------------------------------- record, replay


async def test_a_second_run_replays_everything_without_asking_the_model(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(*desk_script())
    async with ResponseCache(backend, cache_file) as recording:
        live = await play(recording)
    assert (recording.requests, recording.model_calls, recording.cache_hits) == (4, 4, 0)
    assert len(scripted_server.requests) == 4
    scripted_server.assert_complete()

    async with ResponseCache(backend, cache_file) as replaying:
        replayed = await play(replaying)

    assert len(scripted_server.requests) == 4  # not one more request reached the model
    assert (replaying.requests, replaying.model_calls, replaying.cache_hits) == (4, 0, 4)
    assert replayed.replies == live.replies
    assert [r.usage for r in replayed.replies] == [
        Usage(120, 14, False, 120 * 3e-6 + 14 * 15e-6), live.replies[1].usage,
        Usage(260, 11, False, 260 * 3e-6 + 11 * 15e-6),
        Usage(300, 9, False, 300 * 3e-6 + 9 * 15e-6)]
    assert live.replies[1].usage.estimated  # the server sent none: the estimate is replayed
    assert [r.stop_reason for r in replayed.replies] == ["tool_calls", "stop", "tool_calls",
                                                        "stop"]
    assert replayed.replies[0].tool_calls[0].id == "call_first"
    assert replayed.replies[2].tool_calls == live.replies[2].tool_calls
    assert "".join(replayed.streamed) == "".join(live.streamed) == (
        "Let me look.BTC holds 64,000; no trade.Bought 0.1 BTC on the breakout.")
    # What the second run sent is what the first sent, message for message.
    assert [len(r.messages) for r in replayed.requests] == [1, 3, 5, 7]


async def test_strict_mode_replays_and_never_writes(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(*desk_script())
    async with ResponseCache(backend, cache_file) as recording:
        live = await play(recording)
    before = read(cache_file)

    async with ResponseCache(backend, cache_file, "strict") as strict:
        replayed = await play(strict)

    assert replayed.replies == live.replies
    assert (strict.model_calls, strict.cache_hits) == (0, 4)
    assert read(cache_file) == before
    assert len(scripted_server.requests) == 4


async def test_the_file_keeps_each_message_once(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(*desk_script())
    async with ResponseCache(backend, cache_file) as recording:
        await play(recording)

    lines = lines_of(cache_file)
    kinds = [line["kind"] for line in lines]
    assert kinds.count("system") == 1 and kinds.count("tools") == 1
    assert kinds.count("message") == 7  # the 7 distinct messages, each once
    assert kinds.count("answer") == 4
    answers = [line for line in lines if line["kind"] == "answer"]
    # Each answer names only the messages the one before did not have.
    assert [(a["keep"], len(a["messages"])) for a in answers] == [(0, 1), (1, 2), (3, 2),
                                                                  (5, 2)]
    assert all(line["v"] == 2 for line in lines)


# --------------------------------------------------------------------------- strict misses


async def test_a_changed_message_names_the_message_and_both_texts(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(*desk_script())
    async with ResponseCache(backend, cache_file) as recording:
        await play(recording)

    async with ResponseCache(backend, cache_file, "strict") as strict:
        with pytest.raises(CacheMissError) as caught:
            await play(strict, second_tick="[tick: BTC/USDT]\nBTC/USDT moved 4.8%")

    message = str(caught.value)
    assert message.startswith("no recorded answer for request 3 (strict cache): message 5 of 5 "
                              "(user, text) differs from the recording: ")
    assert 'recorded "[tick: BTC/USDT]\\nBTC/USDT moved 2.1%"' in message
    assert 'now "[tick: BTC/USDT]\\nBTC/USDT moved 4.8%"' in message
    assert (strict.cache_hits, strict.model_calls) == (2, 0)
    assert len(scripted_server.requests) == 4
    # Not a transient error: the loop fails the turn instead of retrying it.
    assert isinstance(caught.value, BackendError)
    assert not isinstance(caught.value, TransientBackendError)


async def test_a_changed_tool_result_deep_in_the_history_is_named(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(*desk_script())
    async with ResponseCache(backend, cache_file) as recording:
        await play(recording)

    async with ResponseCache(backend, cache_file, "strict") as strict:
        with pytest.raises(CacheMissError) as caught:
            await play(strict, prices=("64,000.50", "63,990.00"))

    message = str(caught.value)
    assert "request 4 (strict cache): message 7 of 7 (user, tool_result) differs" in message
    assert "65,210.00" in message and "63,990.00" in message


async def test_an_edited_system_prompt_is_named(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(*desk_script())
    async with ResponseCache(backend, cache_file) as recording:
        await play(recording)

    async with ResponseCache(backend, cache_file, "strict") as strict:
        with pytest.raises(CacheMissError) as caught:
            await play(strict, system=SYSTEM.replace("with care", "boldly"))

    message = str(caught.value)
    assert message.startswith("no recorded answer for request 1 (strict cache): the system "
                              "prompt changed: ")
    assert "with care" in message and "boldly" in message


async def test_changed_tools_and_settings_are_named(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(Reply("ok"))
    question = [Message.user_text("What now?")]
    async with ResponseCache(backend, cache_file, sampling={"temperature": 0.2}) as recording:
        await recording.complete(ModelRequestSpec(SYSTEM, question, TOOLS))

    more_tools = [*TOOLS, {"type": "function", "function": {"name": "place_order"}}]
    async with ResponseCache(backend, cache_file, "strict",
                             sampling={"temperature": 0.2}) as strict:
        with pytest.raises(CacheMissError, match=r"the tools changed \(added place_order\)"):
            await strict.complete(ModelRequestSpec(SYSTEM, question, more_tools))
    async with ResponseCache(backend, cache_file, "strict",
                             sampling={"temperature": 0.7}) as strict:
        with pytest.raises(CacheMissError, match="the model or sampling settings changed"):
            await strict.complete(ModelRequestSpec(SYSTEM, question, TOOLS))
    assert len(scripted_server.requests) == 1


async def test_a_longer_conversation_than_recorded_says_which_message_is_new(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(Reply("Holding."))
    first = Message.user_text("BTC/USDT moved 1%")
    async with ResponseCache(backend, cache_file) as recording:
        reply = await recording.complete(ModelRequestSpec(SYSTEM, [first], TOOLS))

    longer = [first, Message(role="assistant", content=reply.content),
              Message.user_text("And now?", kind="operator")]
    async with ResponseCache(backend, cache_file, "strict") as strict:
        with pytest.raises(CacheMissError) as caught:
            await strict.complete(ModelRequestSpec(SYSTEM, longer, TOOLS))
    assert "message 2 of 3 (assistant, text) is new: the closest recorded request ends after " \
           'message 1; now "Holding."' in str(caught.value)


async def test_an_empty_cache_says_to_record_first(backend: OpenAICompatibleBackend,
                                                   cache_file: Path) -> None:
    async with ResponseCache(backend, cache_file, "strict") as strict:
        with pytest.raises(CacheMissError) as caught:
            await play(strict)
    message = str(caught.value)
    assert f"the cache file {cache_file} is empty or missing" in message
    assert "run with `--cache record` first" in message
    assert not cache_file.parent.parent.exists()  # not even its folder


# --------------------------------------------------------------------------- repeats


async def test_repeated_identical_requests_replay_in_order(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(Reply("first"), Reply("second"), Reply("third"))

    def same() -> ModelRequestSpec:
        return ModelRequestSpec(SYSTEM, [Message.user_text("[schedule: hourly]\nReview.")],
                                TOOLS)

    async with ResponseCache(backend, cache_file) as recording:
        assert [(await recording.complete(same())).text for _ in range(2)] == [
            "first", "second"]
    async with ResponseCache(backend, cache_file) as extending:
        assert [(await extending.complete(same())).text for _ in range(3)] == [
            "first", "second", "third"]
        assert (extending.cache_hits, extending.model_calls) == (2, 1)
    assert len(scripted_server.requests) == 3
    scripted_server.assert_complete()

    async with ResponseCache(backend, cache_file, "strict") as strict:
        assert [(await strict.complete(same())).text for _ in range(3)] == [
            "first", "second", "third"]
        with pytest.raises(CacheMissError, match=r"recorded 3 time\(s\) and this run asks it "
                                                 "once more"):
            await strict.complete(same())


# --------------------------------------------------------------------------- prompt edits


async def test_an_edit_invalidates_only_from_the_first_changed_request(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    questions = ["BTC?", "ETH?", "SOL?", "XRP?"]
    scripted_server.add(*[Reply(f"answer {n}") for n in range(1, 5)], Reply("edited answer"))

    async def ask_each(cache: ResponseCache, texts: list[str]) -> list[str]:
        return [(await cache.complete(ModelRequestSpec(SYSTEM, [Message.user_text(t)],
                                                       TOOLS))).text for t in texts]

    async with ResponseCache(backend, cache_file) as recording:
        assert await ask_each(recording, questions) == [
            "answer 1", "answer 2", "answer 3", "answer 4"]
    edited = ["BTC?", "ETH?", "SOL, and why?", "XRP?"]
    async with ResponseCache(backend, cache_file) as again:
        answers: list[str] = []
        for text in edited:
            answers.append((await ask_each(again, [text]))[0])
            if len(answers) == 2:
                assert (again.cache_hits, again.model_calls) == (2, 0)
            if len(answers) == 3:
                assert (again.cache_hits, again.model_calls) == (2, 1)
    assert answers == ["answer 1", "answer 2", "edited answer", "answer 4"]
    assert len(scripted_server.requests) == 5
    assert scripted_server.requests[4].messages[-1]["content"] == "SOL, and why?"
    scripted_server.assert_complete()


async def test_an_edit_in_a_conversation_re_asks_from_that_request_on(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(*desk_script(), *desk_script()[2:])
    async with ResponseCache(backend, cache_file) as recording:
        await play(recording)
    edited_tick = "[tick: BTC/USDT]\nBTC/USDT moved 3.3%"
    async with ResponseCache(backend, cache_file) as again:
        await play(again, second_tick=edited_tick)
    assert (again.cache_hits, again.model_calls) == (2, 2)
    assert scripted_server.requests[4].messages[-1]["content"] == edited_tick
    scripted_server.assert_complete()

    # Both versions now replay in full.
    for tick in ("[tick: BTC/USDT]\nBTC/USDT moved 2.1%", edited_tick):
        async with ResponseCache(backend, cache_file, "strict") as strict:
            await play(strict, second_tick=tick)
        assert strict.cache_hits == 4
    assert len(scripted_server.requests) == 6


# --------------------------------------------------------------------------- modes, files


async def test_off_mode_asks_every_time_and_never_creates_the_file(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(*desk_script(), *desk_script())
    for _ in range(2):
        async with ResponseCache(backend, cache_file, "off") as off:
            await play(off)
        assert (off.requests, off.model_calls, off.cache_hits) == (4, 4, 0)
    assert len(scripted_server.requests) == 8
    assert not cache_file.parent.parent.exists()  # not even its folder


async def test_a_context_overflow_is_recorded_and_replayed(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(context_overflow())
    request = ModelRequestSpec(SYSTEM, [Message.user_text("x" * 100)], TOOLS)
    async with ResponseCache(backend, cache_file) as recording:
        with pytest.raises(ContextOverflowError) as live:
            await recording.complete(request)
    async with ResponseCache(backend, cache_file, "strict") as strict:
        with pytest.raises(ContextOverflowError) as replayed:
            await strict.complete(replace(request, messages=[Message.user_text("x" * 100)]))
    assert str(replayed.value) == str(live.value)
    assert "maximum context length is 8192 tokens" in str(replayed.value)
    assert len(scripted_server.requests) == 1


async def test_a_transient_failure_is_not_recorded(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(server_error(503), Reply("after the retry"))
    request = ModelRequestSpec(SYSTEM, [Message.user_text("BTC?")], TOOLS)
    async with ResponseCache(backend, cache_file) as recording:
        with pytest.raises(TransientBackendError):
            await recording.complete(request)
        assert (await recording.complete(request)).text == "after the retry"
        assert recording.model_calls == 2
    async with ResponseCache(backend, cache_file, "strict") as strict:
        assert (await strict.complete(request)).text == "after the retry"


@pytest.mark.parametrize(("bad_line", "why"), [
    (b"this is not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"v": 3, "kind": "message"}', "format version 3; this program reads version 2"),
    (b'{"v": 1, "kind": "message"}', "format version 1 (written by an older trading-agent"),
    (b'{"v": 2, "kind": "answer", "key": "k"}', '"system" is missing'),
    (b'{"v": 2, "kind": "mystery"}', "unknown line kind 'mystery'"),
])
async def test_an_unreadable_line_names_the_file_and_the_line(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer, cache_file: Path,
        bad_line: bytes, why: str) -> None:
    scripted_server.add(*desk_script())
    async with ResponseCache(backend, cache_file) as recording:
        await play(recording)
    lines = read(cache_file).splitlines(keepends=True)
    write(cache_file, b"".join([*lines[:2], bad_line + b"\n", *lines[2:]]))

    for mode in ("record", "strict"):
        cache = ResponseCache(backend, cache_file, mode)
        with pytest.raises(CacheFileError) as caught:
            await cache.open()
        message = str(caught.value)
        assert message.startswith(f"{cache_file}, line 3: unreadable response cache line: ")
        assert why in message
        assert "Delete the file to record afresh, or run with `--cache off`" in message
        assert isinstance(caught.value, ConfigError)


async def test_a_torn_last_line_is_dropped_and_cut_before_the_next_append(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(*desk_script())
    async with ResponseCache(backend, cache_file) as recording:
        await play(recording, prices=("64,000.50",))  # the first turn: 2 requests
    whole = read(cache_file)
    torn = b'{"v":1,"kind":"answer","key":"abc","mod'
    write(cache_file, whole + torn)  # a crash in the middle of the next append

    async with ResponseCache(backend, cache_file, "strict") as strict:
        await play(strict, prices=("64,000.50",))
        assert strict.cache_hits == 2
    assert read(cache_file) == whole + torn  # strict never writes

    async with ResponseCache(backend, cache_file) as resumed:
        await play(resumed)  # both turns: 2 replayed, 2 asked
        assert (resumed.cache_hits, resumed.model_calls) == (2, 2)
    data = read(cache_file)
    assert data.startswith(whole) and torn not in data
    assert len(lines_of(cache_file)) > len(whole.splitlines())

    async with ResponseCache(backend, cache_file, "strict") as strict:
        await play(strict)
        assert strict.cache_hits == 4
    scripted_server.assert_complete()


async def test_use_before_open_and_bad_settings_are_refused(
        backend: OpenAICompatibleBackend, cache_file: Path) -> None:
    with pytest.raises(RuntimeError, match="open the ResponseCache"):
        await ResponseCache(backend, cache_file).complete(
            ModelRequestSpec(SYSTEM, [Message.user_text("hi")], TOOLS))
    with pytest.raises(ConfigError, match="allowed are record, strict, off"):
        ResponseCache(backend, cache_file, "replay")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be JSON values"):
        ResponseCache(backend, cache_file, sampling={"temperature": object()})


# --------------------------------------------------------------------------- images


def png(shade: int) -> bytes:
    image = Image.new("RGB", (16, 16), (shade, 90, 200))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


async def test_images_hit_on_the_same_bytes_and_miss_on_others(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(Reply("An uptrend."))

    def with_chart(data: bytes, description: str = "chart") -> ModelRequestSpec:
        return ModelRequestSpec(SYSTEM, [Message(role="user", kind="operator", content=(
            TextBlock("What does this chart show?"), ImageBlock(data, "image/png",
                                                                description)))], TOOLS)

    async with ResponseCache(backend, cache_file) as recording:
        await recording.complete(with_chart(png(10)))
    assert "image_url" in scripted_server.requests[0].body.decode()
    assert b"base64" not in read(cache_file)  # an image is kept by its hash only

    async with ResponseCache(backend, cache_file, "strict") as strict:
        # The same bytes in new objects (the description is never sent): a hit.
        assert (await strict.complete(with_chart(png(10), "BTC 1h"))).text == "An uptrend."
        with pytest.raises(CacheMissError) as caught:
            await strict.complete(with_chart(png(11)))
    message = str(caught.value)
    assert "message 1 of 1 (user, text, image) differs" in message
    assert message.count("[image image/png ") == 2
    assert len(scripted_server.requests) == 1


# --------------------------------------------------------------------------- the real loop


class Logged:
    """A backend wrapper that writes down what each request got (it answers nothing)."""

    def __init__(self, inner: ResponseCache) -> None:
        self.inner = inner
        self.model = inner.model
        self.context_window = inner.context_window
        self.outcomes: list[tuple[str, ModelReply | str]] = []

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        key = self.inner.key_of(request)
        try:
            reply = await self.inner.complete(request, on_text, on_thinking)
        except ContextOverflowError:
            self.outcomes.append((key, "overflow"))
            raise
        self.outcomes.append((key, reply))
        return reply


def _at_most_three_failures_in_a_row(scenario: Scenario) -> Scenario:
    """Four transient failures in a row exhaust the loop's retries: that request is never
    answered, so a strict replay has nothing to give it."""
    steps = []
    failures = 0
    for step in scenario.steps:
        failures = failures + 1 if isinstance(step, Failure) else 0
        if failures <= 3:
            steps.append(step)
    return replace(scenario, steps=tuple(steps))


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(scenario=scenarios.map(_at_most_three_failures_in_a_row))
@pytest.mark.slow
def test_randomized_desk_conversations_replay_exactly_in_strict_mode(
        scenario: Scenario, scripted_server: ScriptedServer) -> None:
    """The project's randomized desk days (tool calls, charts, compactions, memory flushes,
    steering, cancelled turns, failures and overflows) through the real loop, recorded over
    HTTP, then replayed in strict mode: the same requests get the same answers, and not one
    request reaches the server."""
    config = OpenAIBackendConfig(base_url=scripted_server.base_url, model="scripted-model",
                                 context_window=scenario.window, request_timeout=10)

    async def run(path: Path, mode: CacheMode) -> tuple[list[str], Logged, ResponseCache]:
        async with OpenAICompatibleBackend(config) as inner, \
                ResponseCache(inner, path, mode) as cache:
            logged = Logged(cache)
            problems = await run_scenario(scenario, DeskRig(), logged)
        return problems, logged, cache

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "responses.jsonl"
        scripted_server.responder = wire_responder(Brain(scenario), scenario.window, [])
        problems, live, recording = anyio.run(run, path, "record", backend="asyncio")
        asked = len(scripted_server.requests)
        scripted_server.responder = None

        replay_problems, replayed, strict = anyio.run(run, path, "strict", backend="asyncio")

    assert problems == [] and replay_problems == []
    assert replayed.outcomes == live.outcomes
    assert recording.model_calls >= len(live.outcomes) > 0
    assert (strict.cache_hits, strict.model_calls) == (len(live.outcomes), 0)
    assert len(scripted_server.requests) == asked
    assert scripted_server.unexpected == []


# --------------------------------------------------------------------------- keys


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(st.text(max_size=40), min_size=1, max_size=6),
       error=st.booleans(), call_id=st.text(min_size=1, max_size=8))
def test_the_key_depends_on_what_is_sent_and_nothing_else(texts: list[str], error: bool,
                                                          call_id: str) -> None:
    """Fresh ids and times give the same key; any change to a sent field gives another."""
    class Unused:
        model = "m"
        context_window = 1000

        async def complete(self, request: ModelRequestSpec,
                           on_text: Callable[[str], None] | None = None,
                           on_thinking: Callable[[str], None] | None = None) -> ModelReply:
            raise AssertionError("a key is computed without asking the model")

    cache = ResponseCache(Unused(), Path("unused.jsonl"), "off")

    def build(texts: list[str], error: bool, call_id: str) -> ModelRequestSpec:
        messages = [Message.user_text(t) for t in texts]
        messages.append(Message(role="assistant", content=(
            ToolUseBlock(call_id, "get_ticker", '{"symbol": "BTC/USDT"}'),)))
        messages.append(Message(role="user", kind="tool_results", content=(
            ToolResultBlock(call_id, (TextBlock("64000"),), is_error=error),)))
        return ModelRequestSpec(SYSTEM, messages, TOOLS)

    key = cache.key_of(build(texts, error, call_id))
    assert cache.key_of(build(texts, error, call_id)) == key
    assert cache.key_of(build(texts, not error, call_id)) != key
    assert cache.key_of(build(texts, error, call_id + "x")) != key
    assert cache.key_of(build([*texts[:-1], texts[-1] + "."], error, call_id)) != key
    assert cache.key_of(build(texts[1:], error, call_id)) != key


def fixed_request() -> ModelRequestSpec:
    """A request of every kind of block, built afresh (new objects) on each call."""
    call = ToolUseBlock("call_7", "get_ticker", '{"symbol": "BTC/USDT"}')
    return ModelRequestSpec(SYSTEM, [
        Message.user_text("[tick: BTC/USDT]\nBTC/USDT moved 1.2% \u00e9\u20ac"),
        Message(role="assistant", content=(TextBlock("Let me look."), call)),
        Message(role="user", kind="tool_results", content=(ToolResultBlock(
            "call_7", (TextBlock("BTC/USDT last 64,000.50"),
                       ImageBlock(bytes(range(256)) * 4, "image/png", "chart"))),)),
        Message(role="assistant", content=(TextBlock("Holding."),)),
    ], TOOLS, max_output_tokens=400)


FIXED_KEY = "8598af57b0289be04855f88aa5c729a17a85928eb9b00306e67e75181c40ae8d"
"""The key of :func:`fixed_request` under format version 2. It changes only with the
format version: a change of the key's recipe that keeps the version would silently turn
every recorded file into misses."""


class NoModel:
    """A backend for keys alone: it answers nothing."""

    model = "m"
    context_window = 1000

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        raise AssertionError("a key is computed without asking the model")


def test_the_key_is_the_same_in_another_process() -> None:
    """A re-run is a new process, with other hash seeds and other objects: it must hit."""
    script = ("from pathlib import Path\n"
              "from tests.backtest.test_cache import NoModel, fixed_request\n"
              "from trading_agent.backtest.cache import ResponseCache\n"
              "print(ResponseCache(NoModel(), Path('unused.jsonl'), 'off')"
              ".key_of(fixed_request()))\n")
    root = Path(__file__).resolve().parents[2]
    keys = {subprocess.run([sys.executable, "-c", script], cwd=root, check=True, timeout=50,
                           capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
            for seed in ("1", "2")}

    # Here the key comes by the short way: the request before it shared its first messages
    # as the same objects, so only the last one is hashed.
    cache = ResponseCache(NoModel(), Path("unused.jsonl"), "off")
    request = fixed_request()
    cache.key_of(replace(request, messages=list(request.messages[:3])))
    assert keys == {cache.key_of(request)} == {FIXED_KEY}


@dataclass
class Edit:
    """One change to a conversation between two requests."""

    kind: str  # append, same_copy, replace, drop_front, summary_front
    position: int
    text: str


edits = st.builds(Edit, st.sampled_from(["append", "append", "same_copy", "replace",
                                         "drop_front", "summary_front"]),
                  st.integers(0, 40), st.text(max_size=12))


def fresh(message: Message) -> Message:
    """The same message as a new object, with a new id and time."""
    return Message(role=message.role, content=message.content, kind=message.kind)


@settings(max_examples=80, deadline=None)
@given(steps=st.lists(edits, min_size=1, max_size=30))
def test_a_key_by_the_short_way_equals_the_key_from_scratch(steps: list[Edit]) -> None:
    """Whatever happens to the conversation between requests (messages added, rewritten,
    copied as new objects, dropped by a compaction), the key a cache computes from its last
    requests equals the key a new cache computes from new objects of the same content."""
    warm = ResponseCache(NoModel(), Path("unused.jsonl"), "off")
    conversation = [Message.user_text("[tick]")]
    for number, step in enumerate(steps):
        at = step.position % len(conversation)
        if step.kind == "append":
            conversation.append(Message.user_text(step.text or f"tick {number}"))
        elif step.kind == "same_copy":
            conversation[at] = fresh(conversation[at])
        elif step.kind == "replace":
            conversation[at] = Message.user_text(f"{step.text} rewritten {number}")
        elif step.kind == "drop_front" and len(conversation) > 1:
            del conversation[:at or 1]
        elif step.kind == "summary_front":
            conversation[:at] = [Message.user_text(f"summary {number}", kind="summary")]
        request = ModelRequestSpec(SYSTEM, list(conversation), TOOLS)
        cold = ResponseCache(NoModel(), Path("unused.jsonl"), "off")
        copy = replace(request, messages=[fresh(m) for m in conversation])
        assert warm.key_of(request) == cold.key_of(copy)


# --------------------------------------------------------------------------- memory


def held_by(cache: ResponseCache) -> tuple[list[object], list[Message]]:
    """What the cache holds, object by object, apart from the model it wraps and files; and
    the messages it holds (the caller's objects, not followed)."""
    seen: set[int] = set()
    held: list[object] = []
    messages: list[Message] = []
    stack: list[object] = [v for k, v in vars(cache).items() if k != "backend"]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Message):
            messages.append(item)
            continue
        held.append(item)
        if isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple | set | frozenset | deque):
            stack += list(item)
        elif dataclasses.is_dataclass(item):
            stack += [getattr(item, f.name) for f in dataclasses.fields(item)]
    return held, messages


def held_size(cache: ResponseCache) -> int:
    return sum(sys.getsizeof(item) for item in held_by(cache)[0])


def tick(number: int, move: str = "quiet tape") -> Message:
    """A trigger of about a thousand characters, as a desk's candle summary is."""
    return Message.user_text(f"[tick: BTC/USDT #{number}]\n" + f"{move}; " * 90)


def holding(request: RecordedRequest) -> Reply:
    return Reply(f"Holding, having read {len(request.messages)} messages. " * 4)


async def test_a_long_recording_holds_hashes_not_message_bodies(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    """Recording keeps each body in the file and only its hash in memory: what the cache
    holds grows by far less than a body per message, and holds no message text at all but
    the last few requests' message objects (the caller's, compared by identity)."""
    scripted_server.responder = holding
    requests: list[list[Message]] = []
    sizes: dict[int, int] = {}
    async with ResponseCache(backend, cache_file) as recording:
        conversation = [tick(0)]
        for number in range(1, 241):
            requests.append(list(conversation))
            reply = await recording.complete(ModelRequestSpec(SYSTEM, requests[-1], TOOLS))
            conversation += [Message(role="assistant", content=reply.content), tick(number)]
            if len(conversation) > 40:  # a compaction: a summary and the newest messages
                conversation = [Message.user_text(f"Summary {number}.", kind="summary"),
                                *conversation[-10:]]
            if number in (120, 240):
                sizes[number] = held_size(recording)
        held, messages = held_by(recording)

    text = [item if isinstance(item, str) else item.decode("latin-1")
            for item in held if isinstance(item, str | bytes)]
    assert not [t for t in text if "quiet tape" in t or "Holding" in t]
    last_requests = {id(m) for request in requests[-4:] for m in request}
    assert messages and {id(m) for m in messages} <= last_requests
    # 240 new messages of over 900 characters each in the second half.
    assert (sizes[240] - sizes[120]) / 240 < 300
    # All of it is in the file, each body once (a reply can repeat after a compaction).
    kinds = [line["kind"] for line in lines_of(cache_file)]
    assert kinds.count("answer") == 240
    assert kinds.count("message") == len({(m.role, m.text) for r in requests for m in r})


async def test_a_strict_miss_after_a_reopen_reads_both_texts_back_from_the_file(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.responder = holding
    async with ResponseCache(backend, cache_file) as recording:
        conversation = [tick(0)]
        for number in range(1, 21):
            reply = await recording.complete(ModelRequestSpec(SYSTEM, list(conversation),
                                                              TOOLS))
            conversation += [Message(role="assistant", content=reply.content), tick(number)]

    edited = [fresh(m) for m in conversation[:-1]]
    edited[10] = tick(5, move="sharp drop")  # message 11 of 40, tick 5
    async with ResponseCache(backend, cache_file, "strict") as strict:
        held, _ = held_by(strict)
        assert not [t for t in held if isinstance(t, str) and "quiet tape" in t]
        with pytest.raises(CacheMissError) as caught:
            await strict.complete(ModelRequestSpec(SYSTEM, edited, TOOLS))

    message = str(caught.value)
    assert message.startswith("no recorded answer for request 1 (strict cache): message 11 of "
                              "40 (user, text) differs from the recording: ")
    assert 'recorded "[tick: BTC/USDT #5]\\nquiet tape; quiet tape; ' in message
    assert 'now "[tick: BTC/USDT #5]\\nsharp drop; sharp drop; ' in message
    assert len(scripted_server.requests) == 20


async def test_a_file_of_the_previous_format_is_refused_on_its_first_line(
        backend: OpenAICompatibleBackend, cache_file: Path) -> None:
    cache_file.parent.mkdir(parents=True)
    old = (b'{"hash":"41d8","kind":"system","text":"You run the BTC desk.","v":1}\n'
           b'{"hash":"c0ff","kind":"tools","tools":[],"v":1}\n')
    write(cache_file, old)
    for mode in ("record", "strict"):
        with pytest.raises(CacheFileError) as caught:
            await ResponseCache(backend, cache_file, mode).open()
        assert str(caught.value) == (
            f"{cache_file}, line 1: unreadable response cache line: format version 1 (written "
            "by an older trading-agent, whose request keys differ); this program reads "
            "version 2. Delete the file to record afresh, or run with `--cache off`")
    assert read(cache_file) == old


async def test_a_file_changed_under_a_strict_run_is_reported(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(*desk_script())
    async with ResponseCache(backend, cache_file) as recording:
        await play(recording)
    data = read(cache_file)
    async with ResponseCache(backend, cache_file, "strict") as strict:
        write(cache_file, b"\n" * len(data))  # the same size, none of the answers
        with pytest.raises(CacheFileError, match="changed while this run used it"):
            await play(strict)


async def test_a_live_desks_recorder_always_asks_and_a_write_failure_never_fails_the_turn(
        backend: OpenAICompatibleBackend, scripted_server: ScriptedServer,
        cache_file: Path) -> None:
    scripted_server.add(Reply("First."), Reply("Second."), Reply("Third."))
    question = [Message.user_text("Anything new?")]
    async with ResponseCache(backend, cache_file, "record") as cache:
        await cache.complete(ModelRequestSpec(SYSTEM, question, TOOLS))
    # A new process: the same request is asked of the model again, never replayed, and the
    # file keeps both answers for a replay.
    async with ResponseCache(backend, cache_file, "record", replay_recorded=False) as recorder:
        reply = await recorder.complete(ModelRequestSpec(SYSTEM, question, TOOLS))
        assert (reply.text, recorder.model_calls, recorder.cache_hits) == ("Second.", 1, 0)
    async with ResponseCache(backend, cache_file, "strict") as strict:
        replayed = [(await strict.complete(ModelRequestSpec(SYSTEM, question, TOOLS))).text
                    for _ in range(2)]
    assert replayed == ["First.", "Second."]

    # The file cannot be written (where its folder goes is a file): the answer still comes
    # back, and the failure is logged.
    broken = cache_file.parent / "gone" / "responses.jsonl"
    async with ResponseCache(backend, broken, "record", replay_recorded=False) as recorder:
        broken.parent.write_text("not a folder")
        with structlog.testing.capture_logs() as logged:
            reply = await recorder.complete(ModelRequestSpec(SYSTEM, question, TOOLS))
    assert reply.text == "Third."
    assert [entry["event"] for entry in logged] == ["model_answer_not_kept"]
    scripted_server.assert_complete()
