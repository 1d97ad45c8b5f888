"""The event stream: live, per desk or all, resumable after a reconnect with no gap and no
duplicate, from the in-memory ring and, for older ids, from the store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.operator.harness import build_control, collect_events, running_api, uds_client
from tests.scripted_server import Reply, ScriptedServer, ToolCall
from tests.waiting import wait_until
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import TextDelta, ToolCallStarted
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.client import OperatorClient, StreamEvent
from trading_agent.operator.config import OperatorConfig
from trading_agent.operator.event_stream import EventHub, sse_frames


def _turn_ends(count: int) -> Any:
    return lambda events: sum(e.type == "turn_end" for e in events) >= count


def _ids(events: list[StreamEvent]) -> list[int]:
    return [e.id for e in events if e.id is not None]


async def test_a_reconnecting_stream_misses_nothing_and_repeats_nothing(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(
        Reply(tool_calls=[ToolCall("get_price", {"symbol": "BTC/USDT"})]),
        Reply("BTC is at 64,000.", text_chunks=6),
        Reply("ETH is quiet.", text_chunks=5),
        Reply("Still quiet.", text_chunks=3),
    )
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), OperatorConfig(),
                           state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/messages", json={"text": "BTC?"})
        await client.post("/api/desks/beta/messages", json={"text": "ETH?"})
        first = await collect_events(client, params={"after": 0}, until=_turn_ends(1))
        # Disconnected. More happens meanwhile.
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 1)
            await control.wait_turns("beta", 1)
        await client.post("/api/desks/beta/messages", json={"text": "And now?"})
        with anyio.fail_after(5):
            await control.wait_turns("beta", 2)
        # The browser's EventSource sends Last-Event-ID; it wins over the URL's ?after=0.
        second = await collect_events(client, params={"after": 0},
                                      headers={"Last-Event-ID": str(first[-1].id)},
                                      until=_turn_ends(2))
        whole = await collect_events(client, params={"after": 0}, until=_turn_ends(3))
    joined = first + second
    assert _ids(joined) == _ids(whole)
    assert [e.data for e in joined] == [e.data for e in whole]
    assert len(set(_ids(whole))) == len(whole)
    assert any(e.type == "text_delta" for e in second)  # live detail, not just the store's


async def test_a_desk_filtered_stream_resumes_too(scripted_server: ScriptedServer,
                                                  state_dir: Path) -> None:
    scripted_server.add(Reply("one", text_chunks=3), Reply("two", text_chunks=3))
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), OperatorConfig(),
                           state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/messages", json={"text": "first"})
        first = await collect_events(client, params={"desk": "alpha", "after": 0},
                                     until=_turn_ends(1))
        await client.post("/api/desks/alpha/messages", json={"text": "second"})
        second = await collect_events(client, params={"desk": "alpha",
                                                      "after": first[-1].id},
                                      until=_turn_ends(1))
    assert {e.data["desk"] for e in first + second} == {"alpha"}
    ids = _ids(first + second)
    assert ids == sorted(set(ids))
    assert "".join(e.data["text"] for e in second if e.type == "text_delta") == "two"


async def test_older_events_come_from_the_store_then_the_ring(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    # 150 text deltas overflow a 100-event ring: the early events are only in the store.
    scripted_server.add(Reply("x" * 150, text_chunks=150))
    control, _ = build_control(scripted_server.base_url)
    config = OperatorConfig(event_buffer_size=100)
    async with running_api(control, ApprovalBook(), config, state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/messages", json={"text": "Write a lot."})
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 1)
        events = await collect_events(client, params={"after": 0, "follow": "0"},
                                      until=lambda es: False)
    ids = _ids(events)
    assert ids == sorted(set(ids))
    stored = [row["id"] for row in control.stored]
    assert set(stored) <= set(ids)  # nothing stored is skipped
    assert events[0].type == "turn_start" and events[-1].type == "turn_end"
    deltas = [e for e in events if e.type == "text_delta"]
    assert 90 <= len(deltas) < 150  # the ring's, not the ones it had to let go


async def test_tail_and_no_follow(scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("abc", text_chunks=3))
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), OperatorConfig(),
                           state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/messages", json={"text": "hi"})
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 1)
        whole = await collect_events(client, params={"follow": "0", "after": 0},
                                     until=lambda es: False)
        tail = await collect_events(client, params={"follow": "0", "tail": 2},
                                    until=lambda es: False)
        nothing = await collect_events(client, params={"follow": "0"}, until=lambda es: False)
    assert [e.id for e in tail] == [e.id for e in whole[-2:]]
    assert nothing == []


class _RestartableApi:
    """The operator API over ``control``, which a test stops and starts again (a restart,
    as a connected client sees it), while the desks go on."""

    def __init__(self, control: Any, state_dir: Path, group: anyio.abc.TaskGroup) -> None:
        self._control, self._state_dir, self._group = control, state_dir, group
        self._scope = anyio.CancelScope()

    async def start(self) -> None:
        self._scope = anyio.CancelScope()
        await self._group.start(self._serve)

    def stop(self) -> None:
        self._scope.cancel()

    async def _serve(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        from trading_agent.operator.server import serve_operator_api
        with self._scope:
            await serve_operator_api(self._control, ApprovalBook(), OperatorConfig(),
                                     state_dir=self._state_dir, task_status=task_status)


async def _follow_until(client: OperatorClient, seen: list[StreamEvent], final_text: str) -> None:
    async for event in client.events():
        seen.append(event)
        if event.data.get("final_text") == final_text:
            return


async def _until(seen: list[StreamEvent], found: Any, seconds: float = 5) -> None:
    with anyio.fail_after(seconds):
        while not any(found(e) for e in seen):  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def test_the_client_reconnects_across_a_restart_of_the_api(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("before", text_chunks=2), Reply("during", text_chunks=2),
                        Reply("after", text_chunks=2))
    control, _ = build_control(scripted_server.base_url)
    seen: list[StreamEvent] = []

    async with anyio.create_task_group() as group:
        group.start_soon(control.run)
        api = _RestartableApi(control, state_dir, group)
        await api.start()
        client = OperatorClient(socket_path=state_dir / "operator.sock", timeout=5)
        group.start_soon(_follow_until, client, seen, "after")
        await client.send_message("alpha", "one")
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 1)
        await _until(seen, lambda e: e.data.get("final_text") == "before")
        api.stop()  # the API goes away (a daemon restart, as the client sees it)
        await _until(seen, lambda e: e.type == "stream_reconnecting")
        await control.send_message("alpha", "two")  # happens while nobody watches
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 2)
        await api.start()
        await client.send_message("alpha", "three")
        with anyio.fail_after(10):
            await control.wait_turns("alpha", 3)
        await _until(seen, lambda e: e.data.get("final_text") == "after", 10)
        await client.aclose()
        group.cancel_scope.cancel()
    for desk in control.desks.values():
        await desk.loop.backend.aclose()  # type: ignore[attr-defined]
    ids = [e.id for e in seen if e.id is not None]
    assert ids == sorted(set(ids))
    finals = [e.data["final_text"] for e in seen if e.type == "turn_end"]
    assert finals == ["before", "during", "after"]  # the turn it missed came from the store
    stored_ids = {row["id"] for row in control.stored}
    assert stored_ids <= set(ids)


async def test_a_stream_from_now_that_drops_before_its_first_event_misses_nothing(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    """A client that asked for events "from now" resumes where "now" was (X-Stream-Cursor)."""
    scripted_server.add(Reply("earlier"), Reply("while away"), Reply("later"))
    control, _ = build_control(scripted_server.base_url)
    seen: list[StreamEvent] = []

    async with anyio.create_task_group() as group:
        group.start_soon(control.run)
        api = _RestartableApi(control, state_dir, group)
        await api.start()
        client = OperatorClient(socket_path=state_dir / "operator.sock", timeout=5)
        await client.send_message("alpha", "one")  # events exist before anyone watches
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 1)
        group.start_soon(_follow_until, client, seen, "later")
        # Kept: that no old event is replayed during this time is what is checked.
        await anyio.sleep(0.5)  # connected, and nothing new has happened since
        assert not [e for e in seen if e.id is not None]
        api.stop()
        await _until(seen, lambda e: e.type == "stream_reconnecting")
        await control.send_message("alpha", "two")  # while the watcher is away
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 2)
        await api.start()
        await client.send_message("alpha", "three")
        with anyio.fail_after(10):
            await control.wait_turns("alpha", 3)
        await _until(seen, lambda e: e.data.get("final_text") == "later", 10)
        await client.aclose()
        group.cancel_scope.cancel()
    for desk in control.desks.values():
        await desk.loop.backend.aclose()  # type: ignore[attr-defined]
    finals = [e.data["final_text"] for e in seen if e.type == "turn_end"]
    assert finals == ["while away", "later"]  # not the earlier turn, not missing the middle


# --------------------------------------------------------------------------- the ring itself


def _event(bus: EventBus, number: int) -> TextDelta | ToolCallStarted:
    desk = "alpha" if number % 3 else "beta"
    if number % 2:
        return TextDelta(desk=desk, text=str(number))
    return ToolCallStarted(desk=desk, call_id=f"c{number}", name="get_price", arguments="{}")


class _Store:
    """What the SQLite store keeps: everything but text deltas."""

    def __init__(self, bus: EventBus) -> None:
        self.rows: list[dict[str, Any]] = []
        self._subscription = bus.subscribe("store")

    def drain(self) -> None:
        while (event := self._subscription.get_nowait()) is not None:
            if event.type != "text_delta":
                self.rows.append(event.to_dict())

    async def since(self, after: int, desk: str | None, limit: int) -> list[dict[str, Any]]:
        self.drain()
        return [r for r in self.rows if r["id"] > after and desk in (None, r["desk"])][:limit]


def _parse(frames: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for frame in frames:
        for line in frame.decode().splitlines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
    return out


@pytest.mark.parametrize("desk", [None, "alpha"])
async def test_a_reader_overtaken_by_the_ring_falls_back_to_the_store(desk: str | None) -> None:
    bus = EventBus(first_id=1000)
    store = _Store(bus)
    hub = EventHub(bus, capacity=100)
    frames: list[bytes] = []
    async with anyio.create_task_group() as group:
        group.start_soon(hub.run)
        for number in range(50):
            bus.publish(_event(bus, number))
        await anyio.sleep(0.01)
        reader = sse_frames(hub, store.since, cursor=999, desk=desk, follow=True,
                            keepalive_seconds=5)
        stalled = False
        async for frame in reader:
            frames.append(frame)
            if not stalled and frame.startswith(b"id: "):
                # After its first events, the reader stalls while 500 more go by: the ring
                # (100 events) forgets its place, and the rest must come from the store.
                stalled = True
                for number in range(50, 550):
                    bus.publish(_event(bus, number))
                await anyio.sleep(0.01)
            if b'"text":"549"' in frame or (b'"call_id":"c548"' in frame and desk):
                break
        await reader.aclose()
        hub.close()
    events = _parse(frames)
    ids = [e["id"] for e in events]
    assert ids == sorted(set(ids))
    assert hub.floor is not None and hub.floor > 1050  # the ring really moved past the reader
    store.drain()
    wanted_stored = {r["id"] for r in store.rows if desk in (None, r["desk"])}
    assert wanted_stored <= set(ids)
    assert hub.floor is not None and all(
        i in ids for i in range(hub.floor, 1550)
        if desk is None or _event(bus, i - 1000).desk == desk)


async def test_from_now_waits_for_the_first_event() -> None:
    bus = EventBus()
    hub = EventHub(bus, capacity=100)
    got: list[bytes] = []

    async def read() -> None:
        async for frame in sse_frames(hub, _Store(bus).since, cursor=None,
                                      keepalive_seconds=0.05):
            got.append(frame)
            if frame.startswith(b"id:"):
                return

    async with anyio.create_task_group() as group:
        group.start_soon(hub.run)
        group.start_soon(read)
        await wait_until(lambda: b": keepalive\n\n" in got, "a keepalive before any event")
        bus.publish(TextDelta(desk="alpha", text="first"))
        with anyio.fail_after(2):
            while not got or not got[-1].startswith(b"id:"):  # noqa: ASYNC110
                await anyio.sleep(0.005)
        hub.close()
    assert got[0] == b"retry: 2000\n\n"
    assert b": keepalive\n\n" in got
    assert got[-1].startswith(b"id: 1\n")
