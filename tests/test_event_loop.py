"""The daemon's event loop (``daemon.event_loop``): a turn's real I/O on uvloop and on
asyncio's own loop, and a clear refusal when uvloop is asked for and absent."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest

from tests.scripted_server import Reply, ScriptedServer
from trading_agent.agent import AgentLoop, Conversation, EventBus, ToolCallExecutor, ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.app import event_loop
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.errors import ConfigError
from trading_agent.store.store import Store


async def _a_turn_stored_and_a_child(base_url: str, path: Path) -> tuple[str, str, str]:
    """What a desk's turn touches: the model's stream over aiohttp, the SQLite store (its
    writer thread), a child process; returns the loop's name, the answer and the child's
    output."""
    store = await Store.open(path)
    try:
        async with OpenAICompatibleBackend(OpenAIBackendConfig(
                base_url=base_url, model="scripted-model", context_window=32_000)) as backend:
            loop = AgentLoop("alpha", backend, ToolCallExecutor(ToolRegistry()), EventBus(),
                             maximum_rounds=2)
            conversation = Conversation("You run a BTC desk.", [])
            result = await loop.run_turn(conversation, Trigger("tick", "BTC moved 1%"))
            for message in conversation.messages:
                await store.transcripts.append_message("alpha", message)
        stored = await store.transcripts.restore_conversation("alpha", "You run a BTC desk.")
        assert stored.messages[-1].text == result.text
    finally:
        await store.close()
    child = await anyio.run_process([sys.executable, "-c", "print('child ran')"])
    return event_loop.loop_name(), result.text, child.stdout.decode().strip()


@pytest.mark.parametrize("choice", ["auto", "uvloop", "asyncio"])
def test_a_turn_runs_whole_on_the_chosen_loop(choice: event_loop.EventLoopChoice,
                                             scripted_server: ScriptedServer,
                                             tmp_path: Path) -> None:
    scripted_server.add(Reply("Holding: no setup."))
    name, answer, child = event_loop.run(
        lambda: _a_turn_stored_and_a_child(scripted_server.base_url, tmp_path / "s.sqlite3"),
        choice)
    assert name == ("asyncio" if choice == "asyncio" else "uvloop")
    assert (answer, child) == ("Holding: no setup.", "child ran")


def test_uvloop_asked_for_and_absent_refuses_to_start_saying_what_is_allowed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as on a machine without it
    assert event_loop.uses_uvloop("auto") is False  # auto falls back to asyncio's loop
    with pytest.raises(ConfigError) as caught:
        event_loop.uses_uvloop("uvloop")
    assert str(caught.value) == (
        'daemon.event_loop = "uvloop", but uvloop is not installed on this machine; '
        'allowed: "auto" (uvloop where installed), "uvloop", "asyncio"')
