"""The store on a SQLite file: the embedded default.

Why ``synchronous=FULL``: in WAL mode ``NORMAL`` never corrupts the file, but a power cut
may lose the last commits. The store promises an operator that a message is kept *before*
it says so, and it keeps the record of orders and fills; a promise that a power cut can
take back is not one. ``FULL`` costs one fsync per commit (and the group commit of
:mod:`~trading_agent.store.database` pays it per batch of writes).

Writes take the write lock up front (``BEGIN IMMEDIATE``), so a second process writing the
same file waits (``busy_timeout``) instead of failing half-way; so do migrations, which is
what keeps two processes from migrating at once. WAL lets the reader connection read while
the writer writes.

Who may read it: the file is created 0600 (SQLite gives its ``-wal`` and ``-shm`` files the
mode of the file itself), and :func:`prepare_state_directory` makes the daemon's state
directory 0700: the conversations, orders and balances are the operator's alone.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from pathlib import Path

import structlog

from trading_agent.errors import ConfigError, StoreError
from trading_agent.store.connection import Connection
from trading_agent.store.engine import Session

__all__ = ["MEMORY", "SqliteEngine", "prepare_state_directory"]

MEMORY = ":memory:"
"""A database of its own that lives as long as its connection (tests, what-if runs): its
reads go through the writer, as a second connection would see another database."""

_BUSY_TIMEOUT_MS = 10_000

_ROOM_BYTES = 1 << 20
"""Free space (on the disk, and under ``max_page_count``) after which a full store counts
as writable again."""

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


def _connect(path: Path | str, *, read_only: bool) -> sqlite3.Connection:
    connection = sqlite3.connect(path, check_same_thread=False, isolation_level=None,
                                 timeout=_BUSY_TIMEOUT_MS / 1000)
    connection.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
    if read_only:
        connection.execute("PRAGMA query_only=ON")
    else:
        mode = _journal_mode_wal(connection)
        if str(mode).lower() != "wal" and str(path) != MEMORY:
            raise StoreError(f"{path}: SQLite refused WAL mode (journal mode {mode})")
        connection.execute("PRAGMA synchronous=FULL")
        connection.execute("PRAGMA foreign_keys=ON")
    return connection


def _journal_mode_wal(connection: sqlite3.Connection) -> str:
    """Puts the file in WAL mode (it stays so); returns the journal mode it is in.

    A connection changing the mode of a new file while another does answers "database is
    locked" at once, without waiting out ``busy_timeout`` (several processes starting on
    one new file): it is tried again, for as long as that timeout.
    """
    deadline = time.monotonic() + _BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            return str(connection.execute("PRAGMA journal_mode=WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class _SqliteSession:
    """One connection to the file; a call is handed the ``sqlite3.Connection`` itself."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._connection = connection

    @property
    def connection(self) -> Connection:
        return self._connection

    @property
    def in_transaction(self) -> bool:
        return self._connection.in_transaction

    def ready(self) -> None:
        pass

    def begin(self) -> None:
        self._connection.execute("BEGIN IMMEDIATE")

    def begin_migration(self) -> None:
        self._connection.execute("BEGIN IMMEDIATE")  # the file's one write lock

    def schema(self, statement: str) -> str:
        return statement

    def close(self) -> None:
        self._connection.close()


class SqliteEngine:
    """A SQLite file, created 0600 (its folder 0700) when missing.

    Args:
        path: The file, or ``:memory:``.
    """

    errors: tuple[type[Exception], ...] = (sqlite3.Error,)

    def __init__(self, path: Path | str) -> None:
        self.path = path

    @property
    def name(self) -> str:
        return str(self.path)

    def describe(self, error: Exception) -> str:
        return f"{self.path}: {error}"

    def full_location(self, error: Exception) -> str | None:
        # SQLITE_FULL: the file system said ENOSPC, or the file reached max_page_count.
        code = getattr(error, "sqlite_errorcode", None)
        if not isinstance(code, int) or code & 0xFF != sqlite3.SQLITE_FULL:
            return None
        return "memory" if str(self.path) == MEMORY else str(Path(self.path).parent)

    def has_room(self, session: Session) -> bool:
        # Small writes still fit in a full database's partly used pages: room means space
        # for new pages, on the file system and under the connection's max_page_count.
        connection = session.connection
        pages = connection.execute("PRAGMA page_count").fetchone()[0]
        limit = connection.execute("PRAGMA max_page_count").fetchone()[0]
        page_size = connection.execute("PRAGMA page_size").fetchone()[0]
        if pages + _ROOM_BYTES // page_size > limit:
            return False
        if str(self.path) == MEMORY:
            return True
        try:
            stats = os.statvfs(Path(self.path).parent)
        except OSError:
            return True
        return stats.f_bavail * stats.f_frsize >= _ROOM_BYTES

    def connect(self) -> tuple[_SqliteSession, _SqliteSession | None]:
        if str(self.path) == MEMORY:
            return _SqliteSession(_connect(MEMORY, read_only=False)), None
        file = Path(self.path)
        file.parent.mkdir(mode=_PRIVATE_DIRECTORY, parents=True, exist_ok=True)
        _create_private(file)
        writer = _connect(file, read_only=False)
        try:
            reader = _connect(file, read_only=True)
        except BaseException:
            writer.close()
            raise
        return _SqliteSession(writer), _SqliteSession(reader)

    def __repr__(self) -> str:
        return f"SqliteEngine({str(self.path)!r})"
