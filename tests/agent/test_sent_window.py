"""The loop's incremental window is, message for message, the whole pipeline run afresh; what
an earlier request sent never changes under it, though it shares the window's list."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.agent.test_image_preparer import chart
from trading_agent.agent.context_compressor import ContextCompressor
from trading_agent.agent.conversation import (
    Conversation,
    ImageBlock,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    estimate_tokens,
)
from trading_agent.agent.image_preparer import ImageLimits, ImagePreparer
from trading_agent.agent.sent_window import SentWindow, prepare_window
from trading_agent.agent.shared_messages import starts_with

PICTURE = ImageBlock(chart(60, 40), description="a chart")

operations = st.lists(st.one_of(
    st.tuples(st.just("user"), st.integers(1, 3000)),
    st.tuples(st.just("calls"), st.integers(1, 3)),
    st.tuples(st.just("results"), st.integers(0, 4000)),
    st.tuples(st.just("picture"), st.integers(0, 1)),
    st.tuples(st.just("answer"), st.integers(1, 200)),
    st.tuples(st.just("compact"), st.integers(0, 10)),
    st.tuples(st.just("clear"), st.integers(0, 4)),
    st.tuples(st.just("scale"), st.sampled_from([0.7, 1.0, 1.3, 2.5])),
    st.tuples(st.just("replay"), st.just(0)),
    st.tuples(st.just("chart"), st.integers(0, 400)),
    st.tuples(st.just("limit"), st.integers(0, 4)),  # an overflow lowered the pictures sent
), min_size=1, max_size=40)


def _shape(messages: list[Message]) -> list[tuple[object, ...]]:
    return [(m.role, m.kind, m.id, m.content) for m in messages]


@settings(max_examples=150, deadline=None)
@given(steps=operations, keep_images=st.integers(1, 4))
async def test_the_incremental_window_equals_the_whole_pipeline(
        steps: list[tuple[str, float]], keep_images: int) -> None:
    compressor = ContextCompressor(4000, keep_recent_tokens=400, clear_keep_rounds=1)
    preparer = ImagePreparer(ImageLimits(keep=keep_images))
    window = SentWindow(compressor, preparer)
    conversation = Conversation("system")
    calls: list[ToolUseBlock] = []
    sent: list[tuple[Sequence[Message], list[Message]]] = []
    for number, (kind, size) in enumerate(steps):
        if kind == "user":
            await conversation.append(Message.user_text("u" * int(size), kind="operator"))
        elif kind == "calls":
            calls = [ToolUseBlock(f"c{number}-{i}", "get_candles", "{}") for i in range(
                int(size))]
            await conversation.append(Message(role="assistant", content=tuple(calls)))
        elif kind in ("results", "picture") and calls:
            extra = (PICTURE,) if kind == "picture" else ()
            await conversation.append(Message(role="user", kind="tool_results", content=tuple(
                ToolResultBlock(call.id, (TextBlock("r" * int(size)), *extra))
                for call in calls)))
            calls = []
        elif kind == "chart":  # a call and its result with a picture, at once
            call = ToolUseBlock(f"chart-{number}", "render_chart", "{}")
            await conversation.append(Message(role="assistant", content=(call,)))
            await conversation.append(Message(role="user", kind="tool_results", content=(
                ToolResultBlock(call.id, (TextBlock("c" * int(size)), PICTURE)),)))
        elif kind == "answer":
            await conversation.append(Message(role="assistant",
                                              content=(TextBlock("a" * int(size)),)))
        elif kind == "compact" and conversation.messages:
            cut = min(int(size), len(conversation.messages))
            while 0 < cut < len(conversation.messages) and \
                    conversation.messages[cut].kind == "tool_results":
                cut -= 1
            await conversation.compact(Message.user_text(f"summary {number}", kind="summary"),
                                       cut)
        elif kind == "clear":
            compressor.clear(conversation, keep=int(size))
        elif kind == "scale":
            conversation.token_scale = float(size)
        elif kind == "limit":
            conversation.picture_limit = int(size)
        elif kind == "replay" and conversation.messages:
            conversation.messages.append(conversation.messages.pop())

        prepared = window.build(conversation)
        expected = prepare_window(conversation, compressor, preparer)
        assert _shape(prepared.messages) == _shape(expected)
        assert prepared.tokens == sum(estimate_tokens(m) for m in expected)
        assert prepared.images == sum(m.image_count for m in expected)
        limit = conversation.picture_limit
        assert prepared.images <= (keep_images if limit is None else min(limit, keep_images))
        if sent:  # what the backend's memo of the last request asks
            last = sent[-1][0]
            same_start = (len(last) <= len(prepared.messages) and all(
                a is b for a, b in zip(last, prepared.messages, strict=False)))
            assert starts_with(prepared.messages, last) is same_start
        sent.append((prepared.messages, list(prepared.messages)))
        for messages, as_sent in sent:  # an earlier request still holds what it sent
            assert len(messages) == len(as_sent)
            assert all(a is b for a, b in zip(messages, as_sent, strict=True))


class _CountingCompressor(ContextCompressor):
    """Counts the messages passed through the cut."""

    trimmed = 0

    def trim(self, messages, scale=1.0):  # type: ignore[no-untyped-def]
        self.trimmed += len(messages)
        return super().trim(messages, scale)


async def test_a_moved_token_scale_cuts_again_only_the_messages_long_enough_to_be_cut() -> None:
    compressor = _CountingCompressor(32_000, tool_result_max_tokens=100)
    window = SentWindow(compressor, ImagePreparer())
    conversation = Conversation("You run a desk.")
    for number in range(200):  # short ticks and answers, one long tool result in ten
        call = ToolUseBlock(f"call-{number}", "get_ticker", "{}")
        await conversation.append(Message.user_text(f"tick {number}"))
        await conversation.append(Message(role="assistant", content=(call,)))
        text = "r" * (2_000 if number % 10 == 0 else 50)
        await conversation.append(Message(role="user", kind="tool_results", content=(
            ToolResultBlock(call.id, (TextBlock(text),)),)))
    window.build(conversation)
    compressor.trimmed = 0

    conversation.token_scale = 2.5  # calibrated after a restart: messages may be shorter
    prepared = window.build(conversation)

    assert compressor.trimmed <= 20, f"{compressor.trimmed} messages cut again, not the 20 long"
    expected = prepare_window(conversation, compressor, ImagePreparer())
    assert _shape(prepared.messages) == _shape(expected)
    assert prepared.tokens == sum(estimate_tokens(m) for m in expected)
