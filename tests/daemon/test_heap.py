"""The heap keeper: it freezes the restored heap at start-up and after each compaction, and a
compaction's replaced messages are still reclaimed."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from tests.daemon.harness import build_desk, close_backend, open_store, wait_for
from tests.scripted_server import ScriptedServer
from trading_agent.agent.conversation import Conversation, Message
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import CompactionEnded
from trading_agent.daemon.heap import HeapKeeper
from trading_agent.daemon.supervisor import DeskRuntime, Supervisor


@pytest.fixture(autouse=True)
def _thawed() -> Iterator[None]:
    """The test process's heap is unfrozen again afterwards."""
    yield
    gc.unfreeze()


async def test_the_keeper_freezes_once_every_desk_restored_and_after_each_compaction(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    bus = EventBus()
    keeper = HeapKeeper()
    async with open_store(tmp_path) as store:
        desk = build_desk("alpha", store, scripted_server.base_url, bus)
        supervisor = Supervisor([DeskRuntime(desk)], bus, store, heap_keeper=keeper)
        async with anyio.create_task_group() as group:
            await group.start(supervisor.run)
            assert keeper.freezes == 1 and keeper.frozen > 0
            frozen_at_start = keeper.frozen
            bus.publish(CompactionEnded(desk="alpha", reason="operator", tokens_before=900,
                                        tokens_after=100, messages_summarized=8))
            await wait_for(lambda: keeper.freezes == 2, what="a freeze after the compaction")
            assert keeper.frozen >= frozen_at_start
            supervisor.shutdown()
            await supervisor.stopped.wait()
        await close_backend(desk)


def _conversation() -> tuple[Conversation, list[Message]]:
    messages = [Message.user_text(f"tick {number}") for number in range(20)]
    messages[3].cache["self"] = messages[3]  # a cycle: reference counting cannot free it
    return Conversation("You run a desk.", messages), messages


async def test_a_compactions_replaced_messages_are_reclaimed_while_frozen() -> None:
    clock = [0.0]
    keeper = HeapKeeper(refresh_seconds=60, clock=lambda: clock[0])
    conversation, messages = _conversation()
    plain, cyclic = weakref.ref(messages[1]), weakref.ref(messages[3])
    del messages
    keeper.freeze()  # start-up: the conversation is frozen now
    assert keeper.frozen > 0

    await conversation.compact(Message.user_text("Summary.", kind="summary"), 10)
    keeper.compacted()  # within the minute: a freeze, no refresh
    assert plain() is None, "a frozen message without cycles is freed by reference counting"
    assert cyclic() is not None and keeper.refreshes == 0

    clock[0] = 61.0
    keeper.compacted()  # the next compaction after refresh_seconds: unfreeze, collect, freeze
    assert keeper.refreshes == 1
    assert cyclic() is None, "the refresh reclaims a cycle that became garbage while frozen"
    assert len(conversation.messages) == 10 and keeper.frozen > 0
