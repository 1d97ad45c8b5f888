"""Group commit: the writes queued while a commit runs share the next transaction and fsync;
on a SQLite file and on PostgreSQL alike."""

from __future__ import annotations

import re
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest

from tests.store.conftest import FakeClock
from trading_agent.agent.conversation import Message
from trading_agent.errors import StoreError
from trading_agent.store import Connection, Store, StoreTarget
from trading_agent.store.database import Database

_SCHEMA = (
    (1, ("CREATE TABLE notes (key TEXT PRIMARY KEY, text TEXT NOT NULL)",)),
)


@pytest.fixture
async def database(target: StoreTarget) -> AsyncIterator[Database]:
    opened = await Database.open(target, _SCHEMA, "test")
    try:
        yield opened
    finally:
        await opened.close()


def _insert(key: str, text: str = "x") -> Callable[[Connection], str]:
    def call(connection: Connection) -> str:
        connection.execute("INSERT INTO notes (key, text) VALUES (?, ?)", (key, text))
        return key

    return call


async def _keys(database: Database) -> list[str]:
    return await database.read(lambda connection: [row[0] for row in connection.execute(
        "SELECT key FROM notes ORDER BY rowid")])


class _Held:
    """A first write that holds the writer until released, so the next ones queue behind it
    and form one batch, whatever the scheduling."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, connection: Connection) -> str:
        self.started.set()
        assert self.release.wait(10), "the test never released the first write"
        return _insert("first")(connection)

    async def wait_started(self) -> None:
        with anyio.fail_after(10):
            while not self.started.is_set():  # noqa: ASYNC110
                await anyio.sleep(0.001)


async def test_concurrent_writes_share_one_commit(database: Database) -> None:
    held = _Held()
    results: dict[str, str] = {}

    async def write(call: Callable[[Connection], str]) -> None:
        key = await database.write(call)
        # Released only once committed: the reader connection already sees the row.
        assert key in await _keys(database)
        results[key] = key

    async with anyio.create_task_group() as group:
        group.start_soon(write, held)
        await held.wait_started()
        for number in range(50):
            group.start_soon(write, _insert(f"k{number}"))
        await anyio.wait_all_tasks_blocked()
        assert results == {}  # nobody released before its commit
        held.release.set()

    assert len(results) == 51
    assert await _keys(database) == ["first", *(f"k{number}" for number in range(50))]
    assert (database.commits, database.writes) == (2, 51)


async def test_a_failing_write_raises_to_its_caller_only(database: Database) -> None:
    await database.write(_insert("taken"))
    held = _Held()
    outcomes: dict[str, object] = {}

    def half_then_fail(connection: Connection) -> str:
        connection.execute("INSERT INTO notes (key, text) VALUES ('half', 'x')")
        raise ValueError("a bug in the call")

    async def write(name: str, call: Callable[[Connection], str]) -> None:
        try:
            outcomes[name] = await database.write(call)
        except (StoreError, ValueError) as exc:
            outcomes[name] = exc

    async with anyio.create_task_group() as group:
        group.start_soon(write, "first", held)
        await held.wait_started()
        group.start_soon(write, "a", _insert("a"))
        group.start_soon(write, "duplicate", _insert("taken"))
        group.start_soon(write, "b", _insert("b"))
        group.start_soon(write, "bug", half_then_fail)
        group.start_soon(write, "c", _insert("c"))
        await anyio.wait_all_tasks_blocked()
        held.release.set()

    assert {name: outcomes[name] for name in ("first", "a", "b", "c")} == {
        "first": "first", "a": "a", "b": "b", "c": "c"}
    duplicate = outcomes["duplicate"]
    assert isinstance(duplicate, StoreError) and re.search(
        "UNIQUE constraint failed|duplicate key value violates unique constraint",
        str(duplicate))
    assert isinstance(outcomes["bug"], ValueError)
    # The failing call's own changes were rolled back; the others' committed, together.
    assert await _keys(database) == ["taken", "first", "a", "b", "c"]
    assert database.commits == 3


async def test_a_write_that_fills_the_disk_fails_alone(tmp_path: Path) -> None:
    """SQLite rolls the whole transaction back on a full disk: the writes before it in the
    batch are run again, so only the one too big is lost."""
    database = await Database.open(tmp_path / "db.sqlite3", _SCHEMA, "test")
    try:
        await _fill_the_disk(database)
    finally:
        await database.close()


async def _fill_the_disk(database: Database) -> None:
    await database.write(lambda connection: connection.execute("PRAGMA max_page_count = 8"))
    held = _Held()
    outcomes: dict[str, object] = {}

    async def write(name: str, call: Callable[[Connection], str]) -> None:
        try:
            outcomes[name] = await database.write(call)
        except StoreError as exc:
            outcomes[name] = exc

    async with anyio.create_task_group() as group:
        group.start_soon(write, "first", held)
        await held.wait_started()
        group.start_soon(write, "a", _insert("a"))
        group.start_soon(write, "huge", _insert("huge", "x" * 200_000))
        group.start_soon(write, "b", _insert("b"))
        await anyio.wait_all_tasks_blocked()
        held.release.set()

    assert (outcomes["first"], outcomes["a"], outcomes["b"]) == ("first", "a", "b")
    assert isinstance(outcomes["huge"], StoreError) and "full" in str(outcomes["huge"])
    assert await _keys(database) == ["first", "a", "b"]


async def test_a_write_cancelled_while_queued_never_runs(database: Database) -> None:
    held = _Held()
    scope = anyio.CancelScope()

    async def cancelled() -> None:
        with scope:
            await database.write(_insert("dropped"))

    async with anyio.create_task_group() as group:
        group.start_soon(database.write, held)
        await held.wait_started()
        group.start_soon(database.write, _insert("kept"))
        group.start_soon(cancelled)
        await anyio.wait_all_tasks_blocked()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        held.release.set()
    assert await _keys(database) == ["first", "kept"]
    assert database.commits == 2


async def test_a_closed_database_refuses_writes(database: Database) -> None:
    await database.close()
    with pytest.raises(StoreError, match="closed"):
        await database.write(_insert("late"))


async def test_store_appends_from_many_desks_take_few_commits(target: StoreTarget) -> None:
    """The case group commit is for: every desk storing its trigger at the same moment."""
    store = await Store.open(target, clock=FakeClock())
    try:
        async with anyio.create_task_group() as group:
            for number in range(200):
                group.start_soon(store.transcripts.append_message, f"desk{number}",
                                 Message.user_text(f"tick {number}"))
        assert store.database.writes == 200
        assert store.database.commits <= 10
        for number in (0, 199):
            [stored] = await store.transcripts.transcript(f"desk{number}")
            assert stored["text"] == f"tick {number}"
    finally:
        await store.close()


async def test_many_processes_starting_at_once_migrate_without_error(
        target: StoreTarget) -> None:
    """Daemons starting together on one database: each event loop opens connections of its
    own (as another process would), and each migration is applied once."""
    starting = threading.Barrier(4)
    failures: list[BaseException] = []

    async def open_store() -> None:
        starting.wait(10)
        async with await Store.open(target):
            pass

    def start() -> None:
        try:
            anyio.run(open_store)
        except BaseException as exc:  # reported below, with the thread's name
            failures.append(exc)

    threads = [threading.Thread(target=start, name=f"daemon-{n}") for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        await anyio.to_thread.run_sync(thread.join, 30)
    assert failures == []
    database = await Database.open(target)
    try:
        versions = await database.read(lambda connection: connection.execute(
            "SELECT component, version FROM schema_migrations ORDER BY version").fetchall())
    finally:
        await database.close()
    assert [tuple(row) for row in versions] == [("store", version) for version in range(1, 7)]


async def test_holds_on_one_database_in_one_loop_share_the_writer(target: StoreTarget) -> None:
    first = await Database.open(target, _SCHEMA, "test")
    second = await Database.open(target, _SCHEMA, "test")
    try:
        async with anyio.create_task_group() as group:
            for number in range(20):
                group.start_soon(first.write, _insert(f"a{number}"))
                group.start_soon(second.write, _insert(f"b{number}"))
        assert first.writes == second.writes == 40
        assert first.commits < 40
    finally:
        await first.close()
    # The last hold keeps the connections open; then closing it closes them.
    assert len(await _keys(second)) == 40
    await second.close()
    with pytest.raises(StoreError, match="closed"):
        await second.read(lambda connection: None)
