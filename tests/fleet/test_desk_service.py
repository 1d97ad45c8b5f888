"""The holder's side of a desk's inbox (:class:`~trading_agent.fleet.control.DeskService`):
an operator's message sent through NATS becomes one turn, stored once; a message a dead
holder had stored but not acknowledged reaches the next holder twice (from the store and
again from the inbox) and is taken once.

Real parts: a supervisor running a desk against the scripted model server, the store on a
PostgreSQL database of the test's own, NATS with a prefix of the test's own.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from tests.daemon.harness import build_desk, close_backend, wait_for
from tests.fleet.test_bus import KEY, QUICK
from tests.postgres import fresh_database
from tests.scripted_server import Reply, ScriptedServer
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.steering_inbox import SteeringMessage
from trading_agent.daemon.desk import Desk
from trading_agent.daemon.supervisor import DeskRuntime, Supervisor
from trading_agent.fleet.bus import DeskUnreachable, FleetBus
from trading_agent.fleet.control import DeskService
from trading_agent.store.store import Store


@asynccontextmanager
async def _holder(store: Store, scripted_server: ScriptedServer, bus: FleetBus
                  ) -> AsyncIterator[tuple[Desk, anyio.abc.TaskGroup]]:
    """Desk alpha running under a supervisor, its inbox served by a DeskService."""
    events = EventBus()
    desk = build_desk("alpha", store, scripted_server.base_url, events)
    supervisor = Supervisor([DeskRuntime(desk)], events, store)
    try:
        async with anyio.create_task_group() as group:
            await group.start(supervisor.run)
            group.start_soon(DeskService(supervisor, bus, store.inbox).run, "alpha")
            yield desk, group
            supervisor.shutdown()
            await supervisor.stopped.wait()
            group.cancel_scope.cancel()
    finally:
        await close_backend(desk)


async def test_inbox_messages_are_taken_once_even_one_a_dead_holder_left_unacknowledged(
        scripted_server: ScriptedServer, nats_url: str, nats_prefix: str) -> None:
    scripted_server.add(Reply("Seen: nothing to do."), Reply("Seen: nothing to do."))
    with fresh_database() as target:
        store = await Store.open(target)
        try:
            async with FleetBus.connect(nats_url, "d1", prefix=nats_prefix,
                                        options=dataclasses.replace(QUICK), key=KEY) as bus:
                # A holder that died: it stored message "m-old" and never acknowledged it.
                await bus.send_to_desk("alpha", "m-old", {
                    "op": "message", "desk": "alpha", "text": "Stored by the daemon that died.",
                    "source": "ann", "images": []})
                inbox = await bus.inbox("alpha")
                first = await anext(inbox)
                await store.inbox.add_operator_message(
                    "alpha", SteeringMessage("Stored by the daemon that died.", "ann",
                                             id="m-old"))
                await inbox.close()  # given back unacknowledged: delivered again

                async with _holder(store, scripted_server, bus) as (desk, _):
                    assert await bus.send_to_desk("alpha", "m-new", {
                        "op": "message", "desk": "alpha", "text": "How does BTC look?",
                        "source": "ann",
                        "images": []})
                    # The same id again (a sender retrying) is kept once by the server.
                    assert not await bus.send_to_desk("alpha", "m-new", {
                        "op": "message", "desk": "alpha", "text": "How does BTC look?",
                        "source": "ann",
                        "images": []})
                    await wait_for(lambda: desk.turns >= 2, within=10)
                    await anyio.sleep(1.5)  # room for a second turn, which must not come
                    turns = desk.turns
                transcript = await store.transcripts.transcript("alpha")
        finally:
            await store.close()

    assert first.message_id == "m-old"
    assert turns == 2
    assert [(row["kind"], row["id"]) for row in transcript if row["role"] == "user"] == [
        ("operator", "m-old"), ("operator", "m-new")]
    assert len(scripted_server.requests) == 2


@pytest.mark.parametrize("how", ["handed over", "daemon stopping"])
async def test_a_desk_handed_over_gives_a_waiting_sender_its_last_turns_answer(
        scripted_server: ScriptedServer, nats_url: str, nats_prefix: str, how: str) -> None:
    """A ``send --wait`` from another daemon, then a graceful hand-over while the turn that
    reads it runs: the inbox closes at once (a message sent then waits for the next holder),
    the turn ends, and the sender gets its answer, where it was told that the desk left. The
    same when the daemon stops (SIGTERM): the sender gets the outcome of the turn the
    shutdown stopped."""
    released = threading.Event()
    scripted_server.add(Reply("Seen: nothing to do.", hold_until=released))
    message = {"op": "message", "desk": "alpha", "text": "How does BTC look?", "source": "ann",
               "images": []}
    replies: list[dict[str, Any]] = []
    with fresh_database() as target:
        store = await Store.open(target)
        try:
            async with FleetBus.connect(nats_url, "holder", prefix=nats_prefix,
                                        options=dataclasses.replace(QUICK), key=KEY) as bus, \
                    FleetBus.connect(nats_url, "sender", prefix=nats_prefix,
                                     options=dataclasses.replace(QUICK), key=KEY) as sender:
                events = EventBus()
                desk = build_desk("alpha", store, scripted_server.base_url, events)
                supervisor = Supervisor([DeskRuntime(desk)], events, store)
                service = DeskService(supervisor, bus, store.inbox)
                supervisor.on_shutdown.append(service.stopping)  # as the fleet's node does
                serving = anyio.CancelScope()

                async def serve() -> None:
                    with serving:
                        await service.run("alpha")

                async def wait_for_reply() -> None:
                    replies.append(await sender.request_control(
                        "alpha", {"op": "reply", "message_id": "m-1"}, 30.0))

                try:
                    async with anyio.create_task_group() as group:
                        await group.start(supervisor.run)
                        group.start_soon(serve)
                        with anyio.fail_after(10):  # as FleetControl.send_message sends it
                            while True:
                                try:
                                    await sender.request_control("alpha", {
                                        "op": "expect", "message_id": "m-1"}, 2.0)
                                    break
                                except DeskUnreachable:  # not served yet
                                    await anyio.sleep(0.05)
                        await sender.send_to_desk("alpha", "m-1", message)
                        group.start_soon(wait_for_reply)
                        await wait_for(lambda: len(scripted_server.requests) == 1, within=10)

                        if how == "handed over":  # as the fleet's node does it
                            await service.stop_taking("alpha")
                            await sender.send_to_desk("alpha", "m-2",
                                                      {**message, "text": "Later."})
                            async with anyio.create_task_group() as handing_over:
                                handing_over.start_soon(functools.partial(
                                    supervisor.remove_desk, "alpha", finish_turn=True))
                                released.set()  # the turn ends
                            serving.cancel()
                        else:  # the services end once the desks have stopped
                            supervisor.shutdown()
                            released.set()
                            await supervisor.stopped.wait()
                            serving.cancel()
                        await wait_for(lambda: bool(replies), within=10)
                        supervisor.shutdown()
                        await supervisor.stopped.wait()
                        group.cancel_scope.cancel()
                finally:
                    await close_backend(desk)
                if how == "handed over":
                    async with await bus.inbox("alpha") as next_holder:  # the next holder's
                        waiting = await anext(next_holder)
                    assert waiting.message_id == "m-2"
        finally:
            await store.close()

    # The model's answer was final: the turn ended with it, the shutdown's safe point.
    assert replies == [{"result": {"ok": True, "text": "Seen: nothing to do.", "error": ""}}]
    assert desk.turns == 1 and len(scripted_server.requests) == 1
