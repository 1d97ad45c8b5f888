"""Half an emoji (a lone UTF-16 surrogate, from a broken model stream) in an event or a
message reaches the operator intact and stops neither the API nor the store's persister."""

from __future__ import annotations

from pathlib import Path

import anyio

from tests.operator.harness import build_control, collect_events, running_api, uds_client
from tests.scripted_server import ScriptedServer
from trading_agent.agent.conversation import Message, TextBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import ErrorEvent, TextDelta, TurnStarted
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.config import OperatorConfig
from trading_agent.operator.event_stream import EventHub, sse_frames
from trading_agent.store import Store

HALF_EMOJI = "\ud83d"


async def test_an_event_with_a_lone_surrogate_is_streamed_and_stored(
        scripted_server: ScriptedServer, state_dir: Path, tmp_path: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    bus = control.event_bus
    store = await Store.open(tmp_path / "store.sqlite3")
    try:
        async with running_api(control, ApprovalBook(), OperatorConfig(),
                               state_dir) as (endpoints, group), \
                uds_client(endpoints.socket_path) as client:
            subscription = bus.subscribe("store", max_buffer=10_000)
            group.start_soon(store.events.persist_events, subscription)
            bus.publish(TurnStarted(desk="alpha", turn="t1", trigger_kind="operator",
                                    trigger_text=f"hi {HALF_EMOJI}"))
            bus.publish(TextDelta(desk="alpha", turn="t1", text=HALF_EMOJI))
            bus.publish(ErrorEvent(desk="alpha", message="after", error_type="E"))
            events = await collect_events(
                client, params={"after": 0},
                until=lambda found: any(e.data["type"] == "error" for e in found))
            assert [(e.data["type"], e.data.get("text", e.data.get("trigger_text")))
                    for e in events] == [("turn_start", f"hi {HALF_EMOJI}"),
                                         ("text_delta", HALF_EMOJI), ("error", None)]
            # Both still run: the API answers, and a later event is stored too.
            assert (await client.get("/api/health")).status_code == 200
            bus.publish(ErrorEvent(desk="alpha", message="later", error_type="E"))
            with anyio.fail_after(5):
                while len(await store.events.events_since(0)) < 3:  # noqa: ASYNC110
                    await anyio.sleep(0.005)
        stored = await store.events.events_since(0)
        assert [e["type"] for e in stored] == ["turn_start", "error", "error"]
        assert stored[0]["trigger_text"] == f"hi {HALF_EMOJI}"
        assert store.events.events_not_stored == 0
    finally:
        await store.close()


async def test_the_hub_encodes_a_lone_surrogate_as_an_escape() -> None:
    bus = EventBus()
    hub = EventHub(bus, 100)
    hub.publish_directly(bus.publish(TextDelta(desk="a", turn="t", text=f"x{HALF_EMOJI}")))

    async def stored(after: int, desk: str | None, limit: int) -> list[dict[str, object]]:
        return []

    frames = [f async for f in sse_frames(hub, stored, cursor=0, follow=False)]
    assert b'"text":"x\\ud83d"' in b"".join(frames)


async def test_a_transcript_with_a_lone_surrogate_is_served(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    await control.desks["alpha"].conversation.append(
        Message(role="assistant", content=(TextBlock(f"up {HALF_EMOJI}"),)))
    async with running_api(control, ApprovalBook(), OperatorConfig(),
                           state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        response = await client.get("/api/desks/alpha/transcript")
        assert response.status_code == 200
        assert response.json()["messages"][-1]["text"] == f"up {HALF_EMOJI}"
