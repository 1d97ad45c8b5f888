"""The holder's side of a desk's inbox (:class:`~trading_agent.fleet.control.DeskService`):
an operator's message sent through NATS becomes one turn, stored once; a message a dead
holder had stored but not acknowledged reaches the next holder twice (from the store and
again from the inbox) and is taken once.

Real parts: a supervisor running a desk against the scripted model server, the store on a
PostgreSQL database of the test's own, NATS with a prefix of the test's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from tests.daemon.harness import build_desk, close_backend, wait_for
from tests.fleet.test_bus import KEY, QUICK
from tests.postgres import fresh_database
from tests.scripted_server import Reply, ScriptedServer
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.steering_inbox import SteeringMessage
from trading_agent.daemon.desk import Desk
from trading_agent.daemon.supervisor import DeskRuntime, Supervisor
from trading_agent.fleet.bus import FleetBus
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
