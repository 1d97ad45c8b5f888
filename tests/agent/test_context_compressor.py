"""The context compressor, against the scripted server: what the model was sent, request by
request.

A conversation driven past 70% gets the silent memory flush, then a summary; past 85% in the
middle of a turn it is summarized at once, without flush, and the turn goes on; a context
overflow is recovered once by compaction and replay; nothing sent ever exceeds the window;
the summary keeps its structure and is updated, not redone; the transcript stays whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import BaseModel

from tests.agent.test_randomized_conversations import (
    CHART,
    RecordingStore,
    drain,
    wire_images,
    wire_problems,
    wire_tokens,
)
from tests.scripted_server import (
    HttpError,
    RecordedRequest,
    Reply,
    ScriptedServer,
    Step,
    ToolCall,
    context_overflow,
)
from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.context_budget import SUMMARY_SECTIONS
from trading_agent.agent.context_compressor import (
    FLUSH_NO_OP,
    SUMMARY_HEADER,
    ContextCompressor,
    context_tokens,
    find_cut,
)
from trading_agent.agent.conversation import (
    Conversation,
    ImageBlock,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    estimate_tokens,
)
from trading_agent.agent.event_bus import EventBus, Subscription
from trading_agent.agent.events import (
    CompactionEnded,
    CompactionStarted,
    ContextCleared,
    ErrorEvent,
    Event,
    MemoryFlush,
    ModelRequest,
    OverflowRecovery,
    TextDelta,
    TurnEnded,
    TurnStarted,
)
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.agent.turn_runner import TurnResult
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.errors import BackendError, ContextOverflowError

SYSTEM_PROMPT = "You are the desk alpha. Trade BTC/USDT with care."
SUMMARY_MARK = "You maintain the running summary"
SUMMARY_REPLY = ("## Goal\n- trade BTC/USDT\n## Positions and open orders\n- long 0.1 BTC at "
                 "64000\n## Decisions and why\n- bought the breakout\n## Risks\n- a failed "
                 "retest\n## Next steps\n- watch 65000")
CANDLE = "2024-05-01T00:00 o 64000 h 64100 l 63900 c 64050"


# --------------------------------------------------------------------------- the desk


class CandleArguments(BaseModel):
    count: int


class NoteArguments(BaseModel):
    note: str


def kind_of(body: dict[str, Any]) -> str:
    """Which request this is: the summarizer's, the memory flush's, or the desk's own."""
    messages = body["messages"]
    if str(messages[0]["content"]).startswith(SUMMARY_MARK):
        return "summary"
    if any("[Memory flush]" in str(m.get("content")) for m in messages):
        return "flush"
    return "desk"


@dataclass
class DeskModel:
    """A responder playing the model: summaries and flushes by rule, the desk by ``desk``.

    Every body it receives is checked (pairing, images, size); each answer reports the
    body's size as its usage, the way a real server reports its prompt tokens.
    """

    window: int
    desk: Callable[[dict[str, Any]], Step]
    flush_calls: Sequence[ToolCall] = (ToolCall("remember", {"note": "long 0.1 BTC at 64000"}),)
    kinds: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def __call__(self, request: RecordedRequest) -> Step:
        body = request.json
        self.problems += wire_problems(body, self.window)
        size = wire_tokens(body)
        self.sizes.append(size)
        kind = kind_of(body)
        self.kinds.append(kind)
        usage = (size, 20)
        if kind == "summary":
            return Reply(SUMMARY_REPLY, usage=usage)
        if kind == "flush":
            if body["messages"][-1]["role"] == "tool":
                return Reply(FLUSH_NO_OP, text_chunks=3, usage=usage)
            return Reply(tool_calls=list(self.flush_calls), usage=usage)
        step = self.desk(body)
        return dataclasses.replace(step, usage=usage) if isinstance(step, Reply) else step


def candles_then_answer(count: int, answer: str = "Noted the levels. " * 10
                        ) -> Callable[[dict[str, Any]], Step]:
    """The desk asks for candles, then answers."""

    def desk(body: dict[str, Any]) -> Step:
        if body["messages"][-1]["role"] == "tool":
            return Reply(answer, text_chunks=2)
        return Reply(tool_calls=[ToolCall("get_candles", {"count": count})])

    return desk


@dataclass
class Desk:
    """A desk wired as the daemon wires one, talking to the scripted server."""

    loop: AgentLoop
    conversation: Conversation
    events: Subscription
    store: RecordingStore
    notes: list[str]
    candle_calls: list[int]
    seen: list[Event] = field(default_factory=list)

    async def turn(self, text: str) -> TurnResult:
        return await self.loop.run_turn(self.conversation, Trigger(kind="tick", text=text))

    def drain(self) -> list[Event]:
        self.seen += drain(self.events)
        return self.seen

    def of(self, kind: type[Event]) -> list[Any]:
        return [e for e in self.drain() if isinstance(e, kind)]


def history(count: int, chars: int) -> list[Message]:
    """Older turns restored from the store: ticks and answers of ``chars`` characters."""
    messages = []
    for number in range(count):
        if number % 2 == 0:
            messages.append(Message.user_text(f"tick {number}: " + "x" * chars))
        else:
            messages.append(Message(role="assistant", content=(TextBlock(
                f"answer {number}: " + "y" * chars),)))
    return messages


@contextlib.asynccontextmanager
async def running_desk(server: ScriptedServer, *, window: int, keep_recent: int = 500,
                       summary_max: int = 250, remember: bool = True,
                       messages: Sequence[Message] = (), compress: bool = True,
                       tool_result_max: int | None = None,
                       clear_keep: int | None = None) -> AsyncIterator[Desk]:
    registry = ToolRegistry()
    notes: list[str] = []
    candle_calls: list[int] = []

    @registry.tool(description="Recent candles of BTC/USDT, one a line.")
    async def get_candles(arguments: CandleArguments, context: ToolContext) -> str:
        candle_calls.append(arguments.count)
        return "\n".join(CANDLE for _ in range(arguments.count))

    if remember:
        @registry.tool(description="Saves a note to long-term memory.", name="remember")
        async def remember_note(arguments: NoteArguments, context: ToolContext) -> str:
            notes.append(arguments.note)
            return "saved"

    bus = EventBus()
    store = RecordingStore()
    conversation = Conversation(SYSTEM_PROMPT, messages, observer=store)
    store.appended = list(messages)
    compressor = ContextCompressor(window, keep_recent_tokens=keep_recent,
                                   summary_max_tokens=summary_max,
                                   tool_result_max_tokens=tool_result_max,
                                   clear_keep_rounds=clear_keep) if compress else None
    config = OpenAIBackendConfig(base_url=server.base_url, model="scripted-model",
                                 context_window=window, request_timeout=10)
    async with OpenAICompatibleBackend(config) as backend:
        loop = AgentLoop("alpha", backend, ToolCallExecutor(registry), bus, maximum_rounds=6,
                         compressor=compressor)
        with bus.subscribe("test", max_buffer=100_000) as events:
            yield Desk(loop, conversation, events, store, notes, candle_calls)


def assert_kept_tail(desk: Desk) -> None:
    """In memory, the conversation holds only the stored transcript's tail since the last
    compaction; the store (here its recording) holds every message."""
    kept = [m.id for m in desk.conversation.messages]
    stored = [m.id for m in desk.store.appended]
    assert stored[len(stored) - len(kept):] == kept
    if desk.store.compactions:
        _, first_kept_id = desk.store.compactions[-1]
        assert kept[:1] == ([first_kept_id] if first_kept_id is not None else [])


def text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content)
    return str(content or "")


# --------------------------------------------------------------------------- thresholds


async def test_past_70_percent_a_turn_starts_with_a_silent_flush_then_a_summary(
        scripted_server: ScriptedServer) -> None:
    window = 4000
    model = DeskModel(window, candles_then_answer(25))
    scripted_server.responder = model
    async with running_desk(scripted_server, window=window) as desk:
        for number in range(1, 11):
            result = await desk.turn(f"tick {number}")
            assert not result.hit_round_limit

        assert model.problems == []  # paired, few images, never over the window
        first_flush = model.kinds.index("flush")
        assert model.kinds[first_flush:first_flush + 4] == ["flush", "flush", "summary", "desk"]
        assert model.kinds.count("flush") == 2  # one flush turn (two calls), one cycle
        flush_request = scripted_server.requests[first_flush]
        assert "[Memory flush]" in text_of(flush_request.messages[-1])
        assert "remember" in text_of(flush_request.messages[-1])
        # The flush offers the desk's own tools (the same prompt prefix, cache-friendly).
        assert flush_request.tools == scripted_server.requests[first_flush - 1].tools
        assert desk.notes == ["long 0.1 BTC at 64000"]

        [flush] = desk.of(MemoryFlush)
        assert (flush.tool_calls, flush.no_op) == (1, False)
        [silent] = [e for e in desk.of(TurnStarted) if e.silent]
        assert [e.silent for e in desk.of(TurnEnded) if e.turn == silent.turn] == [True]
        assert not [e for e in desk.of(TextDelta) if e.turn == silent.turn]
        assert [e for e in desk.of(TextDelta) if e.text]  # the desk's own answers stream

        [started] = desk.of(CompactionStarted)
        [ended] = desk.of(CompactionEnded)
        assert started.reason == ended.reason == "threshold"
        assert started.tokens_before >= 0.7 * window
        # Tagged with the turn that found the window full, and counted as pycodeloop does.
        assert (ended.trigger_kind, started.trigger_kind) == ("tick", "tick")
        assert ended.trigger_text == started.trigger_text != ""
        # What is sent: the summarized messages became one summary message.
        assert ended.messages_before == ended.messages_after + ended.messages_summarized - 1
        summary_tokens = estimate_tokens(desk.conversation.summary)  # type: ignore[arg-type]
        assert summary_tokens < ended.tokens_after < 0.7 * window
        events = desk.drain()
        assert events.index(flush) < events.index(started)

        after = scripted_server.requests[first_flush + 3].messages
        assert text_of(after[1]).startswith(SUMMARY_HEADER)
        assert "long 0.1 BTC at 64000" in text_of(after[1])
        assert not any(text_of(m).endswith("\ntick 1") for m in after)
        # The stored transcript is whole, flush turn excluded; in memory, only the messages
        # still sent verbatim are kept.
        transcript = desk.store.appended
        assert transcript[0].text.endswith("tick 1")
        assert not any("[Memory flush]" in m.text for m in transcript)
        [(_, first_kept_id)] = desk.store.compactions
        assert_kept_tail(desk)
        assert desk.conversation.messages[0].id == first_kept_id
        assert len(desk.conversation.messages) < len(transcript)
    scripted_server.assert_complete()


async def test_past_85_percent_mid_turn_it_summarizes_without_flush_and_goes_on(
        scripted_server: ScriptedServer) -> None:
    window = 4000
    model = DeskModel(window, candles_then_answer(115, "Done: the range holds."))
    scripted_server.responder = model
    async with running_desk(scripted_server, window=window, keep_recent=1700,
                            tool_result_max=1500, messages=history(6, 1250)) as desk:
        result = await desk.turn("tick now")

        assert result.text == "Done: the range holds." and result.rounds == 2
        assert model.kinds == ["desk", "summary", "desk"]  # no flush
        assert model.sizes[0] < 0.7 * window
        assert model.problems == []
        [started] = desk.of(CompactionStarted)
        [turn] = desk.of(TurnStarted)
        assert (started.reason, started.turn) == ("mid_turn", turn.turn)
        assert started.tokens_before > 0.85 * window
        assert not desk.of(MemoryFlush) and desk.notes == []
        last = scripted_server.requests[2].messages
        assert text_of(last[1]).startswith(SUMMARY_HEADER)
        assert [m["role"] for m in last[-3:]] == ["user", "assistant", "tool"]
        assert last[-1]["content"].count(CANDLE) == 115  # the round's result, verbatim
        assert model.sizes[2] < model.sizes[0]


async def test_no_request_exceeds_the_window_over_a_long_day(
        scripted_server: ScriptedServer) -> None:
    window = 3000
    model = DeskModel(window, candles_then_answer(30))
    scripted_server.responder = model
    async with running_desk(scripted_server, window=window, keep_recent=600,
                            summary_max=200) as desk:
        for number in range(40):
            await desk.turn(f"tick {number}")
    assert model.problems == []
    assert max(model.sizes) <= window
    assert model.kinds.count("summary") >= 5
    assert model.kinds.count("flush") == 2 * model.kinds.count("summary")
    assert not desk.of(ErrorEvent) and not desk.of(OverflowRecovery)


async def test_many_compactions_keep_the_messages_in_memory_bounded(
        scripted_server: ScriptedServer) -> None:
    window = 3000
    model = DeskModel(window, candles_then_answer(30))
    scripted_server.responder = model
    async with running_desk(scripted_server, window=window, keep_recent=600,
                            summary_max=200) as desk:
        longest = 0
        for number in range(60):
            await desk.turn(f"tick {number}")
            longest = max(longest, len(desk.conversation.messages))
            assert_kept_tail(desk)
        compactions = len(desk.store.compactions)
        assert compactions >= 8
        # Every message of the 60 turns is stored; memory holds a few turns' worth.
        assert len(desk.store.appended) == 60 * 4
        assert longest <= 24
        assert desk.conversation.window_start == 0
        assert desk.conversation.window()[0] is desk.conversation.summary
    assert model.problems == []


# --------------------------------------------------------------------------- clearing


async def test_old_tool_results_are_cleared_before_any_summary_and_kept_in_the_store(
        scripted_server: ScriptedServer) -> None:
    window = 4000
    model = DeskModel(window, candles_then_answer(25))
    scripted_server.responder = model
    async with running_desk(scripted_server, window=window, clear_keep=2) as desk:
        for number in range(1, 13):
            await desk.turn(f"tick {number}")

        assert model.problems == []
        cleared = desk.of(ContextCleared)
        assert cleared and all(c.enough for c in cleared)
        assert all(c.tokens_after < c.tokens_before for c in cleared)
        # Clearing was enough every time: no memory flush, no summary.
        assert "summary" not in model.kinds and "flush" not in model.kinds
        last = scripted_server.requests[-1].messages
        results = [text_of(m) for m in last if m["role"] == "tool"]
        stubs = [r for r in results if r.startswith("[cleared: get_candles(")]
        # The oldest are stubs; the two newest rounds at the clearing, and every round since,
        # are whole.
        assert stubs and results[:len(stubs)] == stubs
        assert all(CANDLE in r for r in results[len(stubs):])
        assert len(results) - len(stubs) >= 2
        assert "the whole result is kept in the desk's store (tool call call_" in stubs[0]
        # The store keeps every result whole.
        stored = [m for m in desk.store.appended if m.kind == "tool_results"]
        assert len(stored) == 12
        assert all(m.tool_results[0].text.count(CANDLE) == 25 for m in stored)


async def test_between_two_clearings_each_request_extends_the_previous_one_byte_for_byte(
        scripted_server: ScriptedServer) -> None:
    window = 4000
    model = DeskModel(window, candles_then_answer(25))
    scripted_server.responder = model
    async with running_desk(scripted_server, window=window, clear_keep=2) as desk:
        for number in range(1, 13):
            await desk.turn(f"tick {number}")
        cleared_at = {e.id for e in desk.of(ContextCleared)}
        assert cleared_at

    bodies = [r.json["messages"] for r in scripted_server.requests]
    breaks = [index for index in range(1, len(bodies))
              if bodies[index][:len(bodies[index - 1])] != bodies[index - 1]]
    # A request changes what came before only where a clearing ran: once per clearing.
    assert len(breaks) == len(cleared_at)


async def test_when_clearing_is_not_enough_the_summary_runs(
        scripted_server: ScriptedServer) -> None:
    window = 4000
    model = DeskModel(window, candles_then_answer(25))
    scripted_server.responder = model
    # Long ticks and no tool round yet: there is nothing to clear.
    async with running_desk(scripted_server, window=window, clear_keep=2,
                            messages=history(14, 900)) as desk:
        await desk.turn("tick now")
        assert not any(cleared.enough for cleared in desk.of(ContextCleared))
        assert model.kinds[:3] == ["flush", "flush", "summary"]


# --------------------------------------------------------------------------- overflow


async def test_a_context_overflow_is_recovered_once_by_compaction_and_replay(
        scripted_server: ScriptedServer) -> None:
    desk_answers = iter([context_overflow(), Reply("Recovered.")])

    def respond(request: RecordedRequest) -> Step:
        # The refusal tells the loop the server counts more than estimated: the summary is
        # written in chunks sized for that, as many as it takes.
        if kind_of(request.json) == "summary":
            return Reply(SUMMARY_REPLY)
        return next(desk_answers)

    scripted_server.responder = respond
    async with running_desk(scripted_server, window=8000, messages=history(8, 800)) as desk:
        result = await desk.turn("tick")
        assert result.text == "Recovered."
        [recovery] = desk.of(OverflowRecovery)
        assert "maximum context length" in recovery.message
        [started] = desk.of(CompactionStarted)
        assert started.reason == "overflow"
        assert not desk.of(ErrorEvent)
    first, *summaries, replay = scripted_server.requests
    assert summaries and all(kind_of(s.json) == "summary" for s in summaries)
    assert text_of(replay.messages[1]).startswith(SUMMARY_HEADER)
    assert wire_tokens(replay.json) < wire_tokens(first.json)
    assert replay.messages[-1] == first.messages[-1]  # the same request, compacted


async def test_an_overflow_that_compacting_cannot_cure_ends_the_turn_with_a_clear_error(
        scripted_server: ScriptedServer) -> None:
    def refuse_all_but_summaries(request: RecordedRequest) -> Step:
        if kind_of(request.json) == "summary":
            return Reply(SUMMARY_REPLY)
        return context_overflow()

    scripted_server.responder = refuse_all_but_summaries
    async with running_desk(scripted_server, window=8000, messages=history(8, 800)) as desk:
        with pytest.raises(ContextOverflowError, match="still too long after compacting 3 "):
            await desk.turn("tick")
        [error] = desk.of(ErrorEvent)
        assert error.error_type == "ContextOverflowError"
        assert "8000-token window" in error.message
        # Each replay compacts harder: the server is told less each time.
        assert len(desk.of(OverflowRecovery)) == 3
        desk_requests = [r for r in scripted_server.requests if kind_of(r.json) != "summary"]
        sizes = [wire_tokens(r.json) for r in desk_requests]
        assert len(sizes) == 4 and sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0]
        # The conversation is still valid: the next turn goes through.
        scripted_server.responder = None
        scripted_server.add(Reply("Fine again."))
        assert (await desk.turn("tick")).text == "Fine again."


async def test_pictures_the_model_has_not_answered_are_pruned_harder_after_an_overflow(
        scripted_server: ScriptedServer) -> None:
    """A turn that ended on the round limit with three charts unread, then an operator's
    screenshot: nothing is old enough to summarize, and four pictures do not fit a small
    window. The replay sends fewer pictures (the oldest as placeholders), and the desk
    answers instead of refusing this turn and every later one (found by hypothesis)."""
    window = 3500
    charts = [ImageBlock(CHART.data, CHART.media_type, f"chart {n} of BTC/USDT")
              for n in (1, 2, 3)]
    calls = tuple(ToolUseBlock(f"c{n}", "get_chart", '{"symbol": "BTC/USDT"}')
                  for n in (1, 2, 3))
    unread = [Message(role="assistant", content=calls),
              Message(role="user", kind="tool_results", content=tuple(
                  ToolResultBlock(call.id, (TextBlock("chart attached"), chart))
                  for call, chart in zip(calls, charts, strict=True)))]
    refused: list[int] = []

    def respond(request: RecordedRequest) -> Step:
        if kind_of(request.json) == "summary":
            return Reply(SUMMARY_REPLY)
        if wire_tokens(request.json) > window:
            refused.append(wire_images(request.json))
            return context_overflow()
        return Reply(f"I see {wire_images(request.json)} pictures.")

    scripted_server.responder = respond
    screenshot = ImageBlock(CHART.data, CHART.media_type, "operator screenshot")
    async with running_desk(scripted_server, window=window, messages=unread) as desk:
        result = await desk.loop.run_turn(desk.conversation, Trigger(
            kind="operator", text="What do you make of this? " + "z" * 1200, source="ana",
            images=(screenshot,)))
        assert refused == [4]
        assert result.text == "I see 2 pictures."
        assert len(desk.of(OverflowRecovery)) == 1
        assert not desk.of(ErrorEvent)
        replay = scripted_server.requests[-1]
        sent = " ".join(text_of(m) for m in replay.messages)
        assert "[image removed to save space: chart 1 of BTC/USDT]" in sent
        assert "[image removed to save space: chart 2 of BTC/USDT]" in sent
        # The operator's screenshot, the newest, is still sent; the store keeps all four.
        assert replay.messages[-1]["content"][-1]["type"] == "image_url"
        assert sum(m.image_count for m in desk.store.appended) == 4
        # The next turn is answered too, with no refusal.
        assert (await desk.turn("tick")).text == "I see 2 pictures."
        assert refused == [4]


async def test_without_a_compressor_an_overflow_is_an_error_at_once(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(context_overflow())
    async with running_desk(scripted_server, window=8000, compress=False,
                            messages=history(4, 100)) as desk:
        with pytest.raises(ContextOverflowError, match="nothing left to compact"):
            await desk.turn("tick")
        assert [e.error_type for e in desk.of(ErrorEvent)] == ["ContextOverflowError"]
    assert len(scripted_server.requests) == 1


# --------------------------------------------------------------------------- the summary


async def test_a_later_compaction_updates_the_previous_summary(
        scripted_server: ScriptedServer) -> None:
    first_summary = "## Goal\n- trade BTC/USDT\n## Positions and open orders\n- none yet"
    pad = " " + "r" * 100
    scripted_server.add(Reply("Answer one, about the range." + pad), Reply("Answer two." + pad),
                        Reply(first_summary),
                        Reply("Answer three, bought 0.1 BTC." + pad), Reply("Answer four." + pad),
                        Reply(SUMMARY_REPLY), Reply("Answer five."))
    command = Trigger(kind="command", text="/compact")
    async with running_desk(scripted_server, window=8000, keep_recent=40,
                            remember=False) as desk:
        await desk.turn("tick one")
        await desk.turn("tick two")
        assert await desk.loop.compact(desk.conversation, command)
        await desk.turn("tick three")
        await desk.turn("tick four")
        assert await desk.loop.compact(desk.conversation, command)
        await desk.turn("tick five")
    first, second = (r for r in scripted_server.requests if kind_of(r.json) == "summary")
    assert first.json["max_tokens"] == 250
    prompt = text_of(second.messages[1])
    assert f"Previous summary:\n{first_summary}" in prompt
    assert "Answer three, bought 0.1 BTC." in prompt
    assert "Answer one" not in prompt  # already in the previous summary
    # The first summary lacked three headings: they were added, in the fixed structure.
    sent = text_of(scripted_server.requests[3].messages[1])
    assert all(f"## {name}" in sent for name in SUMMARY_SECTIONS)
    assert "## Risks\n- (nothing noted)" in sent
    final = text_of(scripted_server.requests[-1].messages[1])
    assert final == SUMMARY_HEADER + SUMMARY_REPLY
    scripted_server.assert_complete()


async def test_the_summary_request_is_chunked_to_fit_the_window(
        scripted_server: ScriptedServer) -> None:
    window = 3000
    replies: list[str] = []

    def summarize(request: RecordedRequest) -> Step:
        replies.append(f"## Goal\n- chunk {len(replies) + 1} read")
        return Reply(replies[-1], usage=(wire_tokens(request.json), 20))

    scripted_server.responder = summarize
    async with running_desk(scripted_server, window=window, keep_recent=100,
                            summary_max=150, remember=False,
                            messages=history(40, 1000)) as desk:
        assert await desk.loop.compact(desk.conversation, Trigger(kind="command", text="/c"))
        summary = desk.conversation.summary
    requests = scripted_server.requests
    assert len(requests) >= 3
    for number, request in enumerate(requests):
        assert wire_problems(request.json, window) == []  # prompt plus answer cap fit
        if number:
            assert f"Previous summary:\n{replies[number - 1]}" in text_of(request.messages[1])
    assert summary is not None and f"chunk {len(requests)} read" in summary.text


async def test_a_summary_chunk_the_server_refuses_as_too_long_is_halved(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(context_overflow(), Reply("## Goal\n- first half"),
                        Reply("## Goal\n- both halves"))
    async with running_desk(scripted_server, window=8000, keep_recent=30, remember=False,
                            messages=history(10, 600)) as desk:
        assert await desk.loop.compact(desk.conversation, Trigger(kind="command", text="/c"))
        assert desk.conversation.summary is not None
        assert "both halves" in desk.conversation.summary.text
    whole, first, second = (len(text_of(r.messages[1])) for r in scripted_server.requests)
    assert first < whole and second < whole
    assert "first half" in text_of(scripted_server.requests[2].messages[1])


async def test_a_huge_tool_result_is_cut_in_what_is_sent_but_kept_whole(
        scripted_server: ScriptedServer) -> None:
    window = 8000
    model = DeskModel(window, candles_then_answer(4000, "Too much data; noted the trend."))
    scripted_server.responder = model
    async with running_desk(scripted_server, window=window, keep_recent=1000) as desk:
        result = await desk.turn("tick")
        assert result.text == "Too much data; noted the trend."
        stored = next(m for m in desk.conversation.messages if m.kind == "tool_results")
        assert stored.tool_results[0].text.count(CANDLE) == 4000
    sent = scripted_server.requests[-1].messages[-1]
    assert sent["role"] == "tool"
    assert len(sent["content"]) < 2_300
    assert "characters of this result were cut here" in sent["content"]
    assert sent["content"].startswith(CANDLE) and sent["content"].endswith(CANDLE)
    assert model.problems == []


async def test_one_answer_with_huge_tool_arguments_never_wedges_the_desk(
        scripted_server: ScriptedServer) -> None:
    """A model answer whose tool-call arguments are 200 KB: the turn, later turns, a
    /compact and a restart all fit a 32,000-token window (the server refuses what does not),
    and the store keeps the arguments whole."""
    window = 32_000
    padding = "x" * 200_000

    def desk(body: dict[str, Any]) -> Step:
        if wire_tokens(body) > window:
            return context_overflow()
        last = body["messages"][-1]
        if last["role"] == "tool":
            return Reply("The ticker call was odd; BTC looks flat.")
        if "first" in text_of(last):
            return Reply(tool_calls=[ToolCall("get_candles", {"count": 2, "note": padding})])
        return Reply("OK.")

    model = DeskModel(window, desk)
    scripted_server.responder = model
    async with running_desk(scripted_server, window=window,
                            messages=history(10, 600)) as desk_:
        first = await desk_.turn("first tick")
        assert first.text == "The ticker call was odd; BTC looks flat."
        for number in range(3):
            assert (await desk_.turn(f"tick {number} " + "z" * 1500)).text == "OK."
        assert await desk_.loop.compact(desk_.conversation, Trigger(kind="command", text="/c"))
        assert (await desk_.turn("after compact")).text == "OK."
        stored = desk_.store.appended
        call = next(b for m in stored for b in m.tool_uses)
        assert padding in call.arguments
    async with running_desk(scripted_server, window=window,
                            messages=stored) as restarted:
        assert (await restarted.turn("after restart")).text == "OK."
    sent_calls = [call["function"] for request in scripted_server.requests
                  for message in request.messages for call in message.get("tool_calls") or ()
                  if call["function"]["name"] == "get_candles"]
    assert sent_calls, "the call was never sent back"
    for sent_call in sent_calls:
        assert "200,0" in sent_call["arguments"] and len(sent_call["arguments"]) < 300
    assert max(model.sizes) < window
    assert model.problems == []


# --------------------------------------------------------------------------- the flush


async def test_without_a_remember_tool_there_is_no_flush(
        scripted_server: ScriptedServer) -> None:
    window = 4000
    model = DeskModel(window, candles_then_answer(25))
    scripted_server.responder = model
    async with running_desk(scripted_server, window=window, remember=False) as desk:
        for number in range(10):
            await desk.turn(f"tick {number}")
        assert "summary" in model.kinds and "flush" not in model.kinds
        assert not desk.of(MemoryFlush)
        assert not [e for e in desk.of(TurnStarted) if e.silent]


async def test_the_flush_runs_only_the_memory_tool(scripted_server: ScriptedServer) -> None:
    model = DeskModel(8000, candles_then_answer(5), flush_calls=(
        ToolCall("get_candles", {"count": 3}), ToolCall("remember", {"note": "flat"})))
    scripted_server.responder = model
    async with running_desk(scripted_server, window=8000, keep_recent=30,
                            messages=history(6, 200)) as desk:
        assert await desk.loop.compact(desk.conversation, Trigger(kind="command", text="/c"))
        assert desk.candle_calls == [] and desk.notes == ["flat"]
        [flush] = desk.of(MemoryFlush)
        assert flush.tool_calls == 2
    assert model.kinds == ["flush", "flush", "summary"]
    refused = scripted_server.requests[1].messages[-2]
    assert refused["role"] == "tool" and "no tool named 'get_candles'" in refused["content"]


async def test_at_most_one_flush_per_compaction_cycle(scripted_server: ScriptedServer) -> None:
    flush = [Reply(tool_calls=[ToolCall("remember", {"note": "n"})]), Reply(FLUSH_NO_OP)]
    scripted_server.add(*flush, HttpError(400, "the summarizer is broken", "invalid_request_error"))
    command = Trigger(kind="command", text="/compact")
    async with running_desk(scripted_server, window=8000, keep_recent=30,
                            messages=history(6, 200)) as desk:
        with pytest.raises(BackendError, match="the summarizer is broken"):
            await desk.loop.compact(desk.conversation, command)
        assert desk.conversation.summary is None  # nothing changed
        scripted_server.add(Reply(SUMMARY_REPLY))  # the same cycle: no second flush
        assert await desk.loop.compact(desk.conversation, command)
        scripted_server.add(Reply("ok"))
        await desk.turn("tick")
    assert [kind_of(r.json) for r in scripted_server.requests] == [
        "flush", "flush", "summary", "summary", "desk"]
    assert desk.notes == ["n"]


async def test_a_new_cycle_flushes_again(scripted_server: ScriptedServer) -> None:
    model = DeskModel(8000, lambda body: Reply("Answer " + "z" * 400))
    scripted_server.responder = model
    command = Trigger(kind="command", text="/compact")
    async with running_desk(scripted_server, window=8000, keep_recent=30,
                            messages=history(6, 200)) as desk:
        assert await desk.loop.compact(desk.conversation, command)
        for number in range(3):
            await desk.turn(f"tick {number}")
        assert await desk.loop.compact(desk.conversation, command)
    assert model.kinds == ["flush", "flush", "summary", "desk", "desk", "desk",
                           "flush", "flush", "summary"]


async def test_compact_says_false_without_a_compressor_or_anything_to_compress(
        scripted_server: ScriptedServer) -> None:
    command = Trigger(kind="command", text="/compact")
    async with running_desk(scripted_server, window=8000, compress=False,
                            messages=history(10, 500)) as desk:
        assert await desk.loop.compact(desk.conversation, command) is False
    async with running_desk(scripted_server, window=8000, messages=history(2, 50)) as desk:
        assert await desk.loop.compact(desk.conversation, command) is False  # all recent
        assert not desk.drain()
    assert scripted_server.requests == []


# --------------------------------------------------------------------------- measuring


async def test_the_size_is_the_reported_usage_plus_estimates_of_newer_messages(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("get_candles", {"count": 3})],
                              usage=(1234, 7)), Reply("ok", usage=(1400, 1)))
    async with running_desk(scripted_server, window=8000) as desk:
        await desk.turn("tick")
        first, second = desk.of(ModelRequest)
        call, results = desk.conversation.messages[1:3]
        # The server counted 1234 where the estimate said less: later estimates are scaled.
        scale = 0.5 + 0.5 * 1234 / first.estimated_tokens
        assert second.estimated_tokens == 1234 + math.ceil(
            (estimate_tokens(call) + estimate_tokens(results)) * min(scale, 16.0))
        assert desk.conversation.reported_input_tokens == 1400


def test_context_tokens_counts_only_messages_added_since_the_report() -> None:
    conversation = Conversation("s", [Message.user_text("a" * 400), Message.user_text("b")])
    assert context_tokens(conversation, lambda: 999) == 999  # nothing reported yet
    conversation.note_reported_usage(500, 2)
    conversation.messages.append(Message.user_text("c" * 400))
    assert context_tokens(conversation, lambda: 999) == 500 + 104


def test_find_cut_keeps_a_call_with_its_results_and_always_makes_progress() -> None:
    call = Message(role="assistant", content=(ToolUseBlock("c1", "get_candles", "{}"),))
    results = Message(role="user", kind="tool_results", content=(
        ToolResultBlock("c1", (TextBlock("r" * 400),)),))
    messages = [Message.user_text("a" * 400), call, results]
    assert find_cut(messages, estimate_tokens(results)) == 1  # pulled back to the call
    assert find_cut(messages, 10_000) == 0  # everything fits: nothing to summarize
    assert find_cut(messages, 10) == 1  # not even the newest fits: all the model answered


@pytest.mark.parametrize("arguments", [
    {"flush_threshold": 0.9, "hard_threshold": 0.8},
    {"keep_recent_tokens": 3000, "summary_max_tokens": 1200},
    {"keep_recent_tokens": 1990},
    {"flush_max_rounds": 0},
])
def test_settings_that_cannot_work_are_refused(arguments: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ContextCompressor(4000, **arguments)


def test_the_summary_budget_shrinks_to_what_a_small_window_leaves() -> None:
    # Half the window less the recent messages, and room for a summary request's chunk.
    assert ContextCompressor(4000, summary_max_tokens=1900,
                             keep_recent_tokens=10).summary_max_tokens < 1900
    small = ContextCompressor(2048)
    assert small.keep_recent_tokens + small.summary_max_tokens <= 1024
    assert ContextCompressor(128_000).summary_max_tokens == 1200
    # At compaction time, a large fixed part (system prompt and tools) shrinks both again.
    keep, summary = small.budgets(fixed_tokens=900, keep_recent_tokens=small.keep_recent_tokens)
    assert keep + summary + 900 <= 0.9 * 2048
