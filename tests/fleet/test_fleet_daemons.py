"""A fleet of real daemons on one PostgreSQL and one NATS: desks spread, a daemon killed and
its desks taken over, a graceful stop handing over at once, a paused daemon fenced off.

Each daemon is ``trading-agent run`` in a process of its own, on one config (the store's URL
and NATS'), with its own state directory (its operator socket) and daemon id. The model is
the careful scripted trader of the kill tests: each ``Turn N: ...`` message opens a turn of
five rounds that buys at market, rests a limit buy, cancels it and sells, then answers
``Turn N done.``. After each disruption every desk's books are audited as after a ``kill
-9`` (:func:`tests.daemon.careful_trading.audit`): no message lost or twice, every call
answered, the ledger equal to the transcript, no client order id twice.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from tests.daemon.careful_trading import CarefulTrader, audit
from tests.daemon.process import short_dir
from tests.fleet.books import read_fleet_books
from tests.fleet.daemons import DESKS, LEASE_SECONDS, Fleet, desk_of, ends_with, fleet_config
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, Step
from tests.waiting import wait_until
from trading_agent.operator.client import OperatorRequestError

pytestmark = pytest.mark.slow

TAKE_OVER_BOUND = 30.0

_HOLD = 0.15
"""Seconds the server holds each model reply: a turn of five rounds takes about a second,
long enough to be cut in its middle."""


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_dir() as path:
        yield path


@pytest.mark.timeout(240)
async def test_a_killed_daemons_desks_are_taken_over_and_a_stopped_ones_handed_over(
        scripted_server: ScriptedServer, folder: Path, fleet_database: str,
        nats_prefix: str) -> None:
    """Three daemons share six desks; one is killed with SIGKILL in the middle of a turn of
    orders: the others take its desks within the lease plus a look, the cut-off turns
    resume and end, and the books hold every order once. Then a graceful stop hands its
    desks over at once, and the last daemon runs all six."""
    trader = CarefulTrader(hold=_HOLD)
    scripted_server.responder = trader
    fleet = Fleet(folder, fleet_config(folder, scripted_server.base_url, fleet_database,
                                       nats_prefix), fleet_database)
    try:
        for daemon_id in ("d1", "d2", "d3"):
            fleet.start(daemon_id)
        for daemon in fleet.daemons.values():
            await daemon.wait_ready(within=30)
        holders = await fleet.wait_held("d1", ["d1", "d2", "d3"], within=30)
        victims = [desk for desk, daemon in holders.items() if daemon == "d3"]
        assert len(victims) == 2, holders

        # d1's and d2's event streams, open before any turn: both must show every desk's
        # turn, with the same ids.
        seen: dict[str, list[tuple[int | None, str]]] = {"d1": [], "d2": []}
        opened = {daemon_id: anyio.Event() for daemon_id in seen}
        elsewhere = next(desk for desk, daemon in holders.items() if daemon == "d2")
        async with anyio.create_task_group() as watching:
            for daemon_id in seen:
                watching.start_soon(_watch_turn_ends, fleet, daemon_id, seen[daemon_id],
                                    opened[daemon_id])
            with anyio.fail_after(15):
                for event in opened.values():
                    await event.wait()
            # send --wait through d1 to a desk d2 runs: the answer of a turn that ends at
            # once.
            async with fleet.daemons["d1"].client() as client:
                try:
                    answered = await client.send_and_wait(elsewhere, "Anything new?", "ann",
                                                          wait_seconds=20)
                except OperatorRequestError as exc:
                    raise AssertionError(f"{elsewhere} (on d2): {exc}\n"
                                         f"{fleet.logs(tail=8000)}") from exc
            fleet.sent[elsewhere].append(answered["id"])
            assert answered["reply"] == {"ok": True, "text": "Noted.", "error": ""}, answered
            # Every message goes through d1: four of the six desks run elsewhere.
            await fleet.send_turn("d1", 1)
            await fleet.wait_answered(1)
            with anyio.fail_after(10):
                while (len(seen["d1"]) < len(DESKS) + 1  # noqa: ASYNC110
                       or len(seen["d2"]) < len(DESKS) + 1):
                    await anyio.sleep(0.05)
            watching.cancel_scope.cancel()
        assert sorted(desk for _, desk in seen["d1"]) == sorted([*DESKS, elsewhere])
        assert seen["d1"] == seen["d2"]
        assert fleet.audit() == {}
        for desk in DESKS:  # a real turn of orders on each desk
            assert len(read_fleet_books(fleet_database, desk).orders) == 3

        # Turn 2, and d3 killed once its first desk is in the third round of the turn.
        base = len(scripted_server.requests)
        await fleet.send_turn("d1", 2)
        with anyio.fail_after(30):
            while sum(desk_of(r) == victims[0]  # noqa: ASYNC110 (other processes)
                      for r in scripted_server.requests[base:]) < 3:
                await anyio.sleep(0.01)
        killed_at = time.monotonic()
        fleet.daemons["d3"].kill()
        await fleet.wait_held("d1", ["d1", "d2"], within=TAKE_OVER_BOUND)
        take_over = time.monotonic() - killed_at
        await fleet.wait_answered(2)
        assert fleet.audit() == {}, fleet.logs()
        assert take_over < TAKE_OVER_BOUND

        # A graceful stop hands d2's desks to d1 at once, not after the lease.
        stopped_at = time.monotonic()
        fleet.daemons["d2"].signal(signal.SIGTERM)
        assert await fleet.daemons["d2"].wait_exit(15) == 0, fleet.logs()
        await fleet.wait_held("d1", ["d1"], within=LEASE_SECONDS * 3)
        hand_over = time.monotonic() - stopped_at
        await fleet.send_turn("d1", 3)
        await fleet.wait_answered(3)
        assert fleet.audit() == {}, fleet.logs()
        print(f"\ntake-over after SIGKILL: {take_over:.2f} s (lease {LEASE_SECONDS:g} s); "
              f"hand-over on SIGTERM: {hand_over:.2f} s")
    finally:
        fleet.close()


@pytest.mark.timeout(120)
async def test_a_paused_daemon_that_lost_its_lease_cannot_write(
        scripted_server: ScriptedServer, folder: Path, fleet_database: str,
        nats_prefix: str) -> None:
    """A daemon stopped (SIGSTOP) in the middle of a turn, past its lease: another takes the
    desk over and ends the turn; when the paused one wakes and its model's late reply
    arrives, its writes are refused, and nothing it did after losing the lease is in the
    books."""
    trader = CarefulTrader(hold=_HOLD)
    late = threading.Event()
    held_once: list[RecordedRequest] = []

    def respond(request: RecordedRequest) -> Step:
        step = trader(request)
        # The first desk's second round, on the first daemon, waits until the test says.
        if not held_once and sum(desk_of(r) == DESKS[0] for r in scripted_server.requests) == 2:
            held_once.append(request)
            assert isinstance(step, Reply)
            return dataclasses.replace(step, hold_until=late)
        return step

    scripted_server.responder = respond
    fleet = Fleet(folder, fleet_config(folder, scripted_server.base_url, fleet_database,
                                       nats_prefix, desks=DESKS), fleet_database)
    paused, sessions = "", list[tuple[object, ...]]()
    try:
        fleet.start("p1")
        await fleet.daemons["p1"].wait_ready(within=30)
        await fleet.wait_held("p1", ["p1"], within=30)
        fleet.start("p2")
        await fleet.daemons["p2"].wait_ready(within=30)
        holders = await fleet.wait_held("p2", ["p1", "p2"], within=30)
        paused = holders[DESKS[0]]
        other = "p2" if paused == "p1" else "p1"

        async with fleet.daemons[other].client() as client:
            reply = await client.send_message(DESKS[0], "Turn 1: trade as planned.", "ann")
        fleet.sent[DESKS[0]].append(reply["id"])
        with anyio.fail_after(30):
            while not held_once:  # noqa: ASYNC110 (other processes)
                await anyio.sleep(0.01)
        fleet.daemons[paused].signal(signal.SIGSTOP)
        try:
            # The lease runs out and the other daemon takes the desk and ends the turn.
            with anyio.fail_after(TAKE_OVER_BOUND):
                while (await fleet.holders(other))[DESKS[0]] != other:  # noqa: ASYNC110 (other processes)
                    await anyio.sleep(0.1)
            await _wait_desk_answered(fleet, DESKS[0], "Turn 1 done.")
            # Its model's late reply is waiting when it wakes: the first thing it does is
            # to append it (and run its order), before it learns the lease is gone.
            late.set()
            await wait_until(lambda: any(r is held_once[0] for r in scripted_server.answered),
                             "the late reply sent to the stopped daemon")
        finally:
            sessions = fleet.sessions()  # while it is stopped, for a failure's report
            fleet.daemons[paused].signal(signal.SIGCONT)
        log = fleet.daemons[paused].log
        # Its write refused, and then the renewal tells it the lease is gone: it stops the
        # desk, and nothing more of that desk's is written from there.
        await wait_until(lambda: "the write was refused" in log()
                         and "fleet_lease_lost" in log(),
                         "the paused daemon's refused write and its lost lease", within=30,
                         step=0.1)
        books = read_fleet_books(fleet_database, DESKS[0])
        assert audit(books, fleet.sent[DESKS[0]]) == set(), fleet.logs()
        assert ends_with(books.messages, "Turn 1 done.")
        assert "fleet_lease_lost" in log()
        refused = [line for line in log().splitlines() if "the write was refused" in line]
        assert any(f"desk {DESKS[0]}:" in line for line in refused), refused
        print("\nrefused on the paused daemon:\n" + "\n".join(line[:300] for line in refused))
    except TimeoutError:
        raise AssertionError(f"timed out; the database's sessions while {paused} was stopped: "
                             f"{sessions}\n{fleet.logs(6000)}") from None
    finally:
        fleet.close()


async def _watch_turn_ends(fleet: Fleet, daemon_id: str, into: list[tuple[int | None, str]],
                           opened: anyio.Event) -> None:
    """Collects the turn ends a daemon's event stream shows from now on, as ``(id, desk)``;
    ``opened`` is set once the stream is open."""
    async with fleet.daemons[daemon_id].client() as client:
        async for event in client.events():
            if event.type == "stream_open":
                opened.set()
            if event.type == "turn_end" and not event.data.get("subagent"):
                into.append((event.id, str(event.data["desk"])))


async def _wait_desk_answered(fleet: Fleet, desk: str, answer: str, within: float = 60) -> None:
    with anyio.fail_after(within):
        while not ends_with(read_fleet_books(fleet.store_url, desk).messages, answer):  # noqa: ASYNC110 (other processes)
            await anyio.sleep(0.2)
