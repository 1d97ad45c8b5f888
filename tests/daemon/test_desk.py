"""One desk: turns one at a time, coalesced ticks, operator messages, pauses and restarts."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.daemon.harness import (
    EventLog,
    ManualSleep,
    ToolGate,
    build_desk,
    gate_tools,
    is_valid_transcript,
    last_user_text,
    open_store,
    stop_desk,
    wait_for,
)
from tests.scripted_server import Reply, ScriptedServer, ToolCall, server_error, unauthorized
from trading_agent.agent.conversation import Message, TextBlock, ToolUseBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.steering_inbox import SteeringMessage
from trading_agent.agent.trigger import Trigger
from trading_agent.daemon.desk import RESUME_TEXT, Backoff
from trading_agent.store import INTERRUPTED_NOTICE
from trading_agent.store.operator_inbox import SqliteOperatorInbox


async def test_a_trigger_runs_one_turn_stored_as_it_goes(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.add(Reply("All quiet on BTC."))
    bus = EventBus()
    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus)
        group.start_soon(desk.run)
        await desk.ready.wait()
        slot = datetime(2024, 1, 1, 9, 0, tzinfo=UTC)
        desk.fire(Trigger(kind="schedule", text="Morning review.", source="morning",
                          at=slot.timestamp()))
        await wait_for(lambda: desk.turns == 1)

        status = desk.status()
        transcript = await store.transcripts.transcript("alpha")
        assert status.state == "idle"
        assert status.last_turn_text == "All quiet on BTC."
        assert [row["kind"] for row in transcript] == ["trigger", "assistant"]
        assert "Morning review." in transcript[0]["text"]
        # The slot is recorded once its trigger reached the conversation.
        assert await store.schedules.schedule_last_fired("alpha") == {"morning": slot}
        await stop_desk(desk, group)
    scripted_server.assert_complete()


async def test_ticks_that_pile_up_during_a_turn_are_coalesced(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    hold = threading.Event()
    scripted_server.add(Reply("Looked at the first move.", hold_until=hold),
                        Reply("BTC handled."), Reply("ETH handled."))
    bus = EventBus()
    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus)
        group.start_soon(desk.run)
        desk.fire(Trigger(kind="tick", text="BTC +1%", source="BTC/USDT"))
        await scripted_server.wait_for_requests(1)
        for move in ("+2%", "+3%", "+4%"):
            desk.fire(Trigger(kind="tick", text=f"BTC {move}", source="BTC/USDT"))
        desk.fire(Trigger(kind="tick", text="ETH -1%", source="ETH/USDT"))
        assert desk.status().queued_triggers == 2
        hold.set()
        await wait_for(lambda: desk.turns == 3)
        await stop_desk(desk, group)

    second, third = scripted_server.requests[1:]
    assert last_user_text(second) == "[tick, 3 merged: BTC/USDT]\nBTC +4%"
    assert last_user_text(third) == "[tick: ETH/USDT]\nETH -1%"
    scripted_server.assert_complete()


async def test_an_operator_message_steers_the_running_turn_and_is_stored_first(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    gate = ToolGate()
    scripted_server.add(Reply(tool_calls=[ToolCall("wait_for_release", {"label": "a"})]),
                        Reply("Done, and I read your note."))
    bus = EventBus()
    events = EventLog(bus)
    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus,
                          tools=gate_tools(gate))
        group.start_soon(desk.run)
        desk.fire(Trigger(kind="schedule", text="Check.", source="s"))
        await gate.entered.wait()
        assert desk.state == "working"

        message_id = await desk.send_message("Do not buy more today.", source="ann")

        pending = await store.inbox.undelivered_operator_messages("alpha")
        assert [(m.id, m.text) for m in pending] == [(message_id, "Do not buy more today.")]
        gate.release.set()
        await wait_for(lambda: desk.turns == 1)
        assert await store.inbox.undelivered_operator_messages("alpha") == []
        await stop_desk(desk, group)

    assert "Do not buy more today." in last_user_text(scripted_server.requests[1])
    assert [e.text for e in events.of_type("steering_delivered")] == [  # type: ignore[attr-defined]
        "Do not buy more today."]
    scripted_server.assert_complete()


async def test_a_message_that_comes_during_the_final_answer_starts_the_next_turn(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    hold = threading.Event()
    scripted_server.add(Reply("Final answer.", hold_until=hold), Reply("Answering Ann."))
    bus = EventBus()
    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus)
        group.start_soon(desk.run)
        desk.fire(Trigger(kind="schedule", text="Check.", source="s"))
        await scripted_server.wait_for_requests(1)
        message_id = await desk.send_message("What about ETH?", source="ann")
        hold.set()
        await wait_for(lambda: len(scripted_server.requests) == 2 and desk.state == "idle")
        transcript = await store.transcripts.transcript("alpha")
        await stop_desk(desk, group)

    assert last_user_text(scripted_server.requests[1]) == (
        "[Message from ann, a human operator]\nWhat about ETH?")
    assert [row["id"] for row in transcript if row["kind"] == "operator"] == [message_id]
    scripted_server.assert_complete()


async def test_a_sender_that_asks_after_the_turn_ended_still_gets_the_answer(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    """Another daemon of a fleet sends a message, then asks for its answer; under load its
    ask can come after the turn that read the message ended at once (a fleet test once
    waited its whole 20 s for an answer given before it asked)."""
    scripted_server.add(Reply("Noted."), Reply("Noted again."))
    bus = EventBus()
    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus)
        group.start_soon(desk.run)
        await desk.ready.wait()
        first = await desk.send_message("Anything new?", source="ann")
        await wait_for(lambda: desk.turns == 1 and desk.state == "idle")
        second = await desk.send_message("And now?", source="ann")
        await wait_for(lambda: desk.turns == 2 and desk.state == "idle")
        with anyio.fail_after(5):
            late = await desk.reply_to(first)
            again = await desk.reply_to(second)
        await stop_desk(desk, group)

    assert (late.ok, late.text) == (True, "Noted.")
    assert (again.ok, again.text) == (True, "Noted again.")
    scripted_server.assert_complete()


async def test_an_unavailable_model_pauses_the_desk_without_spinning(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.add(server_error(503), server_error(503), Reply("Back again."))
    sleep = ManualSleep()
    bus = EventBus()
    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus, sleep=sleep,
                          backoff=Backoff(pause_first=15, pause_max=600))
        group.start_soon(desk.run)
        desk.fire(Trigger(kind="schedule", text="Check.", source="s"))
        await wait_for(lambda: desk.state == "paused")

        status = desk.status()
        assert "model is unavailable" in status.paused_reason
        assert "trying again in 15 s" in status.paused_reason
        # One try and one retry, then it waits out its backoff (asking nothing meanwhile).
        await wait_for(lambda: sleep.delays == [15])
        assert len(scripted_server.requests) == 2

        sleep.release()
        await wait_for(lambda: desk.turns == 1)
        assert desk.status().state == "idle"
        assert desk.status().paused_reason == ""
        conversation = desk.conversation
        assert conversation is not None
        assert is_valid_transcript(conversation.messages)
        await stop_desk(desk, group)

    # The model never answered the trigger: it is asked again with the one stored notice.
    assert last_user_text(scripted_server.requests[2]) == (
        f"{INTERRUPTED_NOTICE}\nWhy it stopped: the model was unavailable: the model is "
        "unavailable after 2 attempts: the server refused the request: The server had an "
        "error (HTTP 503) [model scripted-model]")
    scripted_server.assert_complete()


async def test_a_turn_that_raises_is_logged_evented_and_the_desk_restarts(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.add(unauthorized(), Reply("Recovered."))
    bus = EventBus()
    events = EventLog(bus)
    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus)
        group.start_soon(desk.run)
        desk.fire(Trigger(kind="schedule", text="Check.", source="s"))
        await wait_for(lambda: desk.turns == 1)
        transcript = await store.transcripts.transcript("alpha")
        await stop_desk(desk, group)

    errors = events.of_type("error")
    assert [e.error_type for e in errors] == ["BackendError"]  # type: ignore[attr-defined]
    assert [row["kind"] for row in transcript] == ["trigger", "notice", "assistant"]
    assert transcript[1]["text"] == (
        f"{INTERRUPTED_NOTICE}\nWhy it stopped: the turn failed: BackendError: the server "
        "refused the request: Incorrect API key provided. (HTTP 401) [model scripted-model]")
    scripted_server.assert_complete()


async def test_a_failure_in_the_desk_itself_is_evented_and_restarted(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.add(Reply("Fine."))
    bus = EventBus()
    events = EventLog(bus)
    calls = 0

    def flaky(trigger: Trigger) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug before the turn")

    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus)
        desk.on_turn_start.append(flaky)
        group.start_soon(desk.run)
        desk.fire(Trigger(kind="schedule", text="Check.", source="s"))
        await wait_for(lambda: desk.turns == 1)
        transcript = await store.transcripts.transcript("alpha")
        await stop_desk(desk, group)

    assert [(e.error_type, e.message) for e in events.of_type("error")] == [  # type: ignore[attr-defined]
        ("RuntimeError", "RuntimeError: a bug before the turn")]
    # The trigger never reached the conversation, so it ran again, once.
    assert [row["kind"] for row in transcript] == ["trigger", "assistant"]
    scripted_server.assert_complete()


async def test_stop_ends_the_running_turn_after_its_tool_round(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    gate = ToolGate()
    scripted_server.add(Reply(tool_calls=[ToolCall("wait_for_release")]))
    bus = EventBus()
    events = EventLog(bus)
    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus, tools=gate_tools(gate))
        group.start_soon(desk.run)
        desk.fire(Trigger(kind="schedule", text="Check.", source="s"))
        await gate.entered.wait()
        desk.stop()
        desk.fire(Trigger(kind="schedule", text="Never run.", source="s"))
        assert desk.state == "working"
        gate.release.set()
        await stop_desk(desk)
        transcript = await store.transcripts.transcript("alpha")
        group.cancel_scope.cancel()

    ended = events.of_type("turn_end")
    assert [e.stopped for e in ended] == [True]  # type: ignore[attr-defined]
    assert [row["kind"] for row in transcript] == ["trigger", "assistant", "tool_results"]
    assert len(scripted_server.requests) == 1
    scripted_server.assert_complete()


async def test_a_restart_repairs_the_interrupted_turn_resumes_and_delivers_each_message_once(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.add(Reply("Checked: nothing was placed twice."), Reply("Hello Ann."))
    bus = EventBus()
    async with open_store(tmp_path) as store:
        # What a killed daemon leaves: a tool call without its result, and a message that
        # was acknowledged but never delivered.
        before = await store.transcripts.restore_conversation("alpha", "You trade.")
        await before.append(Trigger(kind="schedule", text="Check.", source="s").to_message())
        await before.append(Message(role="assistant", content=(
            TextBlock("Placing."), ToolUseBlock("call_1", "wait_for_release", "{}"))))
        await store.inbox.add_operator_message("alpha", SteeringMessage("Are you there?", "ann"))

        async with anyio.create_task_group() as group:
            desk = build_desk("alpha", store, scripted_server.base_url, bus)
            group.start_soon(desk.run)
            await wait_for(lambda: desk.turns == 2)
            conversation = desk.conversation
            await stop_desk(desk, group)
        transcript = await store.transcripts.transcript("alpha")

    assert conversation is not None and is_valid_transcript(conversation.messages)
    assert [row["kind"] for row in transcript] == [
        "trigger", "assistant", "tool_results", "notice", "notice", "assistant", "operator",
        "assistant"]
    assert "interrupted" in json.dumps(transcript[2]["content"])
    assert transcript[3]["text"] == INTERRUPTED_NOTICE  # a restart: nobody knows why
    assert [row["text"].count("Are you there?") for row in transcript].count(1) == 1
    assert last_user_text(scripted_server.requests[0]) == f"[resume: daemon]\n{RESUME_TEXT}"
    scripted_server.assert_complete()


@pytest.mark.parametrize("paused", [False, True])
def test_backoff_doubles_up_to_its_cap(paused: bool) -> None:
    backoff = Backoff(crash_first=1, crash_max=8, pause_first=15, pause_max=60)
    delays = [backoff.delay(n, paused=paused) for n in range(1, 7)]
    assert delays == ([15, 30, 60, 60, 60, 60] if paused else [1, 2, 4, 8, 8, 8])


async def test_an_operator_message_wakes_a_paused_desk_at_once(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.add(server_error(503), server_error(503), Reply("Back."), Reply("Hi Ann."))
    sleep = ManualSleep()  # never released: only the message ends the pause
    bus = EventBus()
    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus, sleep=sleep)
        group.start_soon(desk.run)
        desk.fire(Trigger(kind="schedule", text="Check.", source="s"))
        await wait_for(lambda: desk.state == "paused")

        await desk.send_message("The model is back, try again.", source="ann")

        await wait_for(lambda: len(scripted_server.requests) == 4 and desk.state == "idle")
        await stop_desk(desk, group)
    assert sleep.delays == [0.01]
    assert last_user_text(scripted_server.requests[3]).endswith("The model is back, try again.")
    scripted_server.assert_complete()


async def test_compact_waits_for_the_running_turn(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    hold = threading.Event()
    scripted_server.add(Reply("Done.", hold_until=hold))
    bus = EventBus()
    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus)
        group.start_soon(desk.run)
        desk.fire(Trigger(kind="schedule", text="Check.", source="s"))
        await scripted_server.wait_for_requests(1)
        compacted: list[bool] = []

        async def compact() -> None:
            compacted.append(await desk.compact())

        group.start_soon(compact)
        await anyio.sleep(0.05)
        assert compacted == []  # waits for the turn
        hold.set()
        await wait_for(lambda: compacted == [False])  # no compressor: nothing to compact
        assert desk.turns == 1
        await stop_desk(desk, group)


async def test_a_trigger_compacted_away_mid_turn_is_not_run_again_after_a_failure(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    gate = ToolGate()
    scripted_server.add(Reply(tool_calls=[ToolCall("wait_for_release")]),
                        server_error(503), server_error(503), Reply("Carried on."))
    bus = EventBus()
    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus, tools=gate_tools(gate))
        group.start_soon(desk.run)
        await desk.ready.wait()
        desk.fire(Trigger(kind="schedule", text="Check the book.", source="s"))
        await gate.entered.wait()
        # A compaction during the turn summarises the trigger: the window now starts after it.
        conversation = desk.conversation
        assert conversation is not None
        assert conversation.messages[0].kind == "trigger"
        await conversation.compact(
            Message(role="user", kind="summary", content=(TextBlock("Asked to check."),)), 1)
        gate.release.set()
        await wait_for(lambda: desk.turns == 1)
        await stop_desk(desk, group)

    later = [last_user_text(request) for request in scripted_server.requests[1:]]
    assert not any(text.endswith("Check the book.") for text in later)
    assert later[-1] == f"[resume: daemon]\n{RESUME_TEXT}"
    sent = json.dumps(scripted_server.requests[-1].messages)
    assert sent.count("Why it stopped: the model was unavailable") == 1
    assert gate.calls == 1
    scripted_server.assert_complete()


class _SlowAddInbox:
    """An operator inbox whose ``add_operator_message`` commits, then waits for the test to
    go on."""

    def __init__(self, inbox: SqliteOperatorInbox) -> None:
        self._inbox = inbox
        self.committed = anyio.Event()
        self.go_on = anyio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inbox, name)

    async def add_operator_message(self, desk: str, message: SteeringMessage) -> None:
        await self._inbox.add_operator_message(desk, message)
        self.committed.set()
        await self.go_on.wait()


async def test_a_message_sent_while_the_desk_restores_is_delivered_once(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    hold = threading.Event()
    scripted_server.add(Reply("Hello Ann.", hold_until=hold))
    bus = EventBus()
    async with open_store(tmp_path) as real_store, anyio.create_task_group() as group:
        desk = build_desk("alpha", real_store, scripted_server.base_url, bus)
        store = _SlowAddInbox(real_store.inbox)
        real_store.inbox = store
        sent: list[str] = []

        async def send() -> None:
            sent.append(await desk.send_message("Are you there?", source="ann"))

        group.start_soon(send)
        await store.committed.wait()
        # The desk restores now: it finds the stored message and starts a turn for it.
        group.start_soon(desk.run)
        await scripted_server.wait_for_requests(1)
        assert desk.state == "working"
        store.go_on.set()
        await wait_for(lambda: sent != [])
        hold.set()
        await wait_for(lambda: desk.turns == 1)
        await anyio.sleep(0.05)
        transcript = await real_store.transcripts.transcript("alpha")
        await stop_desk(desk, group)

    assert [row["kind"] for row in transcript] == ["operator", "assistant"]
    assert len(scripted_server.requests) == 1
    scripted_server.assert_complete()


@pytest.mark.parametrize("kind", ["tick", "operator"])
async def test_an_outage_over_many_pauses_adds_no_message_per_retry(
        kind: str, scripted_server: ScriptedServer, tmp_path: Path) -> None:
    cycles = 4  # each: one try and one retry (max_retries=1), both refused
    scripted_server.add(*[server_error(503)] * (2 * cycles), Reply("Handled it."))
    delays: list[float] = []

    async def fast_sleep(seconds: float) -> None:
        delays.append(seconds)
        await anyio.lowlevel.checkpoint()

    bus = EventBus()
    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus, sleep=fast_sleep,
                          backoff=Backoff(pause_first=15, pause_max=600))
        group.start_soon(desk.run)
        await desk.ready.wait()
        if kind == "tick":
            opening = "BTC +5%"
            desk.fire(Trigger(kind="tick", text=opening, source="BTC/USDT"))
        else:
            opening = "Sell half."
            await desk.send_message(opening, source="ann")
        await wait_for(lambda: desk.turns == 1)
        transcript = await store.transcripts.transcript("alpha")
        conversation = desk.conversation
        assert conversation is not None
        assert is_valid_transcript(conversation.messages)
        assert [m.id for m in conversation.messages] == [row["id"] for row in transcript]
        assert await store.inbox.undelivered_operator_messages("alpha") == []
        await stop_desk(desk, group)

    assert delays == [15, 30, 60, 120]
    kinds = [row["kind"] for row in transcript]
    assert kinds == ["trigger" if kind == "tick" else "operator", "notice", "assistant"]
    assert transcript[-1]["text"] == "Handled it."
    # What the model saw once it was back: the opening once, one notice, nothing else new.
    sent = scripted_server.requests[-1].messages
    assert [m["role"] for m in sent] == ["system", "user", "user"]
    assert sum(opening in json.dumps(m["content"]) for m in sent) == 1
    scripted_server.assert_complete()


async def test_an_outage_after_a_tool_round_adds_one_resume_notice_however_long(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    gate = ToolGate()
    gate.release.set()
    cycles = 3
    scripted_server.add(Reply(tool_calls=[ToolCall("wait_for_release")]),
                        *[server_error(503)] * (2 * cycles), Reply("Checked the book."))

    async def fast_sleep(seconds: float) -> None:
        await anyio.lowlevel.checkpoint()

    bus = EventBus()
    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus, tools=gate_tools(gate),
                          sleep=fast_sleep)
        group.start_soon(desk.run)
        desk.fire(Trigger(kind="schedule", text="Check the book.", source="s"))
        await wait_for(lambda: desk.turns == 1)
        transcript = await store.transcripts.transcript("alpha")
        await stop_desk(desk, group)

    assert [row["kind"] for row in transcript] == [
        "trigger", "assistant", "tool_results", "notice", "notice", "assistant"]
    assert transcript[3]["text"].startswith(
        f"{INTERRUPTED_NOTICE}\nWhy it stopped: the model was unavailable")
    assert transcript[4]["text"] == f"[resume: daemon]\n{RESUME_TEXT}"
    assert last_user_text(scripted_server.requests[-1]) == transcript[4]["text"]
    # The reason is in the request once: in the store's notice, not again in the resume.
    sent = json.dumps(scripted_server.requests[-1].messages)
    assert sent.count("the model was unavailable") == 1
    assert gate.calls == 1
    scripted_server.assert_complete()


async def test_after_an_outage_the_model_reads_why_once_in_the_first_notice(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    # Two pauses, each one try and one retry; the second outage fails differently.
    scripted_server.add(server_error(503, "Overloaded, try later"),
                        server_error(503, "Overloaded, try later"),
                        server_error(502, "Bad gateway"), server_error(502, "Bad gateway"),
                        Reply("Back, and I checked the book."))

    async def fast_sleep(seconds: float) -> None:
        await anyio.lowlevel.checkpoint()

    bus = EventBus()
    async with open_store(tmp_path) as store, anyio.create_task_group() as group:
        desk = build_desk("alpha", store, scripted_server.base_url, bus, sleep=fast_sleep)
        group.start_soon(desk.run)
        await desk.ready.wait()
        desk.fire(Trigger(kind="tick", text="BTC +5%", source="BTC/USDT"))
        await wait_for(lambda: desk.turns == 1)
        transcript = await store.transcripts.transcript("alpha")
        await stop_desk(desk, group)

    first_reason = ("the model was unavailable: the model is unavailable after 2 attempts: the "
                    "server refused the request: Overloaded, try later (HTTP 503) "
                    "[model scripted-model]")
    notice = f"{INTERRUPTED_NOTICE}\nWhy it stopped: {first_reason}"
    assert [row["kind"] for row in transcript] == ["trigger", "notice", "assistant"]
    assert transcript[1]["text"] == notice
    # The request after the outage: the trigger, then that notice once; the later
    # failure's reason did not make a second notice nor change the first.
    sent = scripted_server.requests[-1].messages
    assert [m["role"] for m in sent] == ["system", "user", "user"]
    assert last_user_text(scripted_server.requests[-1]) == notice
    assert json.dumps(sent).count("Why it stopped") == 1
    assert "Bad gateway" not in json.dumps(sent)
    scripted_server.assert_complete()


async def test_a_message_sent_again_under_its_id_after_a_restart_is_not_read_again(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    # A client retrying with its idempotency key after the desk restarted (or moved to
    # another daemon of a fleet): the new mailbox never saw the id, the store did.
    scripted_server.add(Reply("Bought 0.01 BTC."))
    async with open_store(tmp_path) as store:
        for attempt in range(2):
            bus = EventBus()
            async with anyio.create_task_group() as group:
                desk = build_desk("alpha", store, scripted_server.base_url, bus)
                group.start_soon(desk.run)
                await desk.ready.wait()
                assert await desk.send_message("Buy 0.01 BTC.", "ann",
                                               message_id="k-order-7") == "k-order-7"
                if attempt == 0:
                    await wait_for(lambda: desk.turns == 1)  # noqa: B023 (awaited here)
                else:  # the store knew the id: nothing was handed to the desk
                    assert desk.mailbox.delivery("k-order-7") is None
                    assert desk.turns == 0
                await stop_desk(desk, group)
        transcript = await store.transcripts.transcript("alpha")

    assert [(row["kind"], row["text"]) for row in transcript] == [
        ("operator", "[Message from ann, a human operator]\nBuy 0.01 BTC."),
        ("assistant", "Bought 0.01 BTC.")]
    scripted_server.assert_complete()


async def test_a_restored_desk_prepares_its_first_request_before_any_trigger(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.responder = lambda request: Reply("Nothing to do.")
    bus = EventBus()
    async with open_store(tmp_path) as store:
        for number in range(40):  # a history from an earlier run of the daemon
            await store.transcripts.append_message("alpha", Message.user_text(f"tick {number}"))
            await store.transcripts.append_message("alpha", Message(
                role="assistant", content=(TextBlock(f"No trade {number}."),)))
        desk = build_desk("alpha", store, scripted_server.base_url, bus)
        async with anyio.create_task_group() as group:
            group.start_soon(desk.run)
            with anyio.fail_after(10):
                await desk.prepared.wait()
            assert desk.conversation is not None and len(desk.conversation.messages) == 80
            assert all("openai_wire" in m.cache for m in desk.conversation.messages), \
                "the restored messages are encoded before the desk's first trigger"
            desk.fire(Trigger(kind="schedule", text="Check.", source="s"))
            await wait_for(lambda: desk.turns == 1)
            await stop_desk(desk, group)
    assert len(scripted_server.requests) == 1
