"""The store's SQLite file: one writer connection, one reader, migrations, off the event loop.

Why ``synchronous=FULL``: in WAL mode ``NORMAL`` never corrupts the file, but a power cut
may lose the last commits. The store promises an operator that a message is kept *before*
it says so, and it keeps the record of orders and fills; a promise that a power cut can
take back is not one. ``FULL`` costs one fsync per commit.

Group commit: so that the fsync is paid per *batch* rather than per write, the writes
queued while a commit is under way are run together, in one transaction, each in a
savepoint of its own, and committed with one fsync. A caller is released only once the
commit that holds its write has returned, so "the await returned" still means "it is on
disk"; a write that fails rolls back to its savepoint and raises to its own caller only.
Hundreds of desks starting their turns at once thus cost a few commits, not hundreds.

Each connection runs one call at a time in a worker thread (``anyio.to_thread``; inline in a
backtest, see :mod:`trading_agent.blocking`). A write
that is cancelled once its batch has started still runs to its end (the thread is never
abandoned), so a transaction is never cut in half; one cancelled while still queued is
dropped. Writes take the write lock up front (``BEGIN IMMEDIATE``), so a second process or
component writing the same file waits (``busy_timeout``) instead of failing half-way.

One writer per file: every part of the daemon's state (transcripts, events, the paper
books, the order and risk journals, the kill switch, the desks' notes) lives in one file, and
:meth:`Database.open` hands every caller in a process (per event loop) the same open
``Database`` for it, counted, so they share one writer, one group commit and one durability.
Each part brings its own schema as a *component* with its own numbered migrations
(:meth:`Database.migrate`), recorded in ``schema_migrations``.

Who may read it: the file is created 0600 (SQLite gives its ``-wal`` and ``-shm`` files the
mode of the file itself), and :func:`prepare_state_directory` makes the daemon's state
directory 0700: the conversations, orders and balances are the operator's alone.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

import anyio
import structlog

from trading_agent.blocking import run_blocking
from trading_agent.errors import ConfigError, StoreError

__all__ = ["Database", "Migration", "prepare_state_directory", "transaction"]

T = TypeVar("T")

Migration = tuple[int, Sequence[str]]
"""A schema version and the statements that bring the schema to it."""

_BUSY_TIMEOUT_MS = 10_000

_MAX_BATCH = 1000
"""The most writes committed together: a batch holds the file's write lock, which another
process on the file (a ``check-config``, a script) waits for."""

_MEMORY = ":memory:"
"""A database of its own that lives as long as its connection (tests, what-if runs): its
reads go through the writer, as a second connection would see another database."""

_PRIVATE_DIRECTORY = 0o700
_PRIVATE_FILE = 0o600

_log = structlog.get_logger(__name__)


def prepare_state_directory(folder: Path) -> None:
    """Creates the daemon's state directory for its owner alone (0700); when it exists with
    more open permissions (made before this rule, or by hand), closes it and the files in
    it (0600), and logs what it changed.

    Args:
        folder: The state directory.

    Raises:
        ConfigError: The directory cannot be created (a file is in the way, no permission,
            a read-only file system), naming it and the system's reason.
    """
    try:
        folder.mkdir(mode=_PRIVATE_DIRECTORY, parents=True, exist_ok=True)
    except OSError as exc:
        reason = ("it exists and is not a directory" if isinstance(exc, FileExistsError)
                  else exc.strerror or str(exc))
        raise ConfigError(f"cannot create the state directory {folder}: {reason}") from exc
    try:
        entries = _entries(folder)
    except OSError as exc:
        raise ConfigError(f"cannot read the state directory {folder}: "
                          f"{exc.strerror or exc}") from exc
    tightened = [path for path, mode in entries if _tighten(path, mode)]
    if tightened:
        _log.warning("state_permissions_tightened", state_dir=str(folder),
                     paths=[str(path) for path in tightened],
                     reason="group and others could read the daemon's state")


def _entries(folder: Path) -> list[tuple[Path, int]]:
    """The folder and the files (sockets included) directly in it, with their modes; not
    what a symbolic link points to."""
    found = [(folder, folder.stat().st_mode)]
    with os.scandir(folder) as entries:
        for entry in entries:
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISREG(mode) or stat.S_ISSOCK(mode):
                found.append((Path(entry.path), mode))
    return found


def _tighten(path: Path, mode: int) -> bool:
    """Takes group's and others' permissions off ``path``; whether it changed anything."""
    if not stat.S_IMODE(mode) & 0o077:
        return False
    wanted = _PRIVATE_DIRECTORY if stat.S_ISDIR(mode) else _PRIVATE_FILE
    try:
        os.chmod(path, wanted)
    except OSError as exc:  # another user's file: say so, and run anyway
        _log.warning("state_permissions_not_tightened", path=str(path),
                     mode=oct(stat.S_IMODE(mode)), error=exc.strerror or str(exc))
        return False
    return True


def _create_private(path: Path) -> None:
    """Creates the SQLite file empty and 0600 when missing (SQLite would make it 0644 less
    the umask, and its ``-wal`` and ``-shm`` files take the file's mode)."""
    if not os.path.lexists(path):
        os.close(os.open(path, os.O_CREAT | os.O_RDONLY | os.O_CLOEXEC, _PRIVATE_FILE))


@contextmanager
def transaction(connection: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction, holding the write lock from its start.

    Args:
        connection: A connection in autocommit mode (``isolation_level=None``).

    Yields:
        The connection.
    """
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield connection
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


def _connect(path: Path | str, *, read_only: bool) -> sqlite3.Connection:
    connection = sqlite3.connect(path, check_same_thread=False, isolation_level=None,
                                 timeout=_BUSY_TIMEOUT_MS / 1000)
    connection.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
    if read_only:
        connection.execute("PRAGMA query_only=ON")
    else:
        mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal" and str(path) != _MEMORY:
            raise StoreError(f"{path}: SQLite refused WAL mode (journal mode {mode})")
        connection.execute("PRAGMA synchronous=FULL")
        connection.execute("PRAGMA foreign_keys=ON")
    return connection


class _Connection:
    """A connection used by one call at a time, in a worker thread."""

    def __init__(self, path: Path | str, connection: sqlite3.Connection) -> None:
        self._path = path
        self._connection = connection
        self._lock = anyio.Lock()
        self._closed = False

    async def run(self, call: Callable[[sqlite3.Connection], T]) -> T:
        async with self._lock:
            if self._closed:
                raise StoreError(f"the store {self._path} is closed")
            try:
                return await run_blocking(call, self._connection)
            except sqlite3.Error as exc:
                raise StoreError(f"{self._path}: {exc}") from exc

    async def close(self) -> None:
        async with self._lock:
            if not self._closed:
                self._closed = True
                await anyio.to_thread.run_sync(self._connection.close)


@dataclass(eq=False)
class _Write:
    """A queued write and, once its batch has committed, its outcome."""

    call: Callable[[sqlite3.Connection], Any]
    taken: bool = False
    """In a batch that has started: it runs to its end even if its caller is cancelled."""
    done: bool = False
    """Its batch has returned: ``result`` or ``error`` holds the outcome."""
    result: Any = None
    error: BaseException | None = None


def _run_batch(connection: sqlite3.Connection, calls: Sequence[Callable[[sqlite3.Connection], Any]]
               ) -> tuple[list[tuple[Any, BaseException | None]], int]:
    """Runs ``calls`` in one transaction, each in its own savepoint, and commits once.

    A call that raises is rolled back to its savepoint and the others go on. An error that
    rolls back the whole transaction (SQLite does for a full disk or an I/O error) fails
    only that call: the calls that had succeeded are run again in a new transaction.

    Returns:
        Each call's (result, error), in order, and how many transactions were committed.

    Raises:
        sqlite3.Error: ``BEGIN`` or ``COMMIT`` failed: no call took effect.
    """
    outcomes: list[tuple[Any, BaseException | None]] = [(None, None)] * len(calls)
    pending = list(range(len(calls)))
    while pending:
        connection.execute("BEGIN IMMEDIATE")
        try:
            survivors: list[int] = []
            for position, index in enumerate(pending):
                connection.execute("SAVEPOINT write")
                try:
                    outcomes[index] = (calls[index](connection), None)
                    connection.execute("RELEASE write")
                except Exception as exc:
                    outcomes[index] = (None, exc)
                    if not connection.in_transaction:  # SQLite rolled it all back
                        pending = survivors + pending[position + 1:]
                        break
                    connection.execute("ROLLBACK TO write")
                    connection.execute("RELEASE write")
                else:
                    survivors.append(index)
            else:
                connection.execute("COMMIT")
                return outcomes, 1
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise
    return outcomes, 0


_OpenKey = tuple[str, int]
"""A file's real path and the event loop using it."""


class _File:
    """One open file: its two connections and its queue of writes, shared by every
    :class:`Database` opened on it in one event loop."""

    def __init__(self, path: Path, writer: sqlite3.Connection,
                 reader: sqlite3.Connection | None) -> None:
        self.path = path
        self._writer = _Connection(path, writer)
        self._reader = self._writer if reader is None else _Connection(path, reader)
        self._queued: list[_Write] = []
        self._committing = anyio.Lock()
        self._batch_ended = anyio.Event()
        self.users = 0
        self._migrated: set[tuple[str, int]] = set()
        self.commits = 0
        self.writes = 0

    @classmethod
    async def connect(cls, path: Path | str) -> _File:
        def connect() -> _File:
            if str(path) == _MEMORY:
                return cls(Path(_MEMORY), _connect(_MEMORY, read_only=False), None)
            file = Path(path)
            file.parent.mkdir(mode=_PRIVATE_DIRECTORY, parents=True, exist_ok=True)
            _create_private(file)
            writer = _connect(file, read_only=False)
            try:
                reader = _connect(file, read_only=True)
            except BaseException:
                writer.close()
                raise
            return cls(file, writer, reader)

        try:
            return await anyio.to_thread.run_sync(connect)
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open the store {path}: {exc}") from exc

    async def migrate(self, component: str, migrations: Sequence[Migration]) -> None:
        # Every desk opens the same components: each schema is checked once per file.
        newest = (component, max((version for version, _ in migrations), default=0))
        if newest in self._migrated:
            return
        await self._writer.run(lambda connection: _migrate(connection, migrations, component))
        self._migrated.add(newest)

    async def write(self, call: Callable[[sqlite3.Connection], T]) -> T:
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
        if isinstance(write.error, sqlite3.Error):
            raise StoreError(f"{self.path}: {write.error}") from write.error
        if write.error is not None:
            raise write.error
        return cast(T, write.result)

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
                    lambda connection: _run_batch(connection, calls))
        except Exception as exc:  # BEGIN or COMMIT failed, or the store is closed
            for write in batch:
                # One exception object each: they are raised in as many tasks.
                failure = StoreError(str(exc))
                failure.__cause__ = exc
                write.error, write.done = failure, True
            return
        self.commits += commits
        for write, (result, error) in zip(batch, outcomes, strict=True):
            write.result, write.error, write.done = result, error, True
            self.writes += int(error is None)

    async def read(self, call: Callable[[sqlite3.Connection], T]) -> T:
        """See :meth:`Database.read`."""
        return await self._reader.run(call)

    async def close(self) -> None:
        await self._writer.close()
        await self._reader.close()


class _Opening:
    """A file being opened: those who ask meanwhile wait for the same one."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.file: _File | None = None


class Database:
    """The SQLite file: a writer and a reader connection (WAL lets them work at once).

    Use :meth:`open`. Each ``Database`` is one user's hold on the file; every user in the
    process (per event loop) shares the same connections and queue of writes, and the last
    to :meth:`close` closes them.

    Args:
        file: The open file.
    """

    _open: ClassVar[dict[_OpenKey, _File | _Opening]] = {}
    """The files open in this process, by real path and event loop."""

    def __init__(self, file: _File, key: _OpenKey | None) -> None:
        self._file = file
        self._key = key
        self._closed = False
        file.users += 1

    @property
    def path(self) -> Path:
        """The file."""
        return self._file.path

    @property
    def commits(self) -> int:
        """How many write transactions were committed on the file (each cost one fsync)."""
        return self._file.commits

    @property
    def writes(self) -> int:
        """How many writes were committed on the file."""
        return self._file.writes

    @classmethod
    async def open(cls, path: Path | str, migrations: Sequence[Migration] = (),
                   component: str = "") -> Database:
        """A hold on the file, opened (or created) on first use in this process; and
        ``component``'s schema brought up to date.

        Args:
            path: The file (its folder is created if missing), or ``:memory:`` for a
                database of the caller's own.
            migrations: The component's migrations, in version order.
            component: Whose schema it is, in the ``schema_migrations`` table.

        Raises:
            StoreError: The file cannot be opened, or a migration failed.
        """
        if str(path) == _MEMORY:
            database = cls(await _File.connect(path), None)
        else:
            key = (str(await anyio.Path(path).resolve()), id(asyncio.get_running_loop()))
            database = cls(await cls._shared(key, path), key)
        if migrations:
            try:
                await database.migrate(component, migrations)
            except BaseException:
                await database.close()
                raise
        return database

    @classmethod
    async def _shared(cls, key: _OpenKey, path: Path | str) -> _File:
        while True:
            found = cls._open.get(key)
            if isinstance(found, _File):
                return found
            if found is None:
                break
            await found.done.wait()  # another task is opening it: take what it got
        opening = cls._open[key] = _Opening()
        try:
            file = await _File.connect(path)
        except BaseException:
            del cls._open[key]
            raise
        finally:
            opening.done.set()
        cls._open[key] = opening.file = file
        return file

    async def migrate(self, component: str, migrations: Sequence[Migration]) -> None:
        """Applies ``component``'s migrations not applied yet, each in a transaction of its
        own, on the writer (between two batches of writes).

        Raises:
            StoreError: A migration failed (it was rolled back), or the file holds a newer
                schema of the component than this program knows.
        """
        await self._file.migrate(component, migrations)

    async def write(self, call: Callable[[sqlite3.Connection], T]) -> T:
        """Runs ``call`` in a write transaction on the writer connection; returns once the
        transaction is committed.

        ``call`` may share its transaction with other writes queued at the same moment (see
        the module's docstring); it runs in a savepoint of its own, so what it raises rolls
        back its own changes only, and raises here only. It must not commit or roll back
        (no ``with connection:``).

        Raises:
            StoreError: SQLite failed (the call's changes were rolled back), or the store is
                closed.
            Exception: Whatever else ``call`` raised (its changes were rolled back).
        """
        if self._closed:
            raise StoreError(f"the store {self.path} is closed")
        return await self._file.write(call)

    async def read(self, call: Callable[[sqlite3.Connection], T]) -> T:
        """Runs ``call`` on the reader connection (it sees every committed write).

        Raises:
            StoreError: SQLite failed, or the store is closed.
        """
        if self._closed:
            raise StoreError(f"the store {self.path} is closed")
        return await self._file.read(call)

    async def close(self) -> None:
        """Lets go of the file (idempotent); the last hold on it closes both connections
        once their calls have finished."""
        if self._closed:
            return
        self._closed = True
        self._file.users -= 1
        if self._file.users > 0:
            return
        if self._key is not None and self._open.get(self._key) is self._file:
            del self._open[self._key]
        await self._file.close()

    def __repr__(self) -> str:
        return f"Database({str(self.path)!r}{', closed' if self._closed else ''})"


def _migrate(connection: sqlite3.Connection, migrations: Sequence[Migration],
             component: str) -> None:
    """Applies the migrations not applied yet, each in its own transaction."""
    connection.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " component TEXT NOT NULL, version INTEGER NOT NULL, applied_at REAL NOT NULL,"
        " PRIMARY KEY (component, version))")
    with transaction(connection):
        applied = {row[0] for row in connection.execute(
            "SELECT version FROM schema_migrations WHERE component = ?", (component,))}
    newest_known = max((version for version, _ in migrations), default=0)
    if applied and max(applied) > newest_known:
        raise StoreError(f"the store's {component} schema is version {max(applied)}, newer than "
                         f"this program knows ({newest_known}); run a newer trading-agent")
    for version, statements in migrations:
        with transaction(connection):
            # Checked again under the write lock: another process may have just applied it.
            done = connection.execute(
                "SELECT 1 FROM schema_migrations WHERE component = ? AND version = ?",
                (component, version)).fetchone()
            if done is not None:
                continue
            for statement in statements:
                connection.execute(statement)
            connection.execute(
                "INSERT INTO schema_migrations (component, version, applied_at) VALUES (?, ?, ?)",
                (component, version, time.time()))
