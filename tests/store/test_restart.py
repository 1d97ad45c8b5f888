"""A desk's turn is stopped mid-tool-call; after a restart its next request is valid.

A real AgentLoop talks to the scripted OpenAI-compatible server, its conversation and
events go to a real SQLite file, the "daemon" is stopped while a tool runs, and a new store
on the same file restores the conversation the next turn sends.
"""

from __future__ import annotations

from pathlib import Path

import anyio
from pydantic import BaseModel

from tests.scripted_server import Reply, ScriptedServer, ToolCall
from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import ToolCallStarted
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.store import INTERRUPTED_NOTICE, Store, database_path

PROMPT = "You are the desk alpha."


class NoArguments(BaseModel):
    pass


def _registry() -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(description="Places an order (and never returns, in this test).")
    async def place_order(arguments: NoArguments, context: ToolContext) -> str:
        await anyio.sleep_forever()
        return "unreachable"

    return registry


async def _daemon_run(path: Path, server: ScriptedServer, trigger: Trigger, *,
                      stop_when_tool_starts: bool) -> Store:
    """One life of the daemon: restore, run one turn (maybe stopped), persist events."""
    store = await Store.open(path)
    bus = EventBus(first_id=await store.events.last_event_id() + 1)
    config = OpenAIBackendConfig(base_url=server.base_url, model="scripted-model",
                                 context_window=8192)
    async with OpenAICompatibleBackend(config, environ={}) as backend:
        loop = AgentLoop("alpha", backend, ToolCallExecutor(_registry()), bus, maximum_rounds=4)
        conversation = await store.transcripts.restore_conversation("alpha", PROMPT)
        watch = bus.subscribe("test")
        store_subscription = bus.subscribe("store")
        async with anyio.create_task_group() as daemon:
            daemon.start_soon(store.events.persist_events, store_subscription)
            async with anyio.create_task_group() as desk:

                async def turn() -> None:
                    await loop.run_turn(conversation, trigger)
                    desk.cancel_scope.cancel()

                desk.start_soon(turn)
                if stop_when_tool_starts:
                    async for event in watch:
                        if isinstance(event, ToolCallStarted):
                            desk.cancel_scope.cancel()  # a hard stop: cancel the desk mid-call
            store_subscription.close()  # the store writes what is buffered, then stops
    return store


async def test_a_turn_stopped_during_a_tool_call_is_told_and_the_next_request_is_valid(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    path = database_path(tmp_path)
    scripted_server.add(
        Reply(tool_calls=[ToolCall("place_order", {}, id="call_order")]),
        Reply("I checked: the order is not on the book. Nothing else to do."),
    )
    first = await _daemon_run(path, scripted_server, Trigger(kind="operator", text="Buy 0.1 BTC",
                                                             source="ann"),
                              stop_when_tool_starts=True)
    await first.close()

    second = await _daemon_run(path, scripted_server, Trigger(kind="tick", text="BTC +1%"),
                               stop_when_tool_starts=False)
    try:
        scripted_server.assert_complete()
        sent = scripted_server.requests[1].messages
        assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool", "user",
                                            "user"]
        assert sent[2]["tool_calls"][0]["id"] == "call_order"
        assert sent[3]["tool_call_id"] == "call_order"
        assert "interrupted" in sent[3]["content"]
        assert INTERRUPTED_NOTICE in str(sent[4]["content"])
        assert "BTC +1%" in str(sent[5]["content"])

        # Everything is in the file: both turns' messages, and the events of both lives.
        kinds = [row["kind"] for row in await second.transcripts.transcript("alpha")]
        assert kinds == ["operator", "assistant", "tool_results", "notice", "trigger",
                         "assistant"]
        types = [event["type"] for event in await second.events.events_since(0, desk="alpha")]
        assert types.count("turn_start") == 2 and types.count("turn_end") == 1
        assert "tool_call" in types and "text_delta" not in types
    finally:
        await second.close()
