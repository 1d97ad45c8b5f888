"""The supervisor: desks side by side, failures contained, a drain on shutdown, status."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import anyio
import pytest

from tests.daemon.harness import (
    EventLog,
    ToolGate,
    build_desk,
    close_backend,
    gate_tools,
    is_valid_transcript,
    open_store,
    wait_for,
)
from tests.scripted_server import (
    RecordedRequest,
    Reply,
    ScriptedServer,
    Step,
    ToolCall,
    server_error,
)
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.steering_inbox import SteeringMessage
from trading_agent.agent.trigger import Trigger
from trading_agent.daemon.control import DeskControl, DeskStatus, UnknownDeskError
from trading_agent.daemon.desk import Backoff
from trading_agent.daemon.supervisor import DeskRuntime, Supervisor
from trading_agent.store.daily_usage import DailyUsage
from trading_agent.store.store import Store


def _desk_of(request: RecordedRequest) -> str:
    return "alpha" if "desk alpha" in request.messages[0]["content"] else "beta"


async def test_two_desks_run_at_once_and_one_failing_never_disturbs_the_other(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    beta_asked = threading.Event()
    counts = {"alpha": 0, "beta": 0}

    def respond(request: RecordedRequest) -> Step:
        desk = _desk_of(request)
        counts[desk] += 1
        if desk == "alpha":
            # Alpha's first answer waits for beta's first request: the two run at once.
            return Reply(f"alpha answer {counts['alpha']}",
                         hold_until=beta_asked if counts["alpha"] == 1 else None, delay=0.02)
        beta_asked.set()
        if counts["beta"] == 1:
            return Reply(tool_calls=[ToolCall("explode")])
        if counts["beta"] == 2:
            return Reply("The tool failed; noted.")
        return server_error(503)  # from then on beta's model is down

    scripted_server.responder = respond
    bus = EventBus()
    events = EventLog(bus)
    async with open_store(tmp_path) as store:
        alpha = build_desk("alpha", store, scripted_server.base_url, bus)
        beta = build_desk("beta", store, scripted_server.base_url, bus, tools=gate_tools(),
                          backoff=Backoff(pause_first=30, pause_max=60))
        supervisor = Supervisor([DeskRuntime(alpha), DeskRuntime(beta)], bus, store)
        async with anyio.create_task_group() as group:
            await group.start(supervisor.run)
            alpha.fire(Trigger(kind="schedule", text="Alpha check 1.", source="s"))
            beta.fire(Trigger(kind="schedule", text="Beta check 1.", source="s"))
            await wait_for(lambda: beta.turns == 1 and alpha.turns == 1)
            beta.fire(Trigger(kind="schedule", text="Beta check 2.", source="s"))
            for number in (2, 3):
                alpha.fire(Trigger(kind="schedule", text=f"Alpha check {number}.", source="s"))
            await wait_for(lambda: alpha.turns == 3 and beta.state == "paused")

            alpha_status = await supervisor.desk_status("alpha")
            beta_status = await supervisor.desk_status("beta")
            supervisor.shutdown()
            await supervisor.stopped.wait()
        alpha_transcript = await store.transcripts.transcript("alpha")
        await close_backend(alpha)
        await close_backend(beta)

    assert alpha_status.state == "idle" and alpha_status.paused_reason == ""
    assert alpha_status.last_turn_text == "alpha answer 3"
    assert beta_status.state == "paused"
    assert "model is unavailable" in beta_status.paused_reason
    assert [row["kind"] for row in alpha_transcript] == ["trigger", "assistant"] * 3
    tool_errors = [e for e in events.of_type("tool_result") if e.is_error]  # type: ignore[attr-defined]
    assert [(e.desk, e.name) for e in tool_errors] == [("beta", "explode")]  # type: ignore[attr-defined]
    assert {e.desk for e in events.of_type("error")} == {"beta"}
    assert alpha.conversation is not None and is_valid_transcript(alpha.conversation.messages)


async def test_shutdown_lets_the_tool_round_finish_then_stops(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    gate = ToolGate()
    scripted_server.add(Reply(tool_calls=[ToolCall("wait_for_release")]))
    bus = EventBus()
    events = EventLog(bus)
    async with open_store(tmp_path) as store:
        desk = build_desk("alpha", store, scripted_server.base_url, bus, tools=gate_tools(gate))
        supervisor = Supervisor([DeskRuntime(desk)], bus, store, shutdown_timeout=5)
        async with anyio.create_task_group() as group:
            await group.start(supervisor.run)
            desk.fire(Trigger(kind="schedule", text="Check.", source="s"))
            await gate.entered.wait()
            supervisor.shutdown()
            await anyio.sleep(0.05)
            assert not supervisor.stopped.is_set()  # the tool call in flight finishes first
            gate.release.set()
            with anyio.fail_after(2):
                await supervisor.stopped.wait()
        transcript = await store.transcripts.transcript("alpha")
        await close_backend(desk)

    assert [e.stopped for e in events.of_type("turn_end")] == [True]  # type: ignore[attr-defined]
    assert [row["kind"] for row in transcript] == ["trigger", "assistant", "tool_results"]
    assert "released" in json.dumps(transcript[-1]["content"])
    scripted_server.assert_complete()


async def test_a_tool_that_outlives_the_shutdown_timeout_is_cancelled_with_its_result_stored(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    gate = ToolGate()  # never released
    scripted_server.add(Reply(tool_calls=[ToolCall("wait_for_release")]))
    bus = EventBus()
    async with open_store(tmp_path) as store:
        desk = build_desk("alpha", store, scripted_server.base_url, bus, tools=gate_tools(gate))
        supervisor = Supervisor([DeskRuntime(desk)], bus, store, shutdown_timeout=0.3)
        async with anyio.create_task_group() as group:
            await group.start(supervisor.run)
            desk.fire(Trigger(kind="schedule", text="Check.", source="s"))
            await gate.entered.wait()
            started = time.monotonic()
            supervisor.shutdown()
            with anyio.fail_after(3):
                await supervisor.stopped.wait()
            took = time.monotonic() - started
        transcript = await store.transcripts.transcript("alpha")
        await close_backend(desk)

    assert 0.25 < took < 2
    assert [row["kind"] for row in transcript] == ["trigger", "assistant", "tool_results"]
    assert "interrupted" in json.dumps(transcript[-1]["content"])


async def test_a_failing_service_is_restarted_and_evented_while_the_desk_works_on(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.add(Reply("Fine."))
    bus = EventBus()
    events = EventLog(bus)
    starts = 0

    async def flaky_watcher() -> None:
        nonlocal starts
        starts += 1
        if starts < 3:
            raise ConnectionError("the feed dropped")
        await anyio.sleep_forever()

    async with open_store(tmp_path) as store:
        desk = build_desk("alpha", store, scripted_server.base_url, bus)
        supervisor = Supervisor([DeskRuntime(desk, [("market triggers", flaky_watcher)])], bus,
                                store, service_backoff=Backoff(crash_first=0.01, crash_max=0.02))
        async with anyio.create_task_group() as group:
            await group.start(supervisor.run)
            desk.fire(Trigger(kind="schedule", text="Check.", source="s"))
            await wait_for(lambda: starts == 3 and desk.turns == 1)
            supervisor.shutdown()
            await supervisor.stopped.wait()
        await close_backend(desk)

    errors = events.of_type("error")
    assert len(errors) == 2
    assert all("market triggers failed (ConnectionError: the feed dropped)" in e.message  # type: ignore[attr-defined]
               for e in errors)


async def test_status_adds_usage_approvals_and_the_account(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.add(Reply("Done.", usage=(120, 30)))
    bus = EventBus()

    class Approvals:
        def pending_count(self, desk: str) -> int:
            return 2

    async def account() -> tuple[float | None, int]:
        return 10_250.5, 1

    async with open_store(tmp_path) as store:
        desk = build_desk("alpha", store, scripted_server.base_url, bus)
        supervisor = Supervisor([DeskRuntime(desk, account=account)], bus, store,
                                approvals=Approvals())
        control: DeskControl = supervisor
        subscription = bus.subscribe("store")
        async with anyio.create_task_group() as group:
            await group.start(supervisor.run)
            async with anyio.create_task_group() as recorder:
                recorder.start_soon(store.events.persist_events, subscription)
                message_id = await control.send_message("alpha", "How is it going?", "ann")
                await wait_for(lambda: desk.turns == 1)
                subscription.close()  # the recorder writes what it holds, then ends
            status = await control.desk_status("alpha")
            transcript = await control.transcript("alpha")
            stored_events = await control.events_since(0, "alpha")
            status_line = supervisor.status_line()
            supervisor.shutdown()
            await supervisor.stopped.wait()
        await close_backend(desk)

    assert list(control.desk_names()) == ["alpha"]
    assert (status.tokens_today, status.pending_approvals) == (150, 2)
    assert (status.equity, status.open_orders) == (10_250.5, 1)
    assert status.mode == "paper" and status.symbols == ["BTC/USDT"]
    assert [row["id"] for row in transcript if row["kind"] == "operator"] == [message_id]
    assert "turn_end" in {event["type"] for event in stored_events}
    assert status_line.startswith("1 desk (1 idle); last turn: alpha at ")
    for call in (control.desk_status("nope"), control.send_message("nope", "hi"),
                 control.compact("nope"), control.transcript("nope")):
        with pytest.raises(UnknownDeskError):
            await call


async def test_a_status_asked_as_the_desk_is_removed_is_still_answered(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    """A fleet hands a desk over while an operator's list of desks waits on its figures:
    the status asked before is answered, as the desk was (it failed with UnknownDeskError,
    and the list of every desk with a 500)."""
    bus = EventBus()
    reading, go_on = anyio.Event(), anyio.Event()
    statuses: list[DeskStatus] = []
    async with open_store(tmp_path) as store:
        usage = store.usage

        class _HeldUsage:
            """The store's usage, whose reads wait until the test lets them go on."""

            async def usage_on(self, desk: str) -> DailyUsage:
                reading.set()
                await go_on.wait()
                return await usage.usage_on(desk)

            def __getattr__(self, name: str) -> object:
                return getattr(usage, name)

        store.usage = _HeldUsage()  # type: ignore[assignment]
        desk = build_desk("alpha", store, scripted_server.base_url, bus)
        supervisor = Supervisor([DeskRuntime(desk)], bus, store)

        async def ask() -> None:
            statuses.append(await supervisor.desk_status("alpha"))

        async with anyio.create_task_group() as group:
            await group.start(supervisor.run)
            group.start_soon(ask)
            await reading.wait()
            await supervisor.remove_desk("alpha")
            go_on.set()
            await wait_for(lambda: bool(statuses))
            supervisor.shutdown()
            await supervisor.stopped.wait()
        await close_backend(desk)

    assert [(s.name, s.state) for s in statuses] == [("alpha", "idle")]  # when asked
    with pytest.raises(UnknownDeskError):  # asked after: it is not this daemon's any more
        await supervisor.desk_status("alpha")


class _SlowRestoreStore:
    """A store whose restores wait until the test lets them go on."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.transcripts = _SlowRestoreTranscripts(store.transcripts, self)
        self.restoring = anyio.Event()
        self.go_on = anyio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)


class _SlowRestoreTranscripts:
    """The transcripts of a :class:`_SlowRestoreStore`."""

    def __init__(self, transcripts: object, gate: _SlowRestoreStore) -> None:
        self._transcripts = transcripts
        self._gate = gate

    def __getattr__(self, name: str) -> object:
        return getattr(self._transcripts, name)

    async def restore_conversation(self, *args: object, **kwargs: object) -> object:
        self._gate.restoring.set()
        await self._gate.go_on.wait()
        return await self._transcripts.restore_conversation(*args, **kwargs)  # type: ignore[attr-defined]


async def test_the_turns_desks_owe_start_once_every_desk_has_restored(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.add(Reply("Here, Ann."))
    bus = EventBus()
    async with open_store(tmp_path) as store:
        # Alpha owes a turn: an operator's message stored before the restart.
        await store.inbox.add_operator_message("alpha", SteeringMessage("Are you there?", "ann"))
        alpha = build_desk("alpha", store, scripted_server.base_url, bus)
        beta = build_desk("beta", store, scripted_server.base_url, bus)
        slow = _SlowRestoreStore(store)
        beta.store = slow  # type: ignore[assignment]
        supervisor = Supervisor([DeskRuntime(alpha), DeskRuntime(beta)], bus, store)
        async with anyio.create_task_group() as group:
            group.start_soon(supervisor.run)
            await slow.restoring.wait()
            await alpha.ready.wait()
            # Alpha holds the turn it owes, unasked, while beta restores.
            await wait_for(lambda: alpha.status().queued_triggers == 1)
            assert alpha.status().state == "idle"
            assert scripted_server.requests == []  # alpha waits for beta's restore
            slow.go_on.set()
            await wait_for(lambda: alpha.turns == 1)
            supervisor.shutdown()
        assert (await store.transcripts.transcript("alpha"))[-1]["text"] == "Here, Ann."
        await close_backend(alpha)
        await close_backend(beta)
