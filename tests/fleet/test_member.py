"""The leases of a fleet on a real PostgreSQL: a desk taken by one daemon at a time, its epoch
raised at each take-over; daemons that share six desks evenly, take a dead one's desks once
its leases run out and a leaving one's at once; and a daemon that lost a desk refused by the
store, a take-over waiting for a write in flight.

Each "daemon" is a :class:`FleetMember` with connections of its own (its own
``application_name`` in the URL, so the store opens it apart), all in one event loop; the
desks it is told to start and stop are recorded, not built.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AsyncExitStack
from typing import cast

import anyio
import pytest
from annotated_types import Ge

from tests.postgres import fresh_database
from trading_agent.agent.conversation import Message
from trading_agent.fleet.config import FleetSettings
from trading_agent.fleet.member import FleetMember, preference
from trading_agent.store import Connection, FencedError, PostgresTarget, Store
from trading_agent.store.database import Database
from trading_agent.store.desk_leases import EVENT_BLOCK, DeskLeases

DESKS = [f"desk-{number}" for number in range(6)]

LEASE_SECONDS = 2.0
"""Long enough for two beats of the roll (each daemon looks once a second), short enough
that a dead daemon's desks move within a few seconds."""


@pytest.fixture
def database() -> Iterator[PostgresTarget]:
    """A PostgreSQL database of the test's own (skipped where PostgreSQL is absent)."""
    with fresh_database() as target:
        yield target


def _as(database: PostgresTarget, daemon: str) -> PostgresTarget:
    """The database as ``daemon`` reaches it: connections of its own, as another process
    would have."""
    return PostgresTarget(f"{database.url}?application_name={daemon}")


async def _wait_until(condition: Callable[[], bool], within: float, what: str) -> float:
    """Waits until ``condition()`` holds; returns how long that took.

    Raises:
        AssertionError: It did not within ``within`` seconds.
    """
    started = anyio.current_time()
    with anyio.move_on_after(within):
        while not condition():  # noqa: ASYNC110 (the members' state, no event to wait on)
            await anyio.sleep(0.02)
        return anyio.current_time() - started
    raise AssertionError(f"not within {within} s: {what}")


# --------------------------------------------------------------------------- the leases


async def test_a_desk_is_held_by_one_daemon_until_its_lease_runs_out(
        database: PostgresTarget) -> None:
    async with AsyncExitStack() as stack:
        a = await DeskLeases.open(_as(database, "a"))
        stack.push_async_callback(a.close)
        b = await DeskLeases.open(_as(database, "b"))
        stack.push_async_callback(b.close)

        assert await a.acquire("alpha", "a", 0.5) == 1
        assert await b.acquire("alpha", "b", 0.5) is None  # a holds it
        assert await a.renew({"alpha": 1}, "a", 0.5) == {"alpha"}
        assert await b.renew({"alpha": 1}, "b", 0.5) == set()  # not b's to renew
        lease = (await b.leases())["alpha"]
        assert (lease.holder, lease.epoch, lease.live) == ("a", 1, True)

        # a stops renewing (dead, or paused): once the lease runs out, b takes the desk.
        with anyio.fail_after(3):
            while (await b.leases())["alpha"].live:  # noqa: ASYNC110 (the database's clock)
                await anyio.sleep(0.05)
        assert await b.acquire("alpha", "b", 5) == 2
        assert await a.renew({"alpha": 1}, "a", 5) == set()  # a learns it lost the desk
        assert await b.renew({"alpha": 2}, "b", 5) == {"alpha"}
        lease = (await a.leases())["alpha"]
        assert (lease.holder, lease.epoch, lease.live) == ("b", 2, True)
        assert await a.acquire("alpha", "a", 5) is None


async def test_a_released_desk_can_be_taken_at_once_and_a_stale_release_changes_nothing(
        database: PostgresTarget) -> None:
    async with AsyncExitStack() as stack:
        a = await DeskLeases.open(_as(database, "a"))
        stack.push_async_callback(a.close)
        b = await DeskLeases.open(_as(database, "b"))
        stack.push_async_callback(b.close)

        assert await a.acquire("alpha", "a", 60) == 1
        assert await a.acquire("beta", "a", 60) == 1
        await a.release([("alpha", 1)], "a")
        released = (await b.leases())["alpha"]
        assert (released.holder, released.live) == ("", False)
        assert await b.acquire("alpha", "b", 60) == 2  # at once, not in a minute
        await a.release([("alpha", 1)], "a")  # a's epoch is stale: b keeps the desk
        await b.release([("beta", 1)], "b")  # not b's: a keeps it
        leases = await b.leases()
        assert [(lease.desk, lease.holder, lease.epoch, lease.live)
                for lease in sorted(leases.values(), key=lambda lease: lease.desk)] == [
            ("alpha", "b", 2, True), ("beta", "a", 1, True)]


async def test_each_daemon_start_reserves_a_block_of_event_ids_of_its_own(
        database: PostgresTarget) -> None:
    async with AsyncExitStack() as stack:
        a = await DeskLeases.open(_as(database, "a"))
        stack.push_async_callback(a.close)
        b = await DeskLeases.open(_as(database, "b"))
        stack.push_async_callback(b.close)
        firsts = [await a.reserve_event_ids(), await b.reserve_event_ids(),
                  await a.reserve_event_ids()]
    assert all(first > 0 and first % EVENT_BLOCK == 0 for first in firsts), firsts
    starts = sorted(firsts)
    assert all(upper - lower >= EVENT_BLOCK  # disjoint blocks
               for lower, upper in itertools.pairwise(starts)), firsts


# --------------------------------------------------------------------------- the members


class Daemon:
    """A member of the test's fleet, the desks it was told to run, and its loops.

    Args:
        leases: Its own hold on the leases.
        name: Its daemon id.
        lease_seconds: How long its leases last unless renewed.
    """

    def __init__(self, leases: DeskLeases, name: str, lease_seconds: float) -> None:
        self.leases = leases
        self.name = name
        self.member = FleetMember(leases, name, DESKS, lease_seconds=lease_seconds,
                                  start_desk=self.start_desk, stop_desk=self.stop_desk)
        self.running: set[str] = set()
        """The desks started and not stopped since."""
        self.stops: list[tuple[str, bool]] = []
        """Each desk stopped, and whether because its lease was lost."""
        self._loops = anyio.CancelScope()

    async def start_desk(self, desk: str) -> None:
        assert desk not in self.running, f"{self.name} started {desk} twice"
        self.running.add(desk)

    async def stop_desk(self, desk: str, lost: bool) -> None:
        self.running.remove(desk)
        self.stops.append((desk, lost))

    async def run(self) -> None:
        with self._loops:
            await self.member.run()

    def kill(self) -> None:
        """Ends its loops as SIGKILL would: no renewal, no leave."""
        self._loops.cancel()


async def _daemons(stack: AsyncExitStack, database: PostgresTarget, names: Sequence[str],
                   lease_seconds: float) -> list[Daemon]:
    daemons = []
    for name in names:
        leases = await DeskLeases.open(_as(database, name))
        stack.push_async_callback(leases.close)
        daemons.append(Daemon(leases, name, lease_seconds))
    return daemons


def _spread(daemons: Sequence[Daemon]) -> dict[str, list[str]]:
    """Each daemon's desks, as its member holds them."""
    return {daemon.name: sorted(daemon.member.held) for daemon in daemons}


def _even(daemons: Sequence[Daemon]) -> bool:
    """Every desk held, by one daemon, each holding its fair share and running just those."""
    share = math.ceil(len(DESKS) / len(daemons))
    held = [desk for daemon in daemons for desk in daemon.member.held]
    return (sorted(held) == sorted(DESKS)
            and all(len(daemon.member.held) == share for daemon in daemons)
            and all(daemon.running == set(daemon.member.held) for daemon in daemons))


async def _check_leases(database: PostgresTarget, daemons: Sequence[Daemon]) -> None:
    """The leases in the database say what the members believe, every one live."""
    leases = await DeskLeases.open(_as(database, "observer"))
    try:
        stored = await leases.leases()
    finally:
        await leases.close()
    for daemon in daemons:
        for desk, epoch in daemon.member.held.items():
            lease = stored[desk]
            assert (lease.holder, lease.epoch, lease.live) == (daemon.name, epoch, True), lease


async def _run(stack: AsyncExitStack, daemons: Sequence[Daemon]) -> None:
    """Starts the daemons' loops, as daemons started together: each on the roll before any
    looks (else the first to look takes every desk and hands the others theirs)."""
    for daemon in daemons:
        await daemon.leases.heartbeat(daemon.name, within=daemon.member.lease_seconds)
    group = await stack.enter_async_context(anyio.create_task_group())
    stack.callback(group.cancel_scope.cancel)
    for daemon in daemons:
        group.start_soon(daemon.run)


async def test_three_daemons_share_six_desks_and_take_a_dead_ones_after_its_leases_run_out(
        database: PostgresTarget) -> None:
    async with AsyncExitStack() as stack:
        a, b, c = daemons = await _daemons(stack, database, ["a", "b", "c"], LEASE_SECONDS)
        await _run(stack, daemons)
        await _wait_until(lambda: _even(daemons), 5, f"2/2/2, got {_spread(daemons)}")
        await _check_leases(database, daemons)

        dead = dict(c.member.held)
        c.kill()
        taken = await _wait_until(lambda: _even([a, b]), LEASE_SECONDS + 4,
                                  f"3/3 after c died, got {_spread([a, b])}")
        # Not before its leases ran out: renewed a third of a lease at most before it died.
        assert taken >= LEASE_SECONDS * 2 / 3 - 0.1, taken
        await _check_leases(database, [a, b])
        now = {**a.member.held, **b.member.held}
        assert {desk: now[desk] for desk in dead} == {
            desk: epoch + 1 for desk, epoch in dead.items()}
        assert [stop for daemon in daemons for stop in daemon.stops] == []
        assert c.running == set(dead)  # the dead daemon was never told anything


async def test_a_daemon_above_its_share_hands_over_its_extra_desks_in_one_look(
        database: PostgresTarget) -> None:
    """Those preferring the other daemon first; at the end of their turns (not lost)."""
    async with AsyncExitStack() as stack:
        a, b = await _daemons(stack, database, ["a", "b"], lease_seconds=60)
        await a.member.balance()  # alone on the roll: every desk
        assert sorted(a.running) == DESKS
        await b.leases.heartbeat("b", within=60)  # b joins
        for held in (3, 3):
            await a.member.balance()
            assert len(a.member.held) == held  # down to its share at once, then stays
        given = [desk for desk, _ in a.stops]
        assert a.stops == [(desk, False) for desk in given]  # handed over, not lost
        assert a.running == set(a.member.held)
        prefer_b = {desk for desk in DESKS if preference(desk, "b") > preference(desk, "a")}
        assert prefer_b <= set(given) or set(given) <= prefer_b, (given, prefer_b)

        await b.member.balance()  # taken at once: a released them
        assert b.member.held == dict.fromkeys(given, 2)
        assert b.running == set(given)
        assert _even([a, b])
        await _check_leases(database, [a, b])


async def test_a_leaving_daemons_desks_are_taken_at_the_next_look_not_when_its_leases_run_out(
        database: PostgresTarget) -> None:
    lease_seconds = 10.0
    async with AsyncExitStack() as stack:
        a, b = daemons = await _daemons(stack, database, ["a", "b"], lease_seconds)
        for daemon in daemons:
            await daemon.leases.heartbeat(daemon.name, within=lease_seconds)
        with anyio.fail_after(5):
            while not _even(daemons):  # a look each, without waiting a second between
                for daemon in daemons:
                    await daemon.member.balance()
        await _run(stack, daemons)
        held_by_b = dict(b.member.held)

        # A graceful stop: the desks are stopped first, then the member leaves.
        for desk in sorted(b.running):
            await b.stop_desk(desk, False)
        given = await b.member.leave()
        b.kill()
        assert sorted(given) == sorted(held_by_b) and b.member.held == {}
        taken = await _wait_until(lambda: _even([a]), lease_seconds / 2,
                                  f"a holds all six, got {_spread([a])}")
        assert taken < 2.5, taken  # a look a second, well before the leases run out
        await _check_leases(database, [a])
        assert {desk: a.member.held[desk] for desk in given} == {
            desk: epoch + 1 for desk, epoch in held_by_b.items()}


def _shortest_lease() -> float:
    """The shortest lease the config allows (``fleet.lease_seconds``)."""
    bounds = FleetSettings.model_fields["lease_seconds"].metadata
    return next(cast(float, item.ge) for item in bounds if isinstance(item, Ge))


async def test_a_live_daemon_beats_at_least_twice_in_the_window_the_others_count_it_alive(
        database: PostgresTarget) -> None:
    lease_seconds = _shortest_lease()
    async with AsyncExitStack() as stack:
        [a] = await _daemons(stack, database, ["a"], lease_seconds)
        observer = await Database.open(_as(database, "observer"))
        stack.push_async_callback(observer.close)
        group = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(group.cancel_scope.cancel)
        group.start_soon(a.run)

        def last_beat(connection: Connection) -> float | None:
            row = connection.execute(
                "SELECT seen_at FROM fleet_daemons WHERE daemon_id = 'a'").fetchone()
            return None if row is None else float(row[0])

        beats: list[float] = []
        with anyio.fail_after(3 * lease_seconds + 2):
            while len(beats) < 2:
                beat = await observer.read(last_beat)
                if beat is not None and beat not in beats:
                    beats.append(beat)
                await anyio.sleep(0.01)
    # Two beats a window at least, so that one late beat does not make it look dead.
    assert beats[1] - beats[0] < lease_seconds / 2, (beats, lease_seconds)


# --------------------------------------------------------------------------- the fence


async def test_a_daemon_that_lost_a_desk_cannot_write_for_it(database: PostgresTarget) -> None:
    async with AsyncExitStack() as stack:
        a, b = await _daemons(stack, database, ["a", "b"], lease_seconds=1.0)
        # The stores open first: a's first write must come within its lease, which a
        # loaded machine's two opens could outlast.
        store_a = await Store.open(_as(database, "a"), fence=a.member)
        stack.push_async_callback(store_a.close)
        store_b = await Store.open(_as(database, "b"), fence=b.member)
        stack.push_async_callback(store_b.close)
        await a.member.balance()  # alone on the roll: a takes every desk
        assert sorted(a.member.held) == DESKS

        await store_a.transcripts.append_message("desk-0", Message.user_text("from a"))
        with pytest.raises(FencedError, match="desk-0"):
            await store_b.transcripts.append_message("desk-0",
                                                     Message.user_text("from b, too early"))

        # a is paused: it renews nothing, and believes it still holds the desks. Once they
        # run out, b takes them.
        with anyio.fail_after(5):
            while "desk-0" not in b.member.held:
                await b.member.balance()
                await anyio.sleep(0.1)
        assert (a.member.held["desk-0"], b.member.held["desk-0"]) == (1, 2)
        with pytest.raises(FencedError) as refused:
            await store_a.transcripts.append_message("desk-0",
                                                     Message.user_text("from a, too late"))
        assert (refused.value.desk, refused.value.epoch) == ("desk-0", 1)
        await store_b.transcripts.append_message("desk-0", Message.user_text("from b"))
        assert [row["text"] for row in await store_b.transcripts.transcript("desk-0")] == [
            "from a", "from b"]


_NOTES = ((1, ("CREATE TABLE notes (desk TEXT NOT NULL, text TEXT NOT NULL)",)),)


async def test_a_take_over_waits_for_the_old_holders_write_in_flight(
        database: PostgresTarget) -> None:
    async with AsyncExitStack() as stack:
        a, b = await _daemons(stack, database, ["a", "b"], lease_seconds=1.0)
        notes = await Database.open(_as(database, "a"), _NOTES, "test_notes", fence=a.member)
        stack.push_async_callback(notes.close)
        observer = await Database.open(_as(database, "observer"))
        stack.push_async_callback(observer.close)
        await a.member.balance()  # after the opens: the write must come within the lease
        written, finish = threading.Event(), threading.Event()

        def slow_note(connection: Connection) -> None:
            # The fence let it in (a held the desk); it commits only when the test says.
            connection.execute("INSERT INTO notes (desk, text) VALUES ('desk-0', 'in flight')")
            written.set()
            finish.wait(10)

        def lock_waits(connection: Connection) -> int:
            return int(connection.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'").fetchone()[0])

        epochs: list[int | None] = []

        async def take_over() -> None:
            epochs.append(await b.leases.acquire("desk-0", "b", 60))

        async with anyio.create_task_group() as group:
            try:
                group.start_soon(lambda: notes.write(slow_note, desk="desk-0"))
                assert await anyio.to_thread.run_sync(written.wait, 10)
                with anyio.fail_after(5):  # the lease runs out while the write is in flight
                    while (await b.leases.leases())["desk-0"].live:  # noqa: ASYNC110
                        await anyio.sleep(0.05)
                group.start_soon(take_over)
                with anyio.fail_after(5):
                    while await observer.read(lock_waits) == 0:  # noqa: ASYNC110
                        await anyio.sleep(0.02)
                assert epochs == []  # b waits for a's write to commit
            finally:
                finish.set()
        assert epochs == [2]
        rows = await observer.read(lambda connection: connection.execute(
            "SELECT desk, text FROM notes").fetchall())
        assert [tuple(row) for row in rows] == [("desk-0", "in flight")]
        with pytest.raises(FencedError):
            await notes.write(lambda connection: connection.execute(
                "INSERT INTO notes (desk, text) VALUES ('desk-0', 'late')"), desk="desk-0")

