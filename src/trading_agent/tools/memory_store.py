"""What a desk's notes are to the ``remember`` and ``recall`` tools: a :class:`Note`, and
:class:`DeskMemory`, the protocol they read and write through (the store keeps them:
``store.memory_notes.SqliteMemory``).

Notes are appended, never rewritten: saving a key again adds a newer version, and reading a
key gives its newest.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, runtime_checkable

__all__ = ["DeskMemory", "Note"]


@dataclass(frozen=True)
class Note:
    """One note.

    Attributes:
        key: Its name.
        text: What it says.
        saved_at: When this version was saved.
    """

    key: str
    text: str
    saved_at: datetime


@runtime_checkable
class DeskMemory(Protocol):
    """Where a desk keeps notes across turns, compactions and restarts."""

    async def remember(self, key: str, text: str) -> Note | None:
        """Saves ``text`` under ``key``; returns the version it replaces, if any."""
        ...

    async def recall(self, key: str) -> Note | None:
        """The newest note under ``key``, or None."""
        ...

    async def search(self, word: str, limit: int = 5) -> list[Note]:
        """Newest notes whose key or text contains ``word`` (any case), newest first."""
        ...

    async def recent(self, limit: int = 5) -> list[Note]:
        """The most recently saved notes, one per key, newest first."""
        ...
