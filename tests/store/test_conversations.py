"""Conversations: written as they grow, restored after a restart, a cut-off turn repaired."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import anyio

from tests.store.conftest import FakeClock
from trading_agent.agent.conversation import (
    Conversation,
    ImageBlock,
    Message,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    repair,
)
from trading_agent.store import INTERRUPTED_NOTICE, Store, StoreTarget
from trading_agent.store.database import Database
from trading_agent.tools.delegate import SubagentLink

PNG = b"\x89PNG\r\n\x1a\n" + b"chart-bytes" * 10


def _call(call_id: str = "call_1", name: str = "get_ticker") -> Message:
    return Message(role="assistant", content=(
        TextBlock("Let me look."), ToolUseBlock(id=call_id, name=name,
                                                arguments='{"symbol": "BTC/USDT"}')))


def _results(call_id: str = "call_1", text: str = "BTC/USDT last 64000") -> Message:
    return Message(role="user", kind="tool_results", content=(
        ToolResultBlock(tool_use_id=call_id, content=(
            TextBlock(text), ImageBlock(PNG, description="1h chart"))),))


def _answer(text: str = "Holding.") -> Message:
    return Message(role="assistant", content=(TextBlock(text),))


async def _reopen(store: Store, clock: FakeClock) -> Store:
    await store.close()
    return await Store.open(store.target, clock=clock)


def _same(a: Message, b: Message) -> bool:
    return (a.role, a.kind, a.id, a.content, a.created_at) == (
        b.role, b.kind, b.id, b.content, b.created_at)


async def test_messages_are_written_as_appended_and_restored_exactly(
        store: Store, clock: FakeClock) -> None:
    conversation = Conversation("You trade.", observer=store.transcripts.observer("alpha"))
    made = [Message.user_text("[tick] BTC moved 1%"), _call(), _results(), _answer()]
    for message in made:
        await conversation.append(message)
        # Each message is in the file before append returns: a reader sees it at once.
        assert (await store.transcripts.transcript("alpha"))[-1]["id"] == message.id

    store = await _reopen(store, clock)
    try:
        restored = await store.transcripts.restore_conversation("alpha", "You trade (new prompt).")
        assert restored.system_prompt == "You trade (new prompt)."
        assert len(restored.messages) == len(made)
        assert all(_same(a, b) for a, b in zip(restored.messages, made, strict=True))
        image = restored.messages[2].tool_results[0].content[1]
        assert isinstance(image, ImageBlock) and image.data == PNG
        assert image.description == "1h chart"
        # Restored, it stores itself: a new message lands after the others.
        await restored.append(Message.user_text("[schedule] check"))
        page = await store.transcripts.transcript("alpha")
        assert [row["text"] for row in page][-1] == "[schedule] check"
        assert [row["seq"] for row in page] == sorted(row["seq"] for row in page)
    finally:
        await store.close()


async def test_appending_the_same_message_twice_stores_it_once(store: Store) -> None:
    message = Message.user_text("hello", kind="operator")
    assert await store.transcripts.append_message("alpha", message) == message.id
    assert await store.transcripts.append_message("alpha", message) == message.id
    assert len(await store.transcripts.transcript("alpha")) == 1


async def test_a_reused_id_with_other_content_is_kept_under_a_new_id(store: Store) -> None:
    # Some local models number tool calls call_0, call_1... in every turn, so the loop's
    # repair messages ("repair-call_0") can repeat; neither may be lost.
    first = Message(role="user", kind="tool_results", id="repair-call_0",
                    content=(TextBlock("first"),))
    second = Message(role="user", kind="tool_results", id="repair-call_0",
                     content=(TextBlock("second"),))
    await store.transcripts.append_message("alpha", first)
    stored = await store.transcripts.append_message("alpha", second)
    assert stored != "repair-call_0" and stored.startswith("repair-call_0~")
    assert [row["text"] for row in await store.transcripts.transcript("alpha")] == [
        "first", "second"]


async def test_the_same_id_on_two_desks_is_two_messages(store: Store) -> None:
    await store.transcripts.append_message("alpha", Message.user_text("a", kind="trigger"))
    shared = Message(role="user", kind="trigger", id="same", content=(TextBlock("x"),))
    await store.transcripts.append_message("alpha", shared)
    await store.transcripts.append_message("beta", shared)
    assert len(await store.transcripts.transcript("alpha")) == 2
    assert len(await store.transcripts.transcript("beta")) == 1


async def test_restore_starts_from_the_latest_compaction(store: Store, clock: FakeClock) -> None:
    conversation = Conversation("p", observer=store.transcripts.observer("alpha"))
    old = [Message.user_text(f"old {i}") for i in range(4)]
    for message in old:
        await conversation.append(message)
        await conversation.append(_answer(f"answer {message.text}"))
    first_summary = Message(role="user", kind="summary", content=(TextBlock("summary one"),))
    await conversation.compact(first_summary, 2)
    second_summary = Message(role="user", kind="summary", content=(TextBlock("summary two"),))
    await conversation.compact(second_summary, 4)  # the first compaction dropped two
    kept = list(conversation.messages)
    assert len(kept) == 2  # in memory, only what is still sent

    store = await _reopen(store, clock)
    try:
        restored = await store.transcripts.restore_conversation("alpha", "p")
        assert restored.summary is not None and _same(restored.summary, second_summary)
        assert all(_same(a, b) for a, b in zip(restored.messages, kept, strict=True))
        assert len(restored.messages) == len(kept)
        assert [m.id for m in restored.window()] == [second_summary.id, *(m.id for m in kept)]
        # The full transcript is still there for operators.
        assert len(await store.transcripts.transcript("alpha", limit=100)) == 8
    finally:
        await store.close()


async def test_a_compaction_of_everything_restores_only_the_summary(
        store: Store, clock: FakeClock) -> None:
    conversation = Conversation("p", observer=store.transcripts.observer("alpha"))
    await conversation.append(Message.user_text("hi"))
    await conversation.append(_answer())
    summary = Message(role="user", kind="summary", content=(TextBlock("all of it"),))
    await conversation.compact(summary, 2)
    await store.transcripts.append_message("beta", Message.user_text("another desk"))

    restored = await store.transcripts.restore_conversation("alpha", "p")
    assert restored.messages == []
    assert restored.summary is not None and restored.summary.text == "all of it"


async def test_a_turn_cut_off_after_a_tool_call_is_repaired_and_the_desk_told(
        store: Store, clock: FakeClock) -> None:
    conversation = Conversation("p", observer=store.transcripts.observer("alpha"))
    await conversation.append(Message.user_text("[tick] moved"))
    await conversation.append(_call("call_7", "place_order"))  # then the power went out

    store = await _reopen(store, clock)
    try:
        restored = await store.transcripts.restore_conversation("alpha", "p")
        kinds = [m.kind for m in restored.messages]
        assert kinds == ["trigger", "assistant", "tool_results", "notice"]
        result = restored.messages[2].tool_results[0]
        assert result.tool_use_id == "call_7" and result.is_error
        assert "interrupted" in result.text and "may or may not have taken effect" in result.text
        assert restored.messages[3].text == INTERRUPTED_NOTICE
        # The next request is valid as it stands.
        assert repair(restored.window()) == restored.window()

        # The repair and the notice were stored: a second restart changes nothing.
        store = await _reopen(store, clock)
        again = await store.transcripts.restore_conversation("alpha", "p")
        assert [m.id for m in again.messages] == [m.id for m in restored.messages]
        assert [m.kind for m in again.messages] == kinds
    finally:
        await store.close()


async def test_a_turn_cut_off_after_its_tool_results_tells_the_desk(store: Store) -> None:
    conversation = Conversation("p", observer=store.transcripts.observer("alpha"))
    for message in (Message.user_text("go"), _call(), _results()):
        await conversation.append(message)
    restored = await store.transcripts.restore_conversation("alpha", "p")
    assert [m.kind for m in restored.messages] == ["trigger", "assistant", "tool_results",
                                                   "notice"]


async def test_an_unanswered_operator_message_is_a_cut_off_turn(store: Store) -> None:
    conversation = Conversation("p", observer=store.transcripts.observer("alpha"))
    await conversation.append(Message.user_text("sell half", kind="operator"))
    restored = await store.transcripts.restore_conversation("alpha", "p")
    assert [m.kind for m in restored.messages] == ["operator", "notice"]


async def test_the_notice_says_why_when_told_and_a_later_reason_adds_nothing(
        store: Store) -> None:
    conversation = Conversation("p", observer=store.transcripts.observer("alpha"))
    for message in (Message.user_text("go"), _call(), _results()):
        await conversation.append(message)

    restored = await store.transcripts.restore_conversation(
        "alpha", "p", reason="the model was unavailable: overloaded (HTTP 503)")
    notice = restored.messages[-1]
    assert notice.kind == "notice"
    assert notice.text == (f"{INTERRUPTED_NOTICE}\n"
                           "Why it stopped: the model was unavailable: overloaded (HTTP 503)")

    # Another failure before the model answered: the stored notice stays the only one.
    again = await store.transcripts.restore_conversation(
        "alpha", "p", reason="the model was unavailable: bad gateway (HTTP 502)")
    assert [m.id for m in again.messages] == [m.id for m in restored.messages]
    transcript = await store.transcripts.transcript("alpha")
    assert [row["text"] for row in transcript if row["kind"] == "notice"] == [notice.text]


async def test_a_finished_turn_gets_no_notice(store: Store) -> None:
    conversation = Conversation("p", observer=store.transcripts.observer("alpha"))
    for message in (Message.user_text("go"), _call(), _results(), _answer()):
        await conversation.append(message)
    restored = await store.transcripts.restore_conversation("alpha", "p")
    assert [m.kind for m in restored.messages][-1] == "assistant"
    assert len(await store.transcripts.transcript("alpha")) == 4


async def test_a_turn_that_ended_at_its_round_limit_gets_no_notice(
        store: Store, clock: FakeClock) -> None:
    conversation = Conversation("p", observer=store.transcripts.observer("alpha"))
    conversation.turn_id = "t1"
    for message in (Message.user_text("go"), _call(), _results()):
        await conversation.append(message)
    await store.transcripts.record_turn_end("alpha", "t1", "round_limit")
    # The next turn's silent memory flush began, and the daemon stopped during it: its
    # messages are never stored, so the conversation still ends with that turn.
    restored = await store.transcripts.restore_conversation("alpha", "p")
    assert [m.kind for m in restored.messages][-1] == "tool_results"


async def test_a_turn_without_an_end_gets_a_notice_and_is_recorded_cut_off(
        store: Store) -> None:
    conversation = Conversation("p", observer=store.transcripts.observer("alpha"))
    conversation.turn_id = "t1"
    for message in (Message.user_text("go"), _call(), _results()):
        await conversation.append(message)
    restored = await store.transcripts.restore_conversation("alpha", "p")
    assert restored.messages[-1].kind == "notice"
    assert await store.transcripts.turn_end("alpha", "t1") == "cut_off"
    again = await store.transcripts.restore_conversation("alpha", "p")  # no second notice
    assert [m.id for m in again.messages] == [m.id for m in restored.messages]


async def test_a_turn_stopped_for_shutdown_gets_a_notice(store: Store) -> None:
    conversation = Conversation("p", observer=store.transcripts.observer("alpha"))
    conversation.turn_id = "t1"
    for message in (Message.user_text("go"), _call(), _results()):
        await conversation.append(message)
    await store.transcripts.record_turn_end("alpha", "t1", "stopped")
    restored = await store.transcripts.restore_conversation("alpha", "p")
    assert restored.messages[-1].kind == "notice"


async def test_an_empty_desk_restores_to_an_empty_conversation(store: Store) -> None:
    restored = await store.transcripts.restore_conversation("new", "p")
    assert restored.messages == [] and restored.summary is None
    assert await store.transcripts.transcript("new") == []


async def test_transcript_pages_back_and_shows_images_by_reference(store: Store) -> None:
    for i in range(5):
        await store.transcripts.append_message("alpha", Message.user_text(f"m{i}"))
    await store.transcripts.append_message("alpha", _results())
    newest = await store.transcripts.transcript("alpha", limit=3)
    assert [row["text"] for row in newest[:2]] == ["m3", "m4"]
    older = await store.transcripts.transcript("alpha", before_seq=newest[0]["seq"], limit=10)
    assert [row["text"] for row in older] == ["m0", "m1", "m2"]
    picture = newest[-1]["content"][0]["content"][1]
    assert picture["type"] == "image" and picture["size"] == len(PNG)
    assert "data" not in picture
    assert await store.images.image(picture["sha256"]) == ("image/png", PNG)
    assert await store.images.image("0" * 64) is None


async def test_a_subagents_messages_are_linked_to_the_parent_call(store: Store) -> None:
    link = SubagentLink(desk="alpha", subagent_id="sub1", parent_turn="t1",
                        parent_call_id="call_9", task="Research ETH", tools=("get_ticker",))
    observer = await store.transcripts.observer_for(link)
    sub = Conversation("research", observer=observer)
    await sub.append(Message.user_text("Research ETH", kind="trigger"))
    await sub.append(_answer("ETH looks weak."))
    await store.transcripts.append_message("alpha", Message.user_text("desk message"))

    everything = await store.transcripts.transcript("alpha")
    assert [(row["subagent"], row["parent_call"]) for row in everything] == [
        ("sub1", "call_9"), ("sub1", "call_9"), (None, None)]
    only_desk = await store.transcripts.transcript("alpha", include_subagents=False)
    assert [row["text"] for row in only_desk] == ["desk message"]
    # A subagent's messages never leak into the desk's restored conversation.
    restored = await store.transcripts.restore_conversation("alpha", "p")
    assert restored.messages[0].text == "desk message"


async def test_the_file_is_in_wal_mode(db_path: Path) -> None:
    async with await Store.open(db_path):
        def mode() -> str:
            connection = sqlite3.connect(db_path)
            try:
                return str(connection.execute("PRAGMA journal_mode").fetchone()[0])
            finally:
                connection.close()

        assert await anyio.to_thread.run_sync(mode) == "wal"


async def test_the_migrations_are_recorded_and_applied_once(target: StoreTarget) -> None:
    async def versions() -> list[tuple[str, int]]:
        database = await Database.open(target)
        try:
            return await database.read(lambda connection: [tuple(row) for row in
                                                           connection.execute(
                "SELECT component, version FROM schema_migrations ORDER BY version")])
        finally:
            await database.close()

    async with await Store.open(target):
        pass
    assert await versions() == [("store", version) for version in range(1, 7)]
    # Opening again applies nothing twice.
    async with await Store.open(target):
        pass
    assert await versions() == [("store", version) for version in range(1, 7)]


async def test_thinking_is_kept_with_its_answer_and_never_shown_to_operators(
        store: Store, clock: FakeClock) -> None:
    thinking = (ThinkingBlock("BTC is flat; look first.", "sig-1", "anthropic"),
                ThinkingBlock("", source="anthropic", redacted="opaque"))
    answer = Message(role="assistant", content=(*thinking, *_call().content))
    conversation = Conversation("You trade.", observer=store.transcripts.observer("alpha"))
    for message in (Message.user_text("[tick]"), answer):
        await conversation.append(message)

    [_, row] = await store.transcripts.transcript("alpha")
    assert [block["type"] for block in row["content"]] == ["text", "tool_use"]
    assert row["text"] == "Let me look."
    store = await _reopen(store, clock)
    try:
        restored = await store.transcripts.restore_conversation("alpha", "You trade.")
        assert restored.messages[1].content[:2] == thinking
        assert restored.messages[1].content[2:] == answer.content[2:]
    finally:
        await store.close()
