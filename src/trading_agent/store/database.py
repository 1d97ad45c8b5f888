"""The store's database: one writer connection, one reader, group commit, migrations, off
the event loop; on a SQLite file (the embedded default) or on PostgreSQL (a fleet).

:meth:`Database.open` chooses the engine by its target: a path is a SQLite file
(:mod:`~trading_agent.store.sqlite_engine`, where ``synchronous=FULL`` is explained), a
:class:`~trading_agent.store.targets.PostgresTarget` a PostgreSQL database
(:mod:`~trading_agent.store.postgres_engine`). What differs between them stays behind
:class:`~trading_agent.store.engine.Engine`; the calls are handed a
:class:`~trading_agent.store.connection.Connection` and run the same SQL on both.

Group commit: so that the commit's fsync is paid per *batch* rather than per write, the
writes queued while a commit is under way are run together, in one transaction, each in a
savepoint of its own, and committed at once. A caller is released only once the commit that
holds its write has returned, so "the await returned" still means "it is on disk"; a write
that fails rolls back to its savepoint and raises to its own caller only. Hundreds of desks
starting their turns at once thus cost a few commits, not hundreds.

Each connection runs one call at a time in a worker thread (``anyio.to_thread``; inline in a
backtest, see :mod:`trading_agent.blocking`). A write that is cancelled once its batch has
started still runs to its end (the thread is never abandoned), so a transaction is never cut
in half; one cancelled while still queued is dropped.

One writer per database: every part of the daemon's state (transcripts, events, the paper
books, the order and risk journals, the kill switch, the desks' notes) lives in one
database, and :meth:`Database.open` hands every caller in a process (per event loop) the
same connections for it, counted, so they share one writer, one group commit and one
durability. Each part brings its own schema as a *component* with its own numbered
migrations (:meth:`Database.migrate`), recorded in ``schema_migrations``.

Fencing: a hold opened with a :class:`~trading_agent.store.fencing.Fence` checks it first,
inside the write's savepoint, for every write that names its desk (``write(call,
desk=...)``): a daemon that lost the desk's lease changes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

import anyio

from trading_agent.blocking import run_blocking
from trading_agent.errors import StorageFullError, StoreError
from trading_agent.store.connection import Connection
from trading_agent.store.engine import Engine, Migration, Session, migrate, run_batch
from trading_agent.store.fencing import Fence
from trading_agent.store.sqlite_engine import MEMORY, SqliteEngine, prepare_state_directory
from trading_agent.store.targets import PostgresTarget, StoreTarget

__all__ = ["Database", "Migration", "StorageWatcher", "prepare_state_directory", "store_error"]

T = TypeVar("T")

_MAX_BATCH = 1000
"""The most writes committed together: a batch holds the write lock (SQLite's file lock, or
PostgreSQL's row locks), which another process waits for."""


StorageWatcher = Callable[[StorageFullError | None], None]
"""Told when the store's disk became full (the error) and when a write succeeded again
(None)."""


def store_error(engine: Engine, error: Exception) -> StoreError:
    """A driver's error as the store raises it: :class:`StorageFullError` when the disk is
    full (naming where to free space), else :class:`StoreError`."""
    location = engine.full_location(error)
    if location is None:
        return StoreError(engine.describe(error))
    return StorageFullError(
        f"the store cannot be written: the disk holding {location} is full "
        f"({engine.describe(error)}); free space there: nothing more is stored until then, "
        "and what was stored before is intact", location)


def _called(call: Callable[[Session], T], session: Session) -> T:
    session.ready()
    return call(session)


class _Link:
    """A session used by one call at a time, in a worker thread."""

    def __init__(self, engine: Engine, session: Session) -> None:
        self._engine = engine
        self._session = session
        self._lock = anyio.Lock()
        self._closed = False

    async def run(self, call: Callable[[Session], T]) -> T:
        async with self._lock:
            if self._closed:
                raise StoreError(f"the store {self._engine.name} is closed")
            try:
                return await run_blocking(partial(_called, call), self._session)
            except self._engine.errors as exc:
                raise store_error(self._engine, exc) from exc

    async def close(self) -> None:
        async with self._lock:
            if not self._closed:
                self._closed = True
                await anyio.to_thread.run_sync(self._session.close)


@dataclass(eq=False)
class _Write:
    """A queued write and, once its batch has committed, its outcome."""

    call: Callable[[Connection], Any]
    taken: bool = False
    """In a batch that has started: it runs to its end even if its caller is cancelled."""
    done: bool = False
    """Its batch has returned: ``result`` or ``error`` holds the outcome."""
    result: Any = None
    error: BaseException | None = None


class _Shared:
    """One open database: its two connections and its queue of writes, shared by every
    :class:`Database` opened on it in one event loop."""

    def __init__(self, engine: Engine, writer: Session, reader: Session | None) -> None:
        self.engine = engine
        self._writer = _Link(engine, writer)
        self._reader = self._writer if reader is None else _Link(engine, reader)
        self._queued: list[_Write] = []
        self._committing = anyio.Lock()
        self._batch_ended = anyio.Event()
        self.users = 0
        self._migrated: set[tuple[str, int]] = set()
        self.commits = 0
        self.writes = 0
        self.full: StorageFullError | None = None
        """The last full-disk error while no write has succeeded since."""
        self.watchers: list[StorageWatcher] = []

    @classmethod
    async def connect(cls, engine: Engine) -> _Shared:
        failures: tuple[type[Exception], ...] = (*engine.errors, OSError)
        try:
            writer, reader = await anyio.to_thread.run_sync(engine.connect)
        except failures as exc:
            raise StoreError(f"cannot open the store {engine.describe(exc)}") from exc
        return cls(engine, writer, reader)

    async def migrate(self, component: str, migrations: Sequence[Migration]) -> None:
        # Every desk opens the same components: each schema is checked once per database.
        newest = (component, max((version for version, _ in migrations), default=0))
        if newest in self._migrated:
            return
        await self._writer.run(lambda session: migrate(session, migrations, component))
        self._migrated.add(newest)

    async def write(self, call: Callable[[Connection], T]) -> T:
        """See :meth:`Database.write`."""
        write = _Write(call)
        self._queued.append(write)
        try:
            while not write.done:
                if self._committing.locked():
                    await self._batch_ended.wait()  # then see whether it held this write
                else:
                    await self._commit_queued()
        except BaseException:
            if not write.taken:
                self._queued.remove(write)
            raise
        error = write.error
        if isinstance(error, self.engine.errors):
            error = store_error(self.engine, error)
            error.__cause__ = write.error
        await self._note_storage(error)
        if error is not None:
            raise error
        return cast(T, write.result)

    async def _note_storage(self, error: BaseException | None) -> None:
        """Tells the watchers when the disk became full, and when there is room again (a
        write got through and the engine sees room to grow: small writes still fit in a
        full database's pages)."""
        if isinstance(error, StorageFullError):
            if self.full is None:
                self.full = error
                for watcher in list(self.watchers):
                    watcher(error)
        elif error is None and self.full is not None:
            try:
                room = await self._writer.run(self.engine.has_room)
            except StoreError:
                return
            if room and self.full is not None:
                self.full = None
                for watcher in list(self.watchers):
                    watcher(None)

    async def _commit_queued(self) -> None:
        """Runs every write queued now (up to :data:`_MAX_BATCH`) in one transaction."""
        async with self._committing:
            batch, self._queued = self._queued[:_MAX_BATCH], self._queued[_MAX_BATCH:]
            ended = self._batch_ended
            try:
                if batch:
                    await self._commit(batch)
            finally:
                # Wakes every waiting caller: those of this batch return, the others queue
                # the next one.
                self._batch_ended = anyio.Event()
                ended.set()

    async def _commit(self, batch: list[_Write]) -> None:
        for write in batch:
            write.taken = True
        calls = [write.call for write in batch]
        try:
            # Shielded: once taken, a batch runs and its callers learn the outcome, even when
            # the task that happens to run it is cancelled.
            with anyio.CancelScope(shield=True):
                outcomes, commits = await self._writer.run(
                    lambda session: run_batch(session, calls))
        except Exception as exc:  # BEGIN or COMMIT failed, or the store is closed
            for write in batch:
                # One exception object each: they are raised in as many tasks.
                failure = (store_error(self.engine, exc)
                           if isinstance(exc, self.engine.errors) else StoreError(str(exc)))
                failure.__cause__ = exc
                write.error, write.done = failure, True
            return
        self.commits += commits
        for write, (result, error) in zip(batch, outcomes, strict=True):
            write.result, write.error, write.done = result, error, True
            self.writes += int(error is None)

    async def read(self, call: Callable[[Connection], T]) -> T:
        """See :meth:`Database.read`."""
        return await self._reader.run(lambda session: call(session.connection))

    async def close(self) -> None:
        await self._writer.close()
        await self._reader.close()


class _Opening:
    """A database being opened: those who ask meanwhile wait for the same one."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.shared: _Shared | None = None


_OpenKey = tuple[str, int]
"""A database (a file's real path, or a PostgreSQL URL) and the event loop using it."""


async def _engine_for(target: StoreTarget) -> tuple[Engine, str | None]:
    """The engine of ``target``, and what names the database among those open (None for
    a ``:memory:`` database, never shared)."""
    if isinstance(target, PostgresTarget):
        from trading_agent.store.postgres_engine import PostgresEngine  # psycopg, only here

        return PostgresEngine(target), f"postgresql {target.url}"
    if str(target) == MEMORY:
        return SqliteEngine(MEMORY), None
    return SqliteEngine(target), str(await anyio.Path(target).resolve())


class Database:
    """The store's database: a writer and a reader connection.

    Use :meth:`open`. Each ``Database`` is one user's hold on the database; every user in the
    process (per event loop) shares the same connections and queue of writes, and the last
    to :meth:`close` closes them.

    Args:
        shared: The open database.
        key: What names it among those open (None: not shared).
        target: Where it is.
        fence: What checks, before a write for a desk, that this daemon still holds it.
    """

    _open: ClassVar[dict[_OpenKey, _Shared | _Opening]] = {}
    """The databases open in this process, by database and event loop."""

    def __init__(self, shared: _Shared, key: _OpenKey | None, target: Path | PostgresTarget,
                 fence: Fence | None = None) -> None:
        self._shared = shared
        self._key = key
        self._target = target
        self._fence = fence
        self._closed = False
        shared.users += 1

    @property
    def target(self) -> Path | PostgresTarget:
        """The SQLite file, or the PostgreSQL database."""
        return self._target

    @property
    def path(self) -> Path:
        """The SQLite file (``:memory:`` for a database of the caller's own).

        Raises:
            StoreError: The store is on PostgreSQL (see :attr:`target`).
        """
        if isinstance(self._target, PostgresTarget):
            raise StoreError(f"the store {self._target} is on PostgreSQL, not in a file")
        return self._target

    @property
    def commits(self) -> int:
        """How many write transactions were committed (on SQLite each cost one fsync)."""
        return self._shared.commits

    @property
    def writes(self) -> int:
        """How many writes were committed."""
        return self._shared.writes

    @property
    def storage_full(self) -> StorageFullError | None:
        """The full-disk error of the last write, while no write has succeeded since."""
        return self._shared.full

    def watch_storage(self, watcher: StorageWatcher) -> Callable[[], None]:
        """Calls ``watcher`` when the disk becomes full (with the error) and when a write
        succeeds again (with None), for every user of this database.

        Returns:
            Stops the watching.
        """
        watchers = self._shared.watchers
        watchers.append(watcher)
        return lambda: watchers.remove(watcher) if watcher in watchers else None

    @classmethod
    async def open(cls, target: StoreTarget, migrations: Sequence[Migration] = (),
                   component: str = "", *, fence: Fence | None = None) -> Database:
        """A hold on the database, opened (or, for a file, created) on first use in this
        process; and ``component``'s schema brought up to date.

        Args:
            target: A SQLite file (its folder is created if missing), ``:memory:`` for a
                database of the caller's own, or a PostgreSQL database (which must exist).
            migrations: The component's migrations, in version order.
            component: Whose schema it is, in the ``schema_migrations`` table.
            fence: Checks, before each write that names its desk, that this daemon still
                holds that desk (see :meth:`write`); None: no write is fenced.

        Raises:
            StoreError: The database cannot be opened, or a migration failed.
        """
        engine, name = await _engine_for(target)
        place = target if isinstance(target, PostgresTarget) else Path(target)
        if name is None:
            database = cls(await _Shared.connect(engine), None, place, fence)
        else:
            key = (name, id(asyncio.get_running_loop()))
            database = cls(await cls._shared_for(key, engine), key, place, fence)
        if migrations:
            try:
                await database.migrate(component, migrations)
            except BaseException:
                await database.close()
                raise
        return database

    @classmethod
    async def _shared_for(cls, key: _OpenKey, engine: Engine) -> _Shared:
        while True:
            found = cls._open.get(key)
            if isinstance(found, _Shared):
                return found
            if found is None:
                break
            await found.done.wait()  # another task is opening it: take what it got
        opening = cls._open[key] = _Opening()
        try:
            shared = await _Shared.connect(engine)
        except BaseException:
            del cls._open[key]
            raise
        finally:
            opening.done.set()
        cls._open[key] = opening.shared = shared
        return shared

    async def migrate(self, component: str, migrations: Sequence[Migration]) -> None:
        """Applies ``component``'s migrations not applied yet, each in a transaction of its
        own, on the writer (between two batches of writes); another process migrating the
        same database at once waits for it (see :func:`~trading_agent.store.engine.migrate`).

        Raises:
            StoreError: A migration failed (it was rolled back), or the database holds a
                newer schema of the component than this program knows.
        """
        await self._shared.migrate(component, migrations)

    async def write(self, call: Callable[[Connection], T], *, desk: str | None = None) -> T:
        """Runs ``call`` in a write transaction on the writer connection; returns once the
        transaction is committed.

        ``call`` may share its transaction with other writes queued at the same moment (see
        the module's docstring); it runs in a savepoint of its own, so what it raises rolls
        back its own changes only, and raises here only. It must not commit or roll back
        (no ``with connection:``).

        Args:
            call: The write.
            desk: The desk it writes for: when this hold has a fence, it checks first (in
                the same savepoint) that this daemon still holds the desk.

        Raises:
            FencedError: This daemon no longer holds ``desk``; nothing was written.
            StoreError: The database failed (the call's changes were rolled back), or the
                store is closed.
            Exception: Whatever else ``call`` raised (its changes were rolled back).
        """
        if self._closed:
            raise StoreError(f"the store {self._target} is closed")
        if desk is not None and self._fence is not None:
            call = partial(_fenced, self._fence, desk, call)
        return await self._shared.write(call)

    def check_fence(self, connection: Connection, desk: str) -> None:
        """Inside a write, checks that this daemon still holds ``desk`` (for a write that
        concerns several desks); nothing when this hold has no fence.

        Raises:
            FencedError: It does not.
        """
        if self._fence is not None:
            self._fence.check(connection, desk)

    async def read(self, call: Callable[[Connection], T]) -> T:
        """Runs ``call`` on the reader connection (it sees every committed write).

        Raises:
            StoreError: The database failed, or the store is closed.
        """
        if self._closed:
            raise StoreError(f"the store {self._target} is closed")
        return await self._shared.read(call)

    async def close(self) -> None:
        """Lets go of the database (idempotent); the last hold on it closes both
        connections once their calls have finished."""
        if self._closed:
            return
        self._closed = True
        self._shared.users -= 1
        if self._shared.users > 0:
            return
        if self._key is not None and self._open.get(self._key) is self._shared:
            del self._open[self._key]
        await self._shared.close()

    def __repr__(self) -> str:
        return f"Database({str(self._target)!r}{', closed' if self._closed else ''})"


def _fenced(fence: Fence, desk: str, call: Callable[[Connection], T],
            connection: Connection) -> T:
    fence.check(connection, desk)
    return call(connection)
