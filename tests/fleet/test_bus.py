"""The fleet's bus against the machine's NATS: events in one order on every daemon, desk
inboxes taken once by whoever holds the desk, requests answered by the holder, NATS lost and
found again. Each test has its own prefix, so its own streams (deleted afterwards)."""

from __future__ import annotations

import dataclasses
import re
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import nats
import pytest
from anyio.abc import SocketAttribute
from nats.js.api import RetentionPolicy, StreamConfig

from tests.fleet.own_nats import own_nats_server
from trading_agent.errors import ConfigError
from trading_agent.fleet.bus import (
    BusOptions,
    DeskInbox,
    DeskUnreachable,
    FleetBus,
    FleetEvent,
    FleetUnavailableError,
    InboxMessage,
)

KEY = b"a test fleet key of 32 bytes or more"
"""The fleet's key every bus of these tests seals with."""

QUICK = BusOptions(ack_wait=1.0, inbox_poll=0.5, request_timeout=2.0, connect_timeout=1.0,
                   reconnect_wait=0.1, close_timeout=1.0)
"""Short waits, so that a redelivery or a reconnect takes a second, not half a minute."""


def _bus(url: str, prefix: str, daemon: str, **changes: Any
         ) -> AbstractAsyncContextManager[FleetBus]:
    return FleetBus.connect(url, daemon, prefix=prefix,
                            options=dataclasses.replace(QUICK, **changes), key=KEY)


async def _take(feed: AsyncGenerator[FleetEvent, None], count: int) -> list[FleetEvent]:
    taken: list[FleetEvent] = []
    with anyio.fail_after(5):
        async with aclosing(feed):
            async for event in feed:
                taken.append(event)
                if len(taken) == count:
                    break
    return taken


async def _next(inbox: DeskInbox, within: float = 5.0) -> InboxMessage:
    with anyio.fail_after(within):
        return await anext(inbox)


async def _nothing_for(inbox: DeskInbox, seconds: float) -> None:
    with anyio.move_on_after(seconds):
        message = await anext(inbox)
        pytest.fail(f"{message!r} came to the {inbox.desk} inbox")


async def _until(condition: Callable[[], bool], what: str, within: float = 5.0) -> None:
    """Polls ``condition`` until it holds."""
    try:
        with anyio.fail_after(within):
            while True:
                if condition():
                    return
                await anyio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# ---------------------------------------------------------------------- events


async def test_events_of_two_daemons_reach_a_third_in_one_order_with_the_same_ids(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "d1") as d1, \
            _bus(nats_url, nats_prefix, "d2") as d2, \
            _bus(nats_url, nats_prefix, "d3") as d3:
        start = await d3.last_event_sequence()
        async with anyio.create_task_group() as group:
            seen: dict[str, list[FleetEvent]] = {}

            async def watch(bus: FleetBus) -> None:
                seen[bus.daemon_id] = await _take(bus.events(after=start), 40)

            group.start_soon(watch, d3)
            group.start_soon(watch, d1)
            for n in range(1, 21):
                d1.publish_event("alpha", {"id": n, "type": "text", "n": n})
                d2.publish_event("bravo", {"id": n, "type": "text", "n": n})
                await anyio.lowlevel.checkpoint()

    assert seen["d3"] == seen["d1"]  # the same events, order and ids on two daemons
    events = seen["d3"]
    assert [event.seq for event in events] == list(range(start + 1, start + 41))
    for daemon, desk in (("d1", "alpha"), ("d2", "bravo")):
        mine = [event for event in events if event.daemon == daemon]
        assert [event.data["n"] for event in mine] == list(range(1, 21))
        assert {event.desk for event in mine} == {desk}
    assert d1.events_dropped == d2.events_dropped == 0


async def test_a_viewer_resumes_exactly_after_the_id_it_had_then_follows_live(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "d1") as bus:
        for n in range(1, 6):
            bus.publish_event("alpha" if n % 2 else "bravo", {"id": n, "n": n})
        kept = await _take(bus.events(after=0), 5)
        seqs = [event.seq for event in kept]

        resumed = await _take(bus.events(after=seqs[2]), 2)
        assert [event.seq for event in resumed] == seqs[3:]

        async with aclosing(bus.events(after=seqs[4])) as feed:
            bus.publish_event("alpha", {"id": 6, "n": 6})
            with anyio.fail_after(5):
                live = await anext(feed)
        assert (live.seq, live.data["n"]) == (seqs[4] + 1, 6)

        assert [event.seq for event in await bus.events_between(seqs[0], 2)] == seqs[1:3]
        assert [event.data["n"] for event in await bus.events_between(0, 10, "bravo")] == [2, 4]
        assert await bus.events_between(live.seq, 10) == []
        assert await bus.last_event_sequence() == live.seq


async def test_events_from_now_leave_out_what_came_before(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "d1") as bus:
        bus.publish_event("alpha", {"id": 1, "n": "before"})
        await _take(bus.events(after=0), 1)  # kept before the viewer comes
        async with aclosing(bus.events()) as feed, anyio.create_task_group() as group:
            first: list[FleetEvent] = []

            async def read() -> None:
                first.append(await anext(feed))

            group.start_soon(read)
            with anyio.fail_after(5):
                n = 2
                while not first:  # until the viewer's subscription is in place
                    bus.publish_event("alpha", {"id": n, "n": "after"})
                    n += 1
                    await anyio.sleep(0.05)
        assert first[0].data["n"] == "after"


async def test_an_event_sent_twice_by_a_daemon_is_kept_once(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "d1") as d1, \
            _bus(nats_url, nats_prefix, "d1") as d1_again, \
            _bus(nats_url, nats_prefix, "d2") as d2:
        d1.publish_event("alpha", {"id": 7, "n": 1})
        await _take(d1.events(after=0), 1)
        d1_again.publish_event("alpha", {"id": 7, "n": 1})  # as after a reconnect
        d2.publish_event("alpha", {"id": 7, "n": 2})  # another daemon's event 7
        d1_again.publish_event("alpha", {"id": 8, "n": 3})  # stored after its copy of 7
        kept = await _take(d1.events(after=0), 3)
        assert [(event.daemon, event.data["n"]) for event in kept[:1]] == [("d1", 1)]
        assert sorted((event.daemon, event.data["n"]) for event in kept) == [
            ("d1", 1), ("d1", 3), ("d2", 2)]
        assert len(await d1.events_between(0, 10)) == 3


async def test_a_forged_event_is_shown_nowhere_and_holds_no_page_up(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "d1", request_timeout=5.0) as bus:
        nc = await nats.connect(nats_url, allow_reconnect=False)
        try:
            bus.publish_event("alpha", {"id": 1, "n": 1})
            await _take(bus.events(after=0), 1)
            # Kept by the stream like any event, but sealed by no daemon of the fleet.
            await nc.jetstream().publish(f"{nats_prefix}.events.alpha", b'{"n": "forged"}')
            for n in (2, 3):
                bus.publish_event("alpha", {"id": n, "n": n})
            live = await _take(bus.events(after=0), 3)
            page = await bus.events_between(0, 3)
            began = time.monotonic()
            everything = await bus.events_between(0, 100)
            took = time.monotonic() - began
        finally:
            await nc.close()
    assert [event.data["n"] for event in live] == [1, 2, 3]
    assert [event.data["n"] for event in page] == [1, 2, 3]  # the page still fills
    assert [event.data["n"] for event in everything] == [1, 2, 3]
    assert took < 1.0  # not the fetch's 5 s wait for the event that was refused


async def test_what_is_queued_is_sent_when_the_bus_closes(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "d1") as bus:
        for n in range(1, 201):
            bus.publish_event("alpha", {"id": n, "n": n})
        assert bus.events_waiting > 0
    async with _bus(nats_url, nats_prefix, "d2") as other:
        kept = await other.events_between(0, 500)
    assert [event.data["n"] for event in kept] == list(range(1, 201))


async def test_an_event_that_cannot_go_is_dropped_and_counted_never_raised(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "d1") as bus:
        bus.publish_event("no.dots", {"id": 1})
        bus.publish_event("alpha", {"id": 2, "price": object()})
        bus.publish_event("alpha", {"id": 3, "text": "x" * 2_000_000})
        assert bus.events_dropped == 3
    bus.publish_event("alpha", {"id": 4})  # closed
    assert bus.events_dropped == 4


# ---------------------------------------------------------------------- desk inboxes


async def test_a_message_sent_twice_with_one_id_is_delivered_once(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "sender") as sender, \
            _bus(nats_url, nats_prefix, "holder") as holder:
        assert await sender.send_to_desk("alpha", "m-1", {"text": "Sell half."}) is True
        assert await sender.send_to_desk("alpha", "m-1", {"text": "Sell half."}) is False
        async with await holder.inbox("alpha") as inbox:
            message = await _next(inbox)
            assert (message.message_id, message.payload, message.delivered) == (
                "m-1", {"text": "Sell half."}, 1)
            await message.ack()
            # Handled, and still within the window: a resend is dropped all the same.
            assert await sender.send_to_desk("alpha", "m-1", {"text": "Sell half."}) is False
            await _nothing_for(inbox, 1.5)  # past ack_wait: the ack held


async def test_a_closed_inbox_hands_what_it_did_not_ack_to_the_next_holder_at_once(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "sender") as sender, \
            _bus(nats_url, nats_prefix, "old", ack_wait=30.0) as old, \
            _bus(nats_url, nats_prefix, "new", ack_wait=30.0) as new:
        await sender.send_to_desk("alpha", "m-1", {"n": 1})
        await sender.send_to_desk("alpha", "m-2", {"n": 2})
        first_holder = await old.inbox("alpha")
        handled = await _next(first_holder)
        taken = await _next(first_holder)
        await handled.ack()
        await first_holder.close()  # the lease handed over, m-2 not acknowledged

        async with await new.inbox("alpha") as inbox:
            again = await _next(inbox, within=3.0)  # far sooner than ack_wait
            assert (again.message_id, again.delivered) == (taken.message_id, 2) == ("m-2", 2)
            await again.ack()
            await _nothing_for(inbox, 1.0)


async def test_a_holder_that_dies_leaves_its_unacked_message_to_the_next_after_ack_wait(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "sender") as sender:
        await sender.send_to_desk("alpha", "m-1", {"n": 1})
        async with _bus(nats_url, nats_prefix, "doomed") as doomed:
            inbox = await doomed.inbox("alpha")
            await _next(inbox)
            # The daemon goes without closing its inbox or acknowledging: as after SIGKILL.
        async with _bus(nats_url, nats_prefix, "heir") as heir, await heir.inbox("alpha") as heirs:
            message = await _next(heirs)
            assert (message.message_id, message.delivered) == ("m-1", 2)


async def test_a_desks_messages_never_reach_another_desks_inbox(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "sender") as sender, \
            _bus(nats_url, nats_prefix, "holder") as holder:
        await sender.send_to_desk("alpha", "a-1", {"for": "alpha"})
        await sender.send_to_desk("bravo", "b-1", {"for": "bravo"})
        async with await holder.inbox("bravo") as bravo:
            message = await _next(bravo)
            assert (message.message_id, message.payload) == ("b-1", {"for": "bravo"})
            await message.ack()
            await _nothing_for(bravo, 1.0)
        async with await holder.inbox("alpha") as alpha:  # kept until alpha had a holder
            assert (await _next(alpha)).message_id == "a-1"


async def test_closing_an_inbox_from_another_task_ends_its_iteration(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "holder", inbox_poll=30.0) as holder:
        inbox = await holder.inbox("alpha")
        ended = anyio.Event()

        async def serve() -> None:
            async for _ in inbox:
                pass
            ended.set()

        async with anyio.create_task_group() as group:
            group.start_soon(serve)
            await anyio.sleep(0.2)  # waiting in its (long) fetch
            await inbox.close()
            with anyio.fail_after(2):
                await ended.wait()


async def test_bad_desk_names_and_message_ids_are_refused(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "d1") as bus:
        for desk in ("a.b", "a*", "", "a b"):
            with pytest.raises(ValueError, match="desk"):
                await bus.send_to_desk(desk, "m-1", {})
            with pytest.raises(ValueError, match="desk"):
                await bus.inbox(desk)
        with pytest.raises(ValueError, match="message id"):
            await bus.send_to_desk("alpha", "", {})


# ---------------------------------------------------------------------- requests


async def test_the_server_has_read_the_subscription_when_serve_control_returns(
        nats_prefix: str) -> None:
    """nats-py writes a flush's PING straight to the socket, ahead of a SUB still waiting
    for its flusher task: the PONG could come before the server had read the SUB, and a
    request sent at once found no daemon serving the desk (seen on a loaded machine). On
    the wire the SUB goes first, so the flush's PONG vouches for it."""
    async def answer(request: dict[str, Any]) -> dict[str, Any]:
        return request

    async with _relay() as relay, _bus(relay.url, nats_prefix, "holder") as holder:
        start = len(relay.sent)
        await holder.serve_control("alpha", answer)
        wire = bytes(relay.sent[start:])
        sub = wire.find(f"SUB {nats_prefix}.control.alpha ".encode())
        assert sub >= 0, wire
        assert b"PING\r\n" in wire[sub:], wire


async def test_the_holder_answers_requests_and_its_errors_come_back_as_errors(
        nats_url: str, nats_prefix: str) -> None:
    async def answer(request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "fail":
            raise RuntimeError("no such order")
        if request["op"] == "slow":
            await anyio.sleep_forever()
        return {"result": request["n"] * 2}

    async with _bus(nats_url, nats_prefix, "holder") as holder, \
            _bus(nats_url, nats_prefix, "asker") as asker:
        served = await holder.serve_control("alpha", answer)
        assert await asker.request_control("alpha", {"op": "double", "n": 21}) == {"result": 42}
        assert await asker.request_control("alpha", {"op": "fail"}) == {
            "error": "RuntimeError: no such order"}
        cut_short: list[dict[str, Any]] = []

        async def ask_slowly() -> None:
            cut_short.append(await asker.request_control("alpha", {"op": "slow"}, 60.0))

        async with anyio.create_task_group() as group:
            group.start_soon(ask_slowly)
            # A slow request holds no other back, and serving goes on after a failure.
            assert await asker.request_control("alpha", {"op": "double", "n": 1}) == {"result": 2}
            began = time.monotonic()
            with pytest.raises(DeskUnreachable, match=r"alpha: no answer within 0\.3 s"):
                await asker.request_control("alpha", {"op": "slow"}, timeout=0.3)
            assert time.monotonic() - began < 1.0
            # The slow ones are cancelled, and their askers told at once (not after 60 s)
            # that the desk left the daemon answering.
            began = time.monotonic()
            await served.stop()
        assert time.monotonic() - began < 5.0
        assert [answer["error"] for answer in cut_short] == [
            "the desk left the daemon that was answering (handed over, its lease lost, or "
            "that daemon stopping); ask again"]

        began = time.monotonic()
        with pytest.raises(DeskUnreachable, match="alpha") as caught:
            await asker.request_control("alpha", {"op": "double", "n": 1}, timeout=2.0)
        assert time.monotonic() - began < 2.5
        assert caught.value.desk == "alpha"


async def test_a_graceful_stop_lets_the_answers_being_written_go_out(
        nats_url: str, nats_prefix: str) -> None:
    """A desk handed over stops taking requests, then gives those being answered a grace:
    one whose answer comes within it is answered (its desk's last turn ended), one still
    waiting after it is told the desk left."""
    soon, never = anyio.Event(), anyio.Event()

    async def answer(request: dict[str, Any]) -> dict[str, Any]:
        await (soon if request["op"] == "soon" else never).wait()
        return {"result": request["op"]}

    answers: dict[str, dict[str, Any]] = {}
    async with _bus(nats_url, nats_prefix, "holder") as holder, \
            _bus(nats_url, nats_prefix, "asker") as asker:
        served = await holder.serve_control("alpha", answer)

        async def ask(op: str) -> None:
            answers[op] = await asker.request_control("alpha", {"op": op}, 30.0)

        async with anyio.create_task_group() as group:
            group.start_soon(ask, "soon")
            group.start_soon(ask, "never")
            with anyio.fail_after(10):
                while served._in_flight.count < 2:  # noqa: ASYNC110 (both are being answered)
                    await anyio.sleep(0.01)
            began = time.monotonic()
            async with anyio.create_task_group() as stopping:
                stopping.start_soon(served.stop, 1.0)
                await anyio.wait_all_tasks_blocked()  # the stop waits on those in flight
                soon.set()  # the turn ends during the grace
        assert answers["soon"] == {"result": "soon"}
        assert answers["never"]["error"].startswith("the desk left the daemon")
        assert 1.0 <= time.monotonic() - began < 5.0
        with pytest.raises(DeskUnreachable, match="no daemon serves it now"):
            await asker.request_control("alpha", {"op": "soon"}, timeout=2.0)


async def test_a_desk_nobody_serves_is_unreachable_within_the_timeout(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "asker") as asker:
        began = time.monotonic()
        with pytest.raises(DeskUnreachable, match="bravo"):
            await asker.request_control("bravo", {"op": "status"}, timeout=1.0)
        assert time.monotonic() - began < 1.5


async def test_a_daemon_hears_which_desks_another_let_go(
        nats_url: str, nats_prefix: str) -> None:
    async with _bus(nats_url, nats_prefix, "leaving") as leaving, \
            _bus(nats_url, nats_prefix, "staying") as staying:
        heard: list[str] = []

        async def listen() -> None:
            async with aclosing(staying.released()) as desks:
                async for desk in desks:
                    heard.append(desk)
                    if len(heard) == 2:
                        return

        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(listen)
                while len(heard) < 2:  # until the listener's subscription is in place
                    await leaving.announce_released(["alpha", "bravo"])
                    await anyio.sleep(0.05)
        assert heard == ["alpha", "bravo"]


# ---------------------------------------------------------------------- NATS lost and found


class _Gate:
    """Whether one relayed connection moves its bytes now."""

    def __init__(self) -> None:
        self.open = anyio.Event()
        self.open.set()


class NatsRelay:
    """A TCP relay on loopback in front of the machine's NATS, that a test cuts (NATS down,
    every connection through it dropped) and restores on the same port, or freezes (the
    connections open now hold their bytes, as a stopped process or a stalled network does;
    new ones flow) and thaws (what was held arrives, late)."""

    def __init__(self, group: anyio.abc.TaskGroup) -> None:
        self._group = group
        self.port = 0
        self._scope = anyio.CancelScope()
        self._gates: list[_Gate] = []
        self.connections = 0
        self.sent = bytearray()
        """Every byte the clients sent the server, in the order the relay read them."""

    def freeze(self) -> None:
        for gate in self._gates:
            gate.open = anyio.Event()

    def thaw(self) -> None:
        for gate in self._gates:
            gate.open.set()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def restore(self) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1",
                                                   local_port=self.port)
        self.port = listener.extra(SocketAttribute.local_port)
        self._scope = anyio.CancelScope()
        self._group.start_soon(self._serve, listener, self._scope)

    def cut(self) -> None:
        self._scope.cancel()

    async def _serve(self, listener: anyio.abc.SocketListener,
                     scope: anyio.CancelScope) -> None:
        with scope:
            async with listener:
                await listener.serve(self._relay)

    async def _relay(self, client: anyio.abc.SocketStream) -> None:
        gate = _Gate()
        self._gates.append(gate)
        self.connections += 1
        async with client, await anyio.connect_tcp("127.0.0.1", 4222) as server, \
                anyio.create_task_group() as pipes:
            pipes.start_soon(self._pipe, client, server, pipes.cancel_scope, gate, self.sent)
            await self._pipe(server, client, pipes.cancel_scope, gate)

    @staticmethod
    async def _pipe(source: anyio.abc.SocketStream, sink: anyio.abc.SocketStream,
                    scope: anyio.CancelScope, gate: _Gate,
                    record: bytearray | None = None) -> None:
        try:
            async for chunk in source:
                if record is not None:
                    record += chunk
                await gate.open.wait()
                await sink.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        scope.cancel()


@asynccontextmanager
async def _relay() -> AsyncIterator[NatsRelay]:
    async with anyio.create_task_group() as group:
        relay = NatsRelay(group)
        await relay.restore()
        yield relay
        relay.cut()


async def test_events_published_while_nats_is_down_are_bounded_dropped_and_never_raised(
        nats_url: str, nats_prefix: str) -> None:
    async with _relay() as relay, \
            _bus(relay.url, nats_prefix, "d1", max_waiting_events=100,
                 reconnect_buffer_bytes=64 * 1024) as bus, \
            _bus(nats_url, nats_prefix, "viewer") as viewer:
        relay.cut()
        await _until(lambda: not bus.is_connected, "the bus to see NATS gone")

        for n in range(1, 20_001):
            bus.publish_event("alpha", {"id": n, "text": "x" * 100})
            assert bus.events_waiting <= 100
        await _until(lambda: not bus.events_waiting, "the queue to empty")
        # Kept: 100 in the queue, then what fits the client's 64 KiB while it reconnects.
        assert bus.events_dropped >= 20_000 - 100 - 64 * 1024 // 100

        await relay.restore()  # NATS is back: the client reconnects, events flow again
        await _until(lambda: bus.is_connected, "the bus to reconnect")
        start = await viewer.last_event_sequence()
        bus.publish_event("alpha", {"id": 20_001, "text": "back"})
        # What the client buffered while away may still be arriving: "back" comes after it.
        arrived: list[str] = []
        with anyio.fail_after(5):
            async with aclosing(viewer.events(after=start - 1)) as feed:
                async for event in feed:
                    arrived.append(event.data["text"])
                    if event.data["text"] == "back":
                        break
        assert arrived[-1] == "back" and set(arrived[:-1]) <= {"x" * 100}


async def test_send_to_desk_says_when_nats_is_down(nats_prefix: str) -> None:
    from trading_agent.fleet.bus import FleetUnavailableError

    async with _relay() as relay, \
            _bus(relay.url, nats_prefix, "sender", request_timeout=0.5) as sender:
        relay.cut()
        await _until(lambda: not sender.is_connected, "the bus to see NATS gone")
        # Not connected: certainly not kept (the client would have held it, and maybe sent
        # it later), and said at once.
        with anyio.fail_after(0.5), pytest.raises(
                FleetUnavailableError, match=r"alpha: message m-1 was not kept: NATS is not "
                                             r"connected") as refused:
            await sender.send_to_desk("alpha", "m-1", {"n": 1})
        assert refused.value.kept is False
        with pytest.raises(DeskUnreachable, match="alpha"):
            await sender.request_control("alpha", {"op": "status"}, timeout=0.5)


async def test_a_pong_that_comes_late_leaves_the_bus_reading(
        nats_url: str, nats_prefix: str) -> None:
    # A flush gives up on its PONG (the daemon or the network stalled past its timeout),
    # then the PONG comes: nats-py's read loop died of it, for good (issue 30). Its own pings
    # are left far apart here, so that only the late PONG's handling can pass.
    async with _relay() as relay, \
            _bus(relay.url, nats_prefix, "holder", request_timeout=1.0,
                 ping_interval=120) as holder, \
            _bus(nats_url, nats_prefix, "reader") as reader:
        inbox = await reader.inbox("alpha")
        relay.freeze()
        await holder.announce_released(["alpha"])  # its flush times out, logged
        relay.thaw()  # the PONG arrives late
        with anyio.fail_after(3):
            assert await holder.send_to_desk("alpha", "m-after", {"n": 1})
        message = await _next(inbox)
        await message.ack()
        await inbox.close()
    assert (message.message_id, message.payload) == ("m-after", {"n": 1})
    assert relay.connections == 1  # the same connection, still read


async def test_a_connection_that_stops_answering_is_made_again(
        nats_url: str, nats_prefix: str) -> None:
    # The connection holds its bytes for good (a half-open socket, a stalled peer): the
    # bus's pings go unanswered and it connects again, its subscriptions with it.
    async with _relay() as relay, \
            _bus(relay.url, nats_prefix, "holder", request_timeout=0.5, ping_interval=0.2,
                 max_outstanding_pings=2) as holder, \
            _bus(nats_url, nats_prefix, "asker") as asker:
        async def status(request: dict[str, Any]) -> dict[str, Any]:
            return {"result": "alive"}

        served = await holder.serve_control("alpha", status)
        relay.freeze()
        with anyio.fail_after(10):
            while True:
                try:
                    answer = await asker.request_control("alpha", {"op": "status"},
                                                         timeout=0.5)
                    break
                except DeskUnreachable:
                    await anyio.sleep(0.05)
            sent = False
            while not sent:
                try:
                    sent = await holder.send_to_desk("alpha", "m-1", {"n": 1})
                except FleetUnavailableError:
                    await anyio.sleep(0.05)
        await served.stop()
        inbox = await asker.inbox("alpha")
        message = await _next(inbox)
        await message.ack()
        await inbox.close()
    assert answer == {"result": "alive"}
    assert relay.connections == 2
    assert message.message_id == "m-1"


# ---------------------------------------------------------------------- connecting


async def test_connect_names_the_url_but_never_its_password_when_nats_is_absent() -> None:
    port = _free_port()
    began = time.monotonic()
    shown = re.escape(f"cannot reach NATS at nats://ops:***@127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=shown) as caught:
        async with FleetBus.connect(f"nats://ops:hunter2@127.0.0.1:{port}", "d1", key=KEY):
            pass
    assert "hunter2" not in str(caught.value)
    assert time.monotonic() - began < 3.0


@pytest.fixture
def nats_without_jetstream() -> Iterator[str]:
    """A NATS server of the test's own, on loopback, with JetStream off."""
    with own_nats_server(jetstream=False) as port:
        yield f"nats://127.0.0.1:{port}"


async def test_connect_says_when_jetstream_is_off(nats_without_jetstream: str) -> None:
    with pytest.raises(ConfigError, match=f"{nats_without_jetstream} has no JetStream"):
        async with FleetBus.connect(nats_without_jetstream, "d1", key=KEY):
            pass


async def test_daemons_connecting_at_once_share_the_streams_and_later_limits_apply(
        nats_url: str, nats_prefix: str) -> None:
    joined: list[str] = []

    async def join(daemon: str) -> None:
        async with _bus(nats_url, nats_prefix, daemon):
            joined.append(daemon)

    async with anyio.create_task_group() as group:
        for daemon in ("d1", "d2", "d3", "d4"):
            group.start_soon(join, daemon)
    assert sorted(joined) == ["d1", "d2", "d3", "d4"]

    async with _bus(nats_url, nats_prefix, "d5", events_max_age=3600.0,
                    inbox_max_bytes=1 << 20):
        pass
    nc = await nats.connect(nats_url)
    try:
        events = await nc.jetstream().stream_info(f"{nats_prefix}_events")
        inbox = await nc.jetstream().stream_info(f"{nats_prefix}_inbox")
    finally:
        await nc.close()
    assert events.config.max_age == 3600.0
    assert inbox.config.max_bytes == 1 << 20
    assert inbox.config.retention == RetentionPolicy.WORK_QUEUE  # as the daemons made it


async def test_a_stream_still_being_made_is_waited_for_and_a_real_overlap_reported(
        nats_url: str, nats_prefix: str) -> None:
    """Daemons starting at once race to make the streams: the loser may hear that the
    subjects overlap with a stream still being made. A stream in the way for a moment (here
    one of another name on the inbox's subjects, removed after 0.1 s) is waited out; one
    that stays is reported, naming the stream."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    in_the_way = StreamConfig(name=f"{nats_prefix}_in_the_way",
                              subjects=[f"{nats_prefix}.inbox.*"])
    try:
        await js.add_stream(in_the_way)

        async def remove_soon() -> None:
            await anyio.sleep(0.1)
            await js.delete_stream(in_the_way.name)

        async with anyio.create_task_group() as group:
            group.start_soon(remove_soon)
            async with _bus(nats_url, nats_prefix, "d1") as bus:
                assert bus.is_connected

        await js.delete_stream(f"{nats_prefix}_inbox")
        await js.add_stream(in_the_way)
        with pytest.raises(ConfigError, match=rf"the stream {nats_prefix}_inbox on {nats_url} "
                                              r"cannot be set up: .*subjects overlap"):
            async with _bus(nats_url, nats_prefix, "d2"):
                pass
    finally:
        await nc.close()
