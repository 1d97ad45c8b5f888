"""A desk's notes in the store: what the ``remember`` and ``recall`` tools read and write
(:class:`~trading_agent.tools.memory_store.DeskMemory`).

Notes are appended, never rewritten: saving a key again adds a newer version, and reading a
key gives its newest. Several desks share the store.
"""

from __future__ import annotations

from datetime import datetime

from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration
from trading_agent.store.fencing import Fence
from trading_agent.store.targets import StoreTarget
from trading_agent.tools.memory_store import Note
from trading_agent.trading.timing import Clock, utc_now

__all__ = ["COMPONENT", "MIGRATIONS", "SqliteMemory"]

COMPONENT = "memory_notes"
"""Its schema's name in ``schema_migrations``."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
    """CREATE TABLE IF NOT EXISTS memory_notes (
    seq INTEGER PRIMARY KEY,
    desk TEXT NOT NULL,
    key TEXT NOT NULL,
    text TEXT NOT NULL,
    saved_at TEXT NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS memory_notes_key ON memory_notes (desk, key, seq)",
)),)
"""Numbered migrations: a released one is never edited. The first is written with
``IF NOT EXISTS``: a file made before migrations were numbered already has them."""

# The newest version of each key of a desk.
_LATEST = """
SELECT key, text, saved_at FROM memory_notes
WHERE seq IN (SELECT MAX(seq) FROM memory_notes WHERE desk = ? GROUP BY key)
"""


def _note(row: tuple[str, str, str]) -> Note:
    return Note(row[0], row[1], datetime.fromisoformat(row[2]))


def _like(word: str) -> str:
    escaped = word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


class SqliteMemory:
    """A desk's notes in the store. Use :meth:`open`.

    Args:
        database: The open database, its schema applied.
        desk: The desk's name.
        clock: What time a note is saved at (the exchange clock, so a replay's notes carry
            replayed time).
    """

    def __init__(self, database: Database, desk: str, clock: Clock = utc_now) -> None:
        self._database = database
        self.desk = desk
        self._clock = clock

    @classmethod
    async def open(cls, target: StoreTarget, desk: str, clock: Clock = utc_now, *,
                   fence: Fence | None = None) -> SqliteMemory:
        """Opens (or creates) the notes in the state file, or the PostgreSQL store.

        Args:
            target: The store.
            desk: The desk's name.
            clock: What time a note is saved at.
            fence: Checks before each note is saved that this daemon still holds the desk.

        Raises:
            StoreError: The store cannot be opened.
        """
        return cls(await Database.open(target, MIGRATIONS, COMPONENT, fence=fence), desk, clock)

    async def remember(self, key: str, text: str) -> Note | None:
        """Appends a new version of ``key``; returns the previous one."""
        desk, saved_at = self.desk, self._clock().isoformat()

        def write(connection: Connection) -> Note | None:
            previous = connection.execute(
                "SELECT key, text, saved_at FROM memory_notes WHERE desk = ? AND key = ? "
                "ORDER BY seq DESC LIMIT 1", (desk, key)).fetchone()
            connection.execute("INSERT INTO memory_notes (desk, key, text, saved_at) "
                               "VALUES (?, ?, ?, ?)", (desk, key, text, saved_at))
            return None if previous is None else _note(previous)

        return await self._database.write(write, desk=desk)

    async def recall(self, key: str) -> Note | None:
        """The newest version of ``key``."""
        desk = self.desk

        def read(connection: Connection) -> Note | None:
            row = connection.execute(
                "SELECT key, text, saved_at FROM memory_notes WHERE desk = ? AND key = ? "
                "ORDER BY seq DESC LIMIT 1", (desk, key)).fetchone()
            return None if row is None else _note(row)

        return await self._database.read(read)

    async def search(self, word: str, limit: int = 5) -> list[Note]:
        """Newest notes mentioning ``word`` in their key or text."""
        desk, pattern = self.desk, _like(word)

        def read(connection: Connection) -> list[Note]:
            return [_note(row) for row in connection.execute(
                # LOWER on both sides: LIKE ignores case on SQLite, not on PostgreSQL.
                f"SELECT * FROM ({_LATEST}) AS latest WHERE LOWER(key) LIKE LOWER(?) "
                "ESCAPE '\\' OR LOWER(text) LIKE LOWER(?) ESCAPE '\\' "
                "ORDER BY saved_at DESC LIMIT ?",
                (desk, pattern, pattern, limit))]

        return await self._database.read(read)

    async def recent(self, limit: int = 5) -> list[Note]:
        """The newest notes, one per key."""
        desk = self.desk

        def read(connection: Connection) -> list[Note]:
            return [_note(row) for row in connection.execute(
                f"SELECT * FROM ({_LATEST}) AS latest ORDER BY saved_at DESC LIMIT ?",
                (desk, limit))]

        return await self._database.read(read)

    async def keys(self) -> list[str]:
        """Every key the desk has used, sorted."""
        desk = self.desk

        def read(connection: Connection) -> list[str]:
            return [key for (key,) in connection.execute(
                "SELECT DISTINCT key FROM memory_notes WHERE desk = ? ORDER BY key", (desk,))]

        return await self._database.read(read)

    async def close(self) -> None:
        """Lets go of the store."""
        await self._database.close()
